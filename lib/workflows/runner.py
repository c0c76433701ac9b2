"""Runs executions in this process: start, pause, resume, cancel, end.

The runner owns the execution tasks it starts. Each one emits its first event
(``execution:started``, or ``execution:resumed``), lets the executor emit the block
events, then emits exactly one terminal event or ``execution:paused``, and returns only
once the writer has stored everything, the last event last.

Ownership moves between processes through ``Control`` (leases and fenced claims): any
replica may resume a pause or cancel an execution, and the janitor of any replica ends
executions whose owner died (``worker_lost``) or whose approval timed out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jsonschema.validators import validator_for

from lib.backoff import Backoff
from lib.errors import (
    BufferUnavailable,
    Conflict,
    FlowcastError,
    InvalidInput,
    NotFound,
    Problem,
    ShuttingDown,
    TooBusy,
    error_path,
)
from lib.execution.buffer import EventBuffer, ExecutionMeta
from lib.execution.control import Control, node_of, now_ms
from lib.execution.emitter import Emitter
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
    utc_timestamp,
)
from lib.execution.hub import Hub
from lib.execution.offload import Compactor, OffloadPolicy
from lib.execution.values import ValueStore
from lib.execution.writer import EventWriter
from lib.metrics import Metrics
from lib.workflows.executor import BlockFailed, Executor, Paused, RunState
from lib.workflows.janitor import Ending, Janitor, cancelled
from lib.workflows.leases import LeaseKeeper, LocalRun
from lib.workflows.model import Workflow

log = logging.getLogger(__name__)

ENDING_WAIT_SECONDS = 5.0


def new_execution_id() -> str:
    """An unguessable execution id (144 random bits)."""
    return "ex_" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class Started:
    execution_id: str
    status: str


# What an execution task does between its writer opening and closing.
Body = Callable[[LocalRun, Emitter], Awaitable[None]]


class Runner:
    """Starts, resumes and cancels executions; owns the tasks that run them here."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub,
        executor: Executor,
        values: ValueStore,
        control: Control,
        offload: OffloadPolicy | None = None,
        max_pending_events: int = 10_000,
        lease_seconds: float = 15.0,
        shutdown_grace_seconds: float = 30.0,
        max_executions_per_tenant: int = 0,
        metrics: Metrics | None = None,
        node_id: str | None = None,
    ) -> None:
        self._buffer = buffer
        self._hub = hub
        self._executor = executor
        self._values = values
        self._control = control
        self._offload = offload or OffloadPolicy()
        self._max_pending = max_pending_events
        self._lease_seconds = lease_seconds
        self._grace = shutdown_grace_seconds
        self._per_tenant = max_executions_per_tenant
        self._metrics = metrics
        self.node_id = node_id or secrets.token_hex(6)
        self._locals: dict[str, LocalRun] = {}
        self._keeper = LeaseKeeper(
            control=control, lease_seconds=lease_seconds, node_id=self.node_id, runs=self._locals
        )
        self._loops: list[asyncio.Task[None]] = []
        self.accepting = True

    async def __aenter__(self) -> Runner:
        self._loops = [
            asyncio.create_task(self._keeper.renew_loop(), name="lease-renewal"),
            asyncio.create_task(self._keeper.cancel_loop(), name="cancel-listener"),
            asyncio.create_task(
                Janitor(
                    buffer=self._buffer,
                    control=self._control,
                    lease_seconds=self._lease_seconds,
                    is_local=self._locals.__contains__,
                    new_fence=self._fence,
                    finish=self._finish_here,
                ).run(),
                name="janitor",
            ),
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Shutdown: start nothing new, let running executions finish within the grace
        # period, then end the rest with execution:failed (shutdown), written.
        self.accepting = False
        running = self._tasks()
        if running:
            log.info("draining executions", extra={"count": len(running), "grace": self._grace})
            await asyncio.wait(running, timeout=self._grace)
        for local in list(self._locals.values()):
            local.stop("shutdown")
        if remaining := self._tasks():
            await asyncio.wait(remaining, timeout=10)
        for task in [*self._tasks(), *self._loops]:
            task.cancel()
        await asyncio.gather(*self._tasks(), *self._loops, return_exceptions=True)

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [local.task for local in self._locals.values() if local.task is not None]

    def pending_events(self) -> int:
        """Events emitted by the runs here and not stored yet."""
        return sum(run.pending() for run in self._locals.values())

    def retained_bytes(self) -> int:
        """Bytes the rings of the runs here retain, as their compactors model them."""
        return sum(run.retained() for run in self._locals.values())

    def _fence(self) -> str:
        return f"{self.node_id}:{secrets.token_hex(8)}"

    # -- the API's operations ------------------------------------------------------

    async def start(
        self, workflow: Workflow, *, input: Any, tenant: str, inline_files: bool = False
    ) -> Started:
        """Create an execution and start running it here; returns once it is replayable.

        ``inline_files`` keeps file values' content inline up to their own cap, exempt
        from the pressure threshold (SPEC §5).
        """
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and starts no new executions")
        execution_id = new_execution_id()
        await self._admit(tenant, execution_id)
        fence = self._fence()
        now = datetime.now(UTC)
        await asyncio.gather(
            self._buffer.create(
                execution_id,
                workflow_id=workflow.id,
                tenant=tenant,
                owner=fence,
                created_at=utc_timestamp(now),
                created_ms=int(now.timestamp() * 1000),
                extra={"leaseUntil": str(now_ms() + self._control.lease_ms)},
            ),
            self._control.save_state(
                execution_id,
                {"workflow": workflow.to_json(), "input": input, "inlineFiles": inline_files},
            ),
            self._control.hold(execution_id),
        )

        async def body(local: LocalRun, emitter: Emitter) -> None:
            emitter.emit(EXECUTION_STARTED, {"input": input})
            await self._execute(local, emitter, workflow, input, None)

        self._launch(
            execution_id,
            workflow.id,
            fence,
            tenant=tenant,
            last_id=0,
            inline_files=inline_files,
            body=body,
        )
        return Started(execution_id, "running")

    async def resume(
        self, execution_id: str, *, tenant: str, block_id: str | None, input: Any
    ) -> Started:
        """Answer a pause: validate ``input``, win the claim, run on here."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and resumes nothing")
        meta = await self._owned(execution_id, tenant)
        if meta.status != "paused" or not isinstance(meta.pause, dict):
            raise Conflict(
                "not_paused", f"the execution is {meta.status}, not paused", status=meta.status
            )
        paused_at = str(meta.pause.get("blockId", ""))
        if block_id is not None and block_id != paused_at:
            raise Conflict(
                "not_paused_there",
                f"the execution is paused at {paused_at!r}, not at {block_id!r}",
                status="paused",
                pausedAt=paused_at,
            )
        _check_answer(meta.pause.get("schema") or {}, input)
        await self._admit(tenant, execution_id)
        fence = self._fence()
        try:
            claim = await self._control.claim(execution_id, "resume", fence, block_id=paused_at)
        except FlowcastError:
            await self._control.leave(tenant, execution_id)
            raise
        await self._control.hold(execution_id)
        state = await self._control.load_state(execution_id)
        workflow = Workflow.model_validate(state["workflow"])
        run = RunState.from_json(state.get("run") or {})
        run.answers[paused_at] = input

        async def body(local: LocalRun, emitter: Emitter) -> None:
            emitter.emit(EXECUTION_RESUMED, {"blockId": paused_at, "input": input})
            await self._execute(local, emitter, workflow, state.get("input"), run)

        self._launch(
            execution_id,
            workflow.id,
            fence,
            tenant=tenant,
            last_id=claim.last_id,
            retained_bytes=meta.retained_bytes,
            inline_files=bool(state.get("inlineFiles")),
            body=body,
        )
        return Started(execution_id, "running")

    async def cancel(self, execution_id: str, *, tenant: str) -> Started:
        """Cancel a running or paused execution wherever it runs."""
        meta = await self._owned(execution_id, tenant)
        local = self._locals.get(execution_id)
        if local is not None and not local.ending:
            local.stop("cancel")
            return Started(execution_id, "cancelling")
        if local is not None and local.task is not None:
            # Its last event is being stored: once it is, this is a cancel of a pause (or
            # a 409 for a finished execution), answered below.
            await asyncio.wait({local.task}, timeout=ENDING_WAIT_SECONDS)
        fence = self._fence()
        claim = await self._control.claim(execution_id, "cancel", fence)
        if claim.status_before == "running":
            # Another process runs it: the note on its control stream reaches it now;
            # the flag in the hash reaches it at its next lease renewal otherwise.
            await self._control.send_cancel(node_of(claim.owner), execution_id)
            return Started(execution_id, "cancelling")
        await self._control.hold(execution_id)
        self._finish_here(execution_id, meta, fence, claim.last_id, cancelled)
        return Started(execution_id, "cancelling")

    async def _owned(self, execution_id: str, tenant: str) -> ExecutionMeta:
        meta = await self._buffer.meta(execution_id)
        if meta.tenant != tenant:
            raise NotFound("execution", execution_id)
        return meta

    # -- running -------------------------------------------------------------------

    def _launch(
        self,
        execution_id: str,
        workflow_id: str,
        fence: str,
        *,
        tenant: str,
        last_id: int,
        inline_files: bool,
        body: Body,
        retained_bytes: int = 0,
    ) -> None:
        writer = EventWriter(
            buffer=self._buffer,
            execution_id=execution_id,
            fence=fence,
            stored_id=last_id,
            max_pending=self._max_pending,
            metrics=self._metrics,
        )
        local = LocalRun(execution_id, fence, tenant, checked_at=time.monotonic())
        # Attached before the task runs, so a reader arriving now already finds it local.
        publisher = self._hub.attach_local(
            execution_id,
            last_id=last_id,
            unstored=writer.unstored,
            gate=lambda: time.monotonic() - local.checked_at < self._lease_seconds,
        )
        compactor = Compactor(
            store=self._values,
            execution_id=execution_id,
            policy=self._offload,
            inline_files=inline_files,
            metrics=self._metrics,
        )
        compactor.stored(retained_bytes)
        emitter = Emitter(
            execution_id=execution_id,
            workflow_id=workflow_id,
            publisher=publisher,
            writer=writer,
            compactor=compactor,
            metrics=self._metrics,
            last_id=last_id,
        )
        local.pending = lambda: writer.pending
        local.retained = lambda: compactor.ring.retained_bytes

        async def run() -> None:
            try:
                # Exits in order: the emitter finishes compacting, then the writer stores
                # the last event, then live readers here switch to following the buffer.
                async with writer, emitter:
                    await body(local, emitter)
                    local.ending = True
            finally:
                publisher.detach()
                await self._let_go(local, fenced=writer.refused is not None)

        def forget(_task: asyncio.Task[None]) -> None:
            # A resume or cancel here may already have launched the next run of this
            # execution (its pause was stored before this task let go): keep that one.
            if self._locals.get(execution_id) is local:
                del self._locals[execution_id]

        local.task = asyncio.create_task(run(), name=f"execution:{execution_id}")
        self._locals[execution_id] = local
        local.task.add_done_callback(forget)

    async def _let_go(self, local: LocalRun, *, fenced: bool) -> None:
        try:
            await self._control.leave(local.tenant, local.execution_id)
            if not fenced:  # else the lease entry belongs to whoever fenced us out
                await self._control.release(local.execution_id, local.fence)
        except FlowcastError as exc:
            # Stale entries only cost a refused claim later, or expire with their lease.
            log.warning(
                "could not release the lease",
                extra={"executionId": local.execution_id, "error": str(exc)},
            )

    async def _admit(self, tenant: str, execution_id: str) -> None:
        if not await self._control.admit(tenant, execution_id, limit=self._per_tenant):
            raise TooBusy(
                f"this tenant already runs {self._per_tenant} executions; try again shortly",
                retry_after=max(1, round(self._lease_seconds / 3)),
            )

    async def _execute(
        self,
        local: LocalRun,
        emitter: Emitter,
        workflow: Workflow,
        input: Any,
        state: RunState | None,
    ) -> None:
        started = time.monotonic()
        extra = {"executionId": emitter.execution_id, "workflowId": workflow.id}
        try:
            output = await self._executor.run(
                workflow,
                execution_id=emitter.execution_id,
                input=input,
                emit=emitter.emit,
                state=state,
            )
        except Paused as paused:
            await self._pause(emitter, paused)
        except BlockFailed as exc:
            log.info("execution failed", extra={**extra, "blockId": exc.block_id})
            emitter.emit(EXECUTION_FAILED, {"error": exc.as_error()})
        except asyncio.CancelledError:
            if local.stop_reason == "fenced":
                log.warning("execution taken over by another process", extra=extra)
                return  # the new owner writes the end; we may not
            if local.stop_reason == "shutdown":
                error = {"code": "shutdown", "message": "the server shut down during the run"}
                emitter.emit(EXECUTION_FAILED, {"error": error})
            else:
                emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})
            log.info("execution stopped", extra={**extra, "reason": local.stop_reason})
        except Exception as exc:
            log.exception("execution crashed", extra=extra)
            error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
            emitter.emit(EXECUTION_FAILED, {"error": error})
        else:
            duration_ms = round((time.monotonic() - started) * 1000)
            emitter.emit(EXECUTION_COMPLETED, {"output": output, "durationMs": duration_ms})
            log.info("execution completed", extra={**extra, "durationMs": duration_ms})

    async def _pause(self, emitter: Emitter, paused: Paused) -> None:
        """Persist the run state, then announce the pause (so a paused status has state)."""
        pause = paused.pause
        deadline = now_ms() + pause.timeout_seconds * 1000 if pause.timeout_seconds else None
        backoff = Backoff(base=0.05, cap=5.0, factor=4)
        for attempt in range(1, 6):
            try:
                await self._control.save_state(
                    emitter.execution_id, {"run": paused.state.to_json()}, deadline_ms=deadline
                )
                if deadline is not None:
                    await self._control.watch_deadline(emitter.execution_id, deadline)
                break
            except BufferUnavailable as exc:
                if attempt == 5:
                    log.error("pause state not saved", extra={"executionId": emitter.execution_id})
                    error = {
                        "code": "pause_not_saved",
                        "message": f"the pause could not be saved: {exc}",
                    }
                    emitter.emit(EXECUTION_FAILED, {"error": error})
                    return
                await backoff.wait()
        emitter.emit(
            EXECUTION_PAUSED,
            {"blockId": pause.block_id, "prompt": pause.prompt, "schema": pause.schema},
        )

    def _finish_here(
        self,
        execution_id: str,
        meta: ExecutionMeta,
        fence: str,
        last_id: int,
        ending: Ending,
    ) -> None:
        """Write the terminal event of an execution this process just claimed."""

        async def body(local: LocalRun, emitter: Emitter) -> None:
            ending(emitter)

        self._launch(
            execution_id,
            meta.workflow_id,
            fence,
            tenant=meta.tenant,
            last_id=last_id,
            retained_bytes=meta.retained_bytes,
            inline_files=False,
            body=body,
        )

    # -- background loops ----------------------------------------------------------


def _check_answer(schema: dict[str, Any], answer: Any) -> None:
    """Refuse a resume input that its pause's JSON Schema does not accept (422)."""
    validator = validator_for(schema)(schema)
    problems = [
        Problem("$.input" + error_path(tuple(error.absolute_path)), error.message)
        for error in validator.iter_errors(answer)
    ]
    if problems:
        raise InvalidInput("the input does not match the pause's schema", problems)
