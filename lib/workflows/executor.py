"""The executor: runs one workflow's DAG and emits its block events.

It emits only ``block:*`` events; the caller emits ``execution:*`` ones. Blocks run in
one task group per execution, so a failure or a cancellation of ``run`` cancels every
running block and leaves no task behind.

A block that asks for approval stops its branch; the others run on. Once nothing else
can run, ``run`` raises ``Paused`` with the state to resume from (outputs so far, the
skipped blocks, the answers given). ``run(state=…)`` carries on from such a state; the
block that asked runs again and gets its answer.

Every event that moves the run forward carries its checkpoint fields (checkpoint.py),
so the state a resume or a recovery starts from is the one the event log shows. Outputs
are kept as the checkpoint keeps them (large ones as refs) and loaded again only when
a template reads them. Once ``drain`` is set (a shutdown), no block starts any more;
when the running ones have finished, ``run`` raises ``HandedOff`` and another process
carries on from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from lib import tracing
from lib.errors import BlockError, FlowcastError
from lib.execution.events import (
    BLOCK_CHUNK,
    BLOCK_COMPLETED,
    BLOCK_FAILED,
    BLOCK_SKIPPED,
    BLOCK_STARTED,
    carried,
)
from lib.letgo import let_go
from lib.slices import size_past
from lib.workflows.blocks import BlockTypes
from lib.workflows.blocks.base import BlockContext, BlockServices, PauseRequested
from lib.workflows.checkpoint import (
    Keeper,
    attempt_field,
    holds_refs,
    output_field,
    skipped_field,
)
from lib.workflows.holdings import Holdings
from lib.workflows.model import BlockDef, Edge, Workflow
from lib.workflows.outcomes import BlockFailed, HandedOff, Pause, Paused, RunState
from lib.workflows.secrets import RunSecrets, SecretStore
from lib.workflows.templates import block_reads, template_strings

# The outcomes live in outcomes.py; the modules that import them from here still may.
__all__ = ["BlockFailed", "Executor", "HandedOff", "Pause", "Paused", "RunState"]

log = logging.getLogger(__name__)

# The caller's publish function: (type, data, checkpoint fields); what it returns (e.g.
# the Event) is ignored.
Emit = Callable[..., object]

# Waits between attempts are capped; a Retry-After beyond the cap ends the retries.
MAX_BACKOFF_SECONDS = 900.0
_JITTER = 0.1


class _Deferred(Exception):
    """A block that may not start because the run is draining."""


def backoff_delay(base_ms: int, attempt: int, retry_after: float | None) -> float:
    """Seconds to wait after failed ``attempt``: exponential, jittered, >= retry_after."""
    delay = base_ms / 1000 * 2.0 ** (attempt - 1)
    delay = min(delay * (1 + _JITTER * random.random()), MAX_BACKOFF_SECONDS)
    return max(delay, retry_after or 0.0)


class Executor:
    """Runs workflows with the given block types and services."""

    def __init__(
        self,
        block_types: BlockTypes,
        services: BlockServices,
        concurrency: int = 8,
        *,
        secrets: SecretStore | None = None,
        memory_limit: int = 0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.block_types = block_types
        self.services = services
        self.concurrency = concurrency
        self.secrets = secrets
        # The most one execution may hold in this process's memory (holdings.py); 0: none.
        self.memory_limit = memory_limit

    async def run(
        self,
        workflow: Workflow,
        *,
        execution_id: str,
        input: Any,
        emit: Emit,
        state: RunState | None = None,
        keeper: Keeper | None = None,
        drain: asyncio.Event | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """Run a validated workflow (from ``state`` when resuming or recovering).

        Returns the sinks' outputs; raises BlockFailed, Paused when it waits for a
        human, or HandedOff when ``drain`` stopped it. Templates read the secrets of
        ``tenant`` (none without one).
        """
        # The input's size counts toward what the run holds (holdings.py): sized in
        # slices, and only as far as the bound (a 10 MB input's whole encode held the
        # event loop 50-60 ms, step 16 row 1).
        input_bytes = await size_past(input, self.memory_limit) if self.memory_limit else 0
        run = _Run(
            self,
            workflow,
            execution_id=execution_id,
            input=input,
            input_bytes=input_bytes,
            emit=emit,
            state=state,
            keeper=keeper or Keeper(execution_id=execution_id),
            drain=drain or asyncio.Event(),
            tenant=tenant,
        )
        return await run.execute()


class _Run:
    """The state of one execution: what is done, what each block still waits for."""

    def __init__(
        self,
        executor: Executor,
        workflow: Workflow,
        *,
        execution_id: str,
        input: Any,
        input_bytes: int,
        emit: Emit,
        state: RunState | None,
        keeper: Keeper,
        drain: asyncio.Event,
        tenant: str | None,
    ) -> None:
        self.executor = executor
        self.workflow = workflow
        self.execution_id = execution_id
        self.input = input
        self.emit = emit
        self.templates = executor.services.templates
        self.slots = asyncio.Semaphore(executor.concurrency)
        self.incoming = workflow.incoming()
        self.downstream = workflow.downstream()
        self.ancestors = workflow.ancestors()
        self.waiting = {
            block_id: len({edge.from_ for edge in edges})
            for block_id, edges in self.incoming.items()
        }
        state = state or RunState()
        # Outputs as kept (large ones are refs into the value store).
        self.outputs: dict[str, Any] = dict(state.outputs)
        self.skipped: list[str] = list(state.skipped)
        self.answers: dict[str, Any] = dict(state.answers)
        self.attempts: dict[str, int] = dict(state.attempts)
        self.recovered = state.recovered
        self.keeper = keeper
        encoded = {block_id: orjson.dumps(kept) for block_id, kept in self.outputs.items()}
        # Blocks whose kept output has refs in it: loaded when a template reads them.
        self.with_refs = {block_id for block_id, kept in encoded.items() if holds_refs(kept)}
        # What it holds in memory, sized as encoded (in C), never walked.
        held = input_bytes + sum(len(kept) for kept in encoded.values())
        self.holdings = Holdings(limit=executor.memory_limit, held=held)
        self.drain = drain
        self.secrets = RunSecrets(
            store=executor.secrets,
            tenant=tenant,
            configs={block.id: block.config for block in workflow.blocks},
        )
        # Every secret value this run may meet: masked in outputs, chunks and errors, so
        # no event, checkpoint or log line carries one.
        self.redactor = self.secrets.redactor
        self.deferred: list[str] = []
        self.reads: dict[str, set[str] | None] = {}  # block → the outputs its templates read
        self.pauses: dict[str, PauseRequested] = {}
        self.blocks = {block.id: block for block in workflow.blocks}
        self.group: asyncio.TaskGroup | None = None

    def _ready_at_start(self) -> list[str]:
        """Blocks to start now: roots on a first run, the frontier on a resume."""
        done = [*self.outputs, *self.skipped]
        for block_id in done:
            self._release(block_id)
        finished = set(done)
        return [
            block.id
            for block in self.workflow.blocks
            if block.id not in finished and self.waiting[block.id] == 0
        ]

    async def execute(self) -> dict[str, Any]:
        await self.secrets.mask_from_the_start(self.execution_id)
        try:
            async with asyncio.TaskGroup() as group:
                self.group = group
                await self._settle(self._ready_at_start())
        except BaseExceptionGroup as group_error:
            failed = group_error.subgroup(BlockFailed)
            if failed is not None:
                raise _first(failed) from None
            raise
        if self.deferred:
            # What was left to start runs in the process that takes the run over (also
            # an approval that asked meanwhile: it asks again there).
            order = [block.id for block in self.workflow.blocks if block.id in self.deferred]
            raise HandedOff(order)
        if self.pauses:
            # One approval at a time, in workflow order; the others ask again on resume.
            block_id = next(b.id for b in self.workflow.blocks if b.id in self.pauses)
            request = self.pauses[block_id]
            pause = Pause(block_id, request.prompt, request.schema, request.timeout_seconds)
            state = RunState(self.outputs, self.skipped, self.answers, self.attempts)
            raise Paused(pause, state)
        # As kept: the final event carries each sink's output as its own event did.
        return {sink: self.outputs[sink] for sink in self.workflow.sinks() if sink in self.outputs}

    async def _context(self, block_id: str, count: Callable[[int], None]) -> dict[str, Any]:
        # Only upstream outputs are visible, so a template cannot depend on timing; of
        # those kept as refs, only the ones the block's templates read are loaded, each
        # counted against the execution's memory bound before it is read (``count``).
        reads = self._reads(block_id)
        blocks: dict[str, Any] = {}
        for ancestor in self.ancestors[block_id]:
            if ancestor not in self.outputs:
                continue
            output = self.outputs[ancestor]
            if ancestor in self.with_refs and (reads is None or ancestor in reads):
                try:
                    output = await self.keeper.load(output, count=count)
                except BlockError:
                    raise  # past the execution's memory bound (holdings.py)
                except FlowcastError as exc:
                    message = f"the output of {ancestor!r} could not be loaded: {exc}"
                    raise BlockError("output_unavailable", message, retryable=True) from exc
            blocks[ancestor] = {"output": output}
        return {"input": self.input, "blocks": blocks}

    def _reads(self, block_id: str) -> set[str] | None:
        if block_id not in self.reads:
            block = self.blocks[block_id]
            texts = [edge.when for edge in self.incoming[block_id] if edge.when is not None]
            self.reads[block_id] = block_reads([*template_strings(block.config), *texts])
        return self.reads[block_id]

    async def _settle(self, ready: list[str]) -> None:
        """Start or skip each ready block; skips cascade here, in workflow order.

        Conditions are evaluated one block at a time, in this order, so the skips of
        one cascade are emitted in order even when a condition waits for a worker.
        Another block finishing meanwhile settles its own dependents; every block
        becomes ready exactly once (its ``waiting`` count reaches zero once).
        """
        assert self.group is not None
        queue = list(ready)
        while queue:
            block_id = queue.pop(0)
            if self.drain.is_set():
                self.deferred.append(block_id)
                continue
            reason = await self._skip_reason(block_id)
            if reason is None:
                self.group.create_task(self._run_block(self.blocks[block_id]))
                continue
            self.emit(
                BLOCK_SKIPPED, {"blockId": block_id, "reason": reason}, skipped_field(block_id)
            )
            self.skipped.append(block_id)
            queue += self._release(block_id)

    def _release(self, block_id: str) -> list[str]:
        """Count ``block_id`` as done for its dependents; return those now ready."""
        ready = []
        for target in self.downstream[block_id]:
            self.waiting[target] -= 1
            if self.waiting[target] == 0:
                ready.append(target)
        return ready

    async def _skip_reason(self, block_id: str) -> str | None:
        edges = self.incoming[block_id]
        if not edges:
            return None
        completed = [edge for edge in edges if edge.from_ in self.outputs]
        if not completed:
            return "every upstream block was skipped"
        if completed[0].when is None:
            return None  # taken, as the conditions would find first: nothing to load
        with self.holdings.loading(block_id) as count:
            try:
                context = await self._context(block_id, count)
            except BlockError as exc:
                raise BlockFailed(block_id, exc.code, exc.message) from exc
            return await self._conditions(block_id, completed, context)

    async def _conditions(
        self, block_id: str, completed: list[Edge], context: dict[str, Any]
    ) -> str | None:
        """Why ``block_id`` is skipped, by the conditions of its ``completed`` incoming
        edges; None when one of them is taken."""
        edges = self.incoming[block_id]
        for edge in completed:
            if edge.when is None:
                return None
            try:
                if await self.templates.condition(edge.when, context):
                    return None
            except BlockError as exc:
                message = f"the condition on the edge from {edge.from_!r} failed: {exc.message}"
                raise BlockFailed(block_id, exc.code, message) from exc
        if len(completed) == len(edges):
            return "every incoming edge's condition was false"
        return "no incoming edge was taken"

    async def _run_block(self, block: BlockDef) -> None:
        try:
            output = await self._attempts(block)
        except PauseRequested as request:
            self.pauses[block.id] = request  # its branch waits; the others carry on
            return
        except _Deferred:
            self.deferred.append(block.id)
            return
        self.outputs[block.id] = output
        await self._settle(self._release(block.id))

    def _first_attempt(self, block_id: str) -> tuple[int, bool]:
        """The attempt a block starts with here, and whether it was announced already.

        A block resumed with its answer carries on with the attempt that asked; any
        other starts its next one (after a recovery, the one after the attempt the
        previous owner started).
        """
        started = self.attempts.get(block_id, 0)
        if block_id in self.answers and not self.recovered:
            return max(started, 1), True
        return started + 1, False

    async def _attempts(self, block: BlockDef) -> Any:
        attempts = block.retry.attempts if block.retry else 1
        backoff_ms = block.retry.backoff_ms if block.retry else 0
        # Attempts are numbered across recoveries, and the retry budget counts them all:
        # a recovered block gets what its earlier attempts left (and always one run).
        attempt, announced = self._first_attempt(block.id)
        while True:
            async with self.slots:
                if self.drain.is_set():
                    raise _Deferred
                with tracing.block_span(self.execution_id, block.id, block.type, attempt) as span:
                    try:
                        output = await self._attempt(block, attempt, announced)
                    except BlockError as exc:
                        span.outcome("failed", exc.code)
                        error = exc
                    except PauseRequested:
                        span.outcome("paused")
                        raise
                    else:
                        span.outcome("completed")
                        return output
            delay = backoff_delay(backoff_ms, attempt, error.retry_after)
            will_retry = error.retryable and attempt < attempts and delay <= MAX_BACKOFF_SECONDS
            message = self.redactor.text(error.message)
            self.emit(
                BLOCK_FAILED,
                {
                    "blockId": block.id,
                    "error": {"code": error.code, "message": message},
                    "attempt": attempt,
                    "willRetry": will_retry,
                },
            )
            if not will_retry:
                raise BlockFailed(block.id, error.code, message)
            # A drain ends the wait: the next attempt runs where the run goes on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.drain.wait()
            if self.drain.is_set():
                raise _Deferred
            attempt, announced = attempt + 1, False

    async def _attempt(self, block: BlockDef, attempt: int, announced: bool) -> Any:
        """One attempt: render, validate, run under the timeout; any failure is a BlockError."""
        if not announced:
            start = {"blockId": block.id, "blockType": block.type, "attempt": attempt}
            self.emit(BLOCK_STARTED, start, attempt_field(block.id, attempt))
            self.attempts[block.id] = attempt
        started = time.monotonic()
        # The stored values this attempt loads back are held (and counted) until it ends.
        with self.holdings.loading(block.id) as count:
            try:
                output = await self._invoke(block, attempt, count)
            except (BlockError, PauseRequested):
                raise
            except Exception as exc:
                raise _unexpected(block, exc) from exc
        # What templates downstream read is what the event carries (SPEC §2).
        # The event carries the output as kept (large values as refs), so the event,
        # the checkpoint and what templates downstream read are one value.
        value = await carried(self.redactor.value(output))
        kept, kept_json = await self.keeper.keep(value)
        if kept is not value:
            # Kept as a ref: freed in slices once this attempt's frame lets go of it (a
            # parsed 35 MB answer held the loop 0.3 s, freed at once; step 16 row 1).
            let_go(value, output)
        del value, output
        self.holdings.keep(block.id, len(kept_json))
        if holds_refs(kept_json):
            self.with_refs.add(block.id)
        duration_ms = round((time.monotonic() - started) * 1000)
        self.emit(
            BLOCK_COMPLETED,
            {"blockId": block.id, "output": kept, "durationMs": duration_ms},
            output_field(block.id, kept_json),
        )
        return kept

    async def _invoke(self, block: BlockDef, attempt: int, count: Callable[[int], None]) -> Any:
        block_type = self.executor.block_types.get(block.type)
        if block_type is None:
            raise BlockError("unknown_type", f"unknown block type {block.type!r}", retryable=False)
        context = await self._context(block.id, count)
        secrets = await self.secrets.reveal(block.id)
        if secrets:
            context["secrets"] = secrets
        rendered = await self.templates.render(block.config, context)
        config = block_type.parse_config(rendered)
        # A secret split over two chunks is masked too: the chunker holds back an end
        # that could begin one until the next chunk (or the end of the attempt).
        chunker = self.redactor.stream()
        ctx = BlockContext(
            execution_id=self.execution_id,
            workflow_id=self.workflow.id,
            block_id=block.id,
            attempt=attempt,
            input=self.input,
            emit_chunk=lambda text: self._chunk(block.id, chunker.feed(text)),
            services=self.executor.services,
            **({"answer": self.answers[block.id]} if block.id in self.answers else {}),
        )
        timeout = block.timeout_ms / 1000 if block.timeout_ms else None
        try:
            async with asyncio.timeout(timeout) as deadline:
                output = await block_type.run(ctx, config)
        except Exception as exc:
            self._chunk(block.id, chunker.flush())  # not on a cancel: that attempt is gone
            if isinstance(exc, TimeoutError) and deadline.expired():
                message = f"the attempt took longer than {block.timeout_ms} ms"
                raise BlockError("timeout", message, retryable=True) from exc
            raise  # (a block's own TimeoutError is reported as unexpected by the caller)
        self._chunk(block.id, chunker.flush())
        return output

    def _chunk(self, block_id: str, text: str) -> None:
        if text:
            self.emit(BLOCK_CHUNK, {"blockId": block_id, "text": text})


def _unexpected(block: BlockDef, exc: BaseException) -> BlockError:
    """A block raised something other than BlockError: a bug, logged with its traceback."""
    # The message may carry a secret: the run masks it before any event, and the log
    # formatter masks every value this process revealed.
    log.exception("block %r (%s) raised unexpectedly", block.id, block.type, exc_info=exc)
    return BlockError("block_error", f"{type(exc).__name__}: {exc}", retryable=True)


def _first(group: BaseExceptionGroup[BlockFailed]) -> BlockFailed:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, BlockFailed)
    return error
