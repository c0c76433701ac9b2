"""The executor: runs one workflow's DAG and emits its block events.

It emits only ``block:*`` events; the caller emits ``execution:*`` ones. Blocks run in
one task group per execution, so a failure or a cancellation of ``run`` cancels every
running block and leaves no task behind.

A block that asks for approval stops its branch; the others run on. Once nothing else
can run, ``run`` raises ``Paused`` with the state to resume from (outputs so far, the
skipped blocks, the answers given). ``run(state=…)`` carries on from such a state; the
block that asked runs again and gets its answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lib.errors import BlockError, FlowcastError
from lib.execution.events import (
    BLOCK_CHUNK,
    BLOCK_COMPLETED,
    BLOCK_FAILED,
    BLOCK_SKIPPED,
    BLOCK_STARTED,
    carriable,
)
from lib.workflows.blocks import BlockTypes
from lib.workflows.blocks.base import BlockContext, BlockServices, PauseRequested
from lib.workflows.model import BlockDef, Workflow

log = logging.getLogger(__name__)

# The caller's publish function; whatever it returns (e.g. the Event) is ignored.
Emit = Callable[[str, dict[str, Any]], object]

# Waits between attempts are capped; a Retry-After beyond the cap ends the retries.
MAX_BACKOFF_SECONDS = 900.0
_JITTER = 0.1


class BlockFailed(FlowcastError):
    """A block failed for good, so the execution fails."""

    def __init__(self, block_id: str, code: str, message: str) -> None:
        super().__init__(message)
        self.block_id = block_id
        self.code = code

    def as_error(self) -> dict[str, str]:
        """The ``error`` object of ``execution:failed``."""
        return {"code": self.code, "message": self.message, "blockId": self.block_id}


@dataclass
class RunState:
    """Where a paused execution stands: enough to resume it in any process."""

    outputs: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    answers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"outputs": self.outputs, "skipped": self.skipped, "answers": self.answers}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunState:
        return cls(
            outputs=dict(raw.get("outputs", {})),
            skipped=list(raw.get("skipped", [])),
            answers=dict(raw.get("answers", {})),
        )


@dataclass(frozen=True)
class Pause:
    """The approval an execution waits for."""

    block_id: str
    prompt: str
    schema: dict[str, Any]
    timeout_seconds: int | None = None


class Paused(FlowcastError):
    """Nothing more can run until a human answers ``pause``; ``state`` resumes it."""

    def __init__(self, pause: Pause, state: RunState) -> None:
        super().__init__(f"paused at {pause.block_id!r}")
        self.pause = pause
        self.state = state


def backoff_delay(base_ms: int, attempt: int, retry_after: float | None) -> float:
    """Seconds to wait after failed ``attempt``: exponential, jittered, >= retry_after."""
    delay = base_ms / 1000 * 2.0 ** (attempt - 1)
    delay = min(delay * (1 + _JITTER * random.random()), MAX_BACKOFF_SECONDS)
    return max(delay, retry_after or 0.0)


class Executor:
    """Runs workflows with the given block types and services."""

    def __init__(
        self, block_types: BlockTypes, services: BlockServices, concurrency: int = 8
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.block_types = block_types
        self.services = services
        self.concurrency = concurrency

    async def run(
        self,
        workflow: Workflow,
        *,
        execution_id: str,
        input: Any,
        emit: Emit,
        state: RunState | None = None,
    ) -> dict[str, Any]:
        """Run a validated workflow (from ``state`` when resuming).

        Returns the sinks' outputs; raises BlockFailed, or Paused when it waits for a human.
        """
        run = _Run(self, workflow, execution_id=execution_id, input=input, emit=emit, state=state)
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
        emit: Emit,
        state: RunState | None,
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
        self.outputs: dict[str, Any] = dict(state.outputs)
        self.skipped: list[str] = list(state.skipped)
        self.answers: dict[str, Any] = dict(state.answers)
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
        try:
            async with asyncio.TaskGroup() as group:
                self.group = group
                await self._settle(self._ready_at_start())
        except BaseExceptionGroup as group_error:
            failed = group_error.subgroup(BlockFailed)
            if failed is not None:
                raise _first(failed) from None
            raise
        if self.pauses:
            # One approval at a time, in workflow order; the others ask again on resume.
            block_id = next(b.id for b in self.workflow.blocks if b.id in self.pauses)
            request = self.pauses[block_id]
            pause = Pause(block_id, request.prompt, request.schema, request.timeout_seconds)
            state = RunState(self.outputs, self.skipped, self.answers)
            raise Paused(pause, state)
        return {sink: self.outputs[sink] for sink in self.workflow.sinks() if sink in self.outputs}

    def _context(self, block_id: str) -> dict[str, Any]:
        # Only upstream outputs are visible, so a template cannot depend on timing.
        blocks = {
            ancestor: {"output": self.outputs[ancestor]}
            for ancestor in self.ancestors[block_id]
            if ancestor in self.outputs
        }
        return {"input": self.input, "blocks": blocks}

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
            reason = await self._skip_reason(block_id)
            if reason is None:
                self.group.create_task(self._run_block(self.blocks[block_id]))
                continue
            self.emit(BLOCK_SKIPPED, {"blockId": block_id, "reason": reason})
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
        context = self._context(block_id)
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
        self.outputs[block.id] = output
        await self._settle(self._release(block.id))

    async def _attempts(self, block: BlockDef) -> Any:
        attempts = block.retry.attempts if block.retry else 1
        backoff_ms = block.retry.backoff_ms if block.retry else 0
        attempt = 0
        while True:
            attempt += 1
            async with self.slots:
                try:
                    return await self._attempt(block, attempt)
                except BlockError as exc:
                    error = exc
            delay = backoff_delay(backoff_ms, attempt, error.retry_after)
            will_retry = error.retryable and attempt < attempts and delay <= MAX_BACKOFF_SECONDS
            self.emit(
                BLOCK_FAILED,
                {
                    "blockId": block.id,
                    "error": {"code": error.code, "message": error.message},
                    "attempt": attempt,
                    "willRetry": will_retry,
                },
            )
            if not will_retry:
                raise BlockFailed(block.id, error.code, error.message)
            await asyncio.sleep(delay)

    async def _attempt(self, block: BlockDef, attempt: int) -> Any:
        """One attempt: render, validate, run under the timeout; any failure is a BlockError."""
        if block.id not in self.answers or attempt > 1:
            # A block resumed with its answer already announced its start before pausing.
            start = {"blockId": block.id, "blockType": block.type, "attempt": attempt}
            self.emit(BLOCK_STARTED, start)
        started = time.monotonic()
        try:
            output = await self._invoke(block, attempt)
        except (BlockError, PauseRequested):
            raise
        except Exception as exc:
            raise _unexpected(block, exc) from exc
        # What templates downstream read is what the event carries (SPEC §2).
        output = carriable(output)
        duration_ms = round((time.monotonic() - started) * 1000)
        self.emit(
            BLOCK_COMPLETED, {"blockId": block.id, "output": output, "durationMs": duration_ms}
        )
        return output

    async def _invoke(self, block: BlockDef, attempt: int) -> Any:
        block_type = self.executor.block_types.get(block.type)
        if block_type is None:
            raise BlockError("unknown_type", f"unknown block type {block.type!r}", retryable=False)
        rendered = await self.templates.render(block.config, self._context(block.id))
        config = block_type.parse_config(rendered)
        ctx = BlockContext(
            execution_id=self.execution_id,
            workflow_id=self.workflow.id,
            block_id=block.id,
            attempt=attempt,
            input=self.input,
            emit_chunk=lambda text: self._chunk(block.id, text),
            services=self.executor.services,
            **({"answer": self.answers[block.id]} if block.id in self.answers else {}),
        )
        timeout = block.timeout_ms / 1000 if block.timeout_ms else None
        try:
            async with asyncio.timeout(timeout) as deadline:
                return await block_type.run(ctx, config)
        except TimeoutError as exc:
            if not deadline.expired():
                raise  # the block's own TimeoutError: reported as unexpected by the caller
            message = f"the attempt took longer than {block.timeout_ms} ms"
            raise BlockError("timeout", message, retryable=True) from exc

    def _chunk(self, block_id: str, text: str) -> None:
        if text:
            self.emit(BLOCK_CHUNK, {"blockId": block_id, "text": text})


def _unexpected(block: BlockDef, exc: BaseException) -> BlockError:
    """A block raised something other than BlockError: a bug, logged with its traceback."""
    log.exception("block %r (%s) raised unexpectedly", block.id, block.type, exc_info=exc)
    return BlockError("block_error", f"{type(exc).__name__}: {exc}", retryable=True)


def _first(group: BaseExceptionGroup[BlockFailed]) -> BlockFailed:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, BlockFailed)
    return error
