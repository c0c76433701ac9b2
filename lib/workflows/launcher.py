"""Runs executions in this process: one task per ownership, from its first event to
letting go.

``launch`` runs a body (start, resume, recovery, or an ending) as the owner a claim made
this process, through one execution log (log.py). The body emits its first event, lets
its work (the executor, and the saving of a pause) run as a separate task, then emits
exactly one last event — ``execution:paused`` or a terminal one — or, when a shutdown
drained it, none: the run is handed off. A stop (cancel, hand-off, fencing) cancels only
the work, never the run, so the run always ends properly, even when the stop arrives
before its work began or while a pause is being saved. Letting go settles the lease:
released once the last event is stored, handed off, or left to expire (and be taken
over) when nothing could be stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from lib import tracing
from lib.backend import Batch
from lib.backoff import Backoff
from lib.errors import BufferUnavailable, FlowcastError, NotFound, OwnerMoved, WrongStatus
from lib.execution.admission import Admission, paused_member
from lib.execution.buffer import EventBuffer
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    Event,
)
from lib.execution.hub import Hub
from lib.execution.indexes import created_ms
from lib.execution.log import ExecutionLog
from lib.execution.offload import OffloadPolicy
from lib.execution.outage import LiveGate
from lib.execution.ownership import Claim, Ownership
from lib.execution.record import ExecutionMeta, Field, StopReason
from lib.execution.values import ValueStore, ValueStoreError
from lib.execution.watchlists import WatchLists
from lib.metrics import Metrics
from lib.tenancy import CURRENT_TENANT
from lib.workflows.checkpoint import Keeper
from lib.workflows.executor import BlockFailed, Executor, HandedOff, Pause, Paused, RunState
from lib.workflows.finals import Finals, SavedPause, record_final
from lib.workflows.janitor import Ending
from lib.workflows.leases import LocalRun
from lib.workflows.model import Workflow
from lib.workflows.runstate import RunStates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    output: Any


# What a run's work ends with, when it is not a block failure (or a hand-off, raised
# as HandedOff): its output, or a pause whose state is saved.
Outcome = Completed | Pause
# What an execution task does between its log opening and closing.
Body = Callable[[LocalRun, ExecutionLog], Awaitable[None]]
# What a run does before its task starts: emit its first event.
Opening = Callable[[LocalRun, ExecutionLog], None]


class Launcher:
    """Launches and runs the executions this process owns (``runs``, by id)."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub,
        executor: Executor,
        values: ValueStore,
        ownership: Ownership,
        watch: WatchLists,
        admission: Admission,
        states: RunStates,
        finals: Finals,
        runs: dict[str, LocalRun],
        accepting: Callable[[], bool],
        offload: OffloadPolicy,
        max_pending_events: int,
        lease_seconds: float,
        metrics: Metrics | None,
    ) -> None:
        self._buffer = buffer
        self._hub = hub
        self._executor = executor
        self._values = values
        self._ownership = ownership
        self._watch = watch
        self._admission = admission
        self._states = states
        self._finals = finals
        self._locals = runs
        self._accepting = accepting
        self._offload = offload
        self._max_pending = max_pending_events
        self._lease_seconds = lease_seconds
        self._metrics = metrics
        # Called when a run here ends: a worker slot is free (the dispatcher's nudge).
        self.on_free: Callable[[], None] | None = None

    @property
    def values(self) -> ValueStore:
        return self._values

    def launch(
        self,
        execution_id: str,
        claim: Claim,
        *,
        identity: dict[str, str],
        body: Body,
        meta: ExecutionMeta | None = None,
        opening: Opening | None = None,
        write_back: Callable[[], Awaitable[None]] | None = None,
    ) -> ExecutionLog:
        """Run ``body`` here as the owner ``claim`` made this process. ``opening`` runs
        first, before this returns: the run's first event, emitted at once, is in this
        process's channel before a reader the caller attaches next looks (the first
        frame waits for no task to be scheduled). ``write_back`` writes a record outside
        the execution's keys that names it back, should the store lose writes of this
        run (see ``_rewatch``). Returns the run's log."""
        tenant = identity[Field.TENANT]
        # A pause kept here is superseded by this run, which re-asserts itself.
        self._finals.forget(execution_id)
        claimed_at = time.monotonic()
        # The claim just gave this process the lease: open until a renewal fails.
        gate = LiveGate(lease_seconds=self._lease_seconds, renewed_at=claimed_at)
        local = LocalRun(
            execution_id, claim.owner, claim.epoch, tenant, gate=gate, checked_at=claimed_at
        )
        events = self._log_of(local, claim, identity, meta)
        local.identity = identity
        local.write_back = write_back
        local.pending = lambda: events.pending
        local.stored = lambda: events.stored_id
        local.retained = lambda: events.retained_bytes
        local.repair = events.repair
        local.keeper = Keeper(execution_id=execution_id, compact=events.keep, store=self._values)
        if not self._accepting():
            local.drain()  # launched as the shutdown began: handed off at once
        if opening is not None:
            opening(local, events)  # emitted before the log's tasks run: they find it

        async def run() -> None:
            CURRENT_TENANT.set(local.tenant)  # its log lines, its share of provider permits
            try:
                # Its block spans and outbound calls are children of its span.
                with tracing.execution_context(identity.get(Field.TRACE.value)):
                    async with events:
                        await body(local, events)
            finally:
                await self._let_go(local, events)

        def forget(_task: asyncio.Task[None]) -> None:
            # A resume or cancel here may already have launched the next run of this
            # execution (its pause was stored before this task let go): keep that one.
            if self._locals.get(execution_id) is local:
                del self._locals[execution_id]
            if self.on_free is not None:
                self.on_free()

        local.task = asyncio.create_task(run(), name=f"execution:{execution_id}")
        self._locals[execution_id] = local
        local.task.add_done_callback(forget)
        return events

    def _log_of(
        self,
        local: LocalRun,
        claim: Claim,
        identity: dict[str, str],
        meta: ExecutionMeta | None,
    ) -> ExecutionLog:
        """The event log of a run launched here: numbered from what ``claim`` won, its
        retained bytes carried on from ``meta`` (the record before the claim)."""
        execution_id = local.execution_id
        return ExecutionLog(
            buffer=self._buffer,
            hub=self._hub,
            values=self._values,
            policy=self._offload,
            execution_id=execution_id,
            identity=identity,
            fence=claim.owner,
            epoch=claim.epoch,
            stored_id=claim.last_id,
            base_id=claim.base,
            reserved=claim.reserved,
            retained_bytes=meta.retained_bytes if meta is not None else 0,
            checkpoint_bytes=meta.checkpoint_bytes if meta is not None else 0,
            gate=local.gate,
            on_cancel=lambda: local.stop(StopReason.CANCEL),
            on_lost=lambda: self._rewatch(execution_id, local),
            max_pending=self._max_pending,
            metrics=self._metrics,
        )

    async def _rewatch(self, execution_id: str, local: LocalRun) -> None:
        """The store lost writes of a running execution: watch its lease, list it and
        count it for its tenant again, save its workflow version again, and write back
        the record outside its keys that names it (an Idempotency-Key's: a repeat must
        find it); the writer writes the rest back, after this, so whoever sees the
        execution again finds the key's record too."""
        if local.write_back is not None:
            await local.write_back()
        await self._watch.hold(execution_id, local.fence)
        await self._buffer.index_again(execution_id, local.identity)
        await self._admission.count(local.tenant, local.fence)
        if local.workflow is not None:
            await self._states.save_version(local.workflow)

    async def _let_go(self, local: LocalRun, writer: ExecutionLog) -> None:
        """Leave the tenant's running set once the run is over (not when it goes on
        elsewhere); hand the execution off, or stop watching the lease once it is
        settled.

        A run whose last event was not stored (and that was not fenced out) keeps its
        lease entry: the lease expires and a janitor takes the execution over, so it is
        never left running with nobody watching.
        """
        members = [local.fence]
        final = writer.final_stored
        if final is not None and final.type != EXECUTION_PAUSED:
            # Ended, also when a cancel won over its pause: it no longer counts at all.
            members.append(paused_member(local.execution_id))
        settled = (
            writer.final_stored is not None
            or writer.refused is not None
            or local.stop_reason is StopReason.FENCED
        )
        work: list[Awaitable[None]] = []
        leaving = final is not None or (settled and not local.handoff)
        # Else it goes on running elsewhere (handed off, or taken over once its lease
        # ends): it goes on counting for its tenant until its takeover counts instead
        # (takeovers.py), or a queued execution of the tenant would run beside it past
        # its running cap (a lone replica restarted: both ran at once at a cap of 1).
        if writer.final_stored is not None and writer.refused is None:
            self._finals.remember(local, writer.final_stored)
            if final is not None and final.type != EXECUTION_PAUSED:
                # Its terminal event is stored by this process: its span ends here.
                status = final.type.removeprefix("execution:")
                tracing.end_execution(local.identity, local.execution_id, status, final.ts)
        handing_off = local.handoff and writer.refused is None
        # The running set left first, then (settled here) the lease list, in one round
        # trip (issue 25: the worker's CPU per execution); best effort as each was.
        batch = Batch(self._watch.redis)
        if leaving:
            self._admission.leave_in(batch, local.tenant, *members)
        if settled and not handing_off:
            self._watch.release_in(batch, local.execution_id, local.fence)
        work.append(batch.send())
        if handing_off:
            # Let go for another process to take over now (its lease entry, due at
            # once, stays watched until then). If this fails, the lease expires.
            work.append(self._hand_off(local, writer.shown_id))
        elif not settled:
            log.warning(
                "a run ended without storing its last event; its lease will expire",
                extra={"executionId": local.execution_id},
            )
        await self.quietly(local.execution_id, *work)
        if writer.final_stored is not None and writer.refused is None:
            # Before the run's task ends (a shutdown waits for it): a store that comes
            # back behind once this process left still learns how the run ended
            # (takeovers.py). After the lease entry went, which a request may wait for.
            await self._record_final(local, writer.final_stored)

    async def _record_final(self, local: LocalRun, event: Event) -> None:
        """Record the run's last event in the value store (a few tries within a lease;
        then logged: only a later restore of an older snapshot would miss it)."""
        final = Finals.final_of(local, event)
        backoff = Backoff(base=0.05, cap=1.0)
        failed = "the value store did not answer within a lease"
        try:
            # Bounded: the run's task holds a shutdown's drain, and a value store that
            # answers nothing (an S3 endpoint black-holed) would hold it for minutes
            # (boto3's timeouts and retries) though the run ended.
            async with asyncio.timeout(self._lease_seconds):
                for attempt in range(1, 4):
                    try:
                        await record_final(self._values, local.execution_id, final)
                        return
                    except ValueStoreError as exc:
                        failed = str(exc)
                        if attempt == 3:
                            break
                        await backoff.wait()
        except TimeoutError:
            pass
        log.warning(
            "could not record the run's end outside the store",
            extra={"executionId": local.execution_id, "error": failed},
        )

    async def _hand_off(self, local: LocalRun, shown_id: int) -> None:
        # The ids this run reserved but never showed go back with it: the next owner
        # numbers from the last one a client may have seen, and reports no gap for
        # ids no event ever had.
        try:
            await self._ownership.hand_off(local.execution_id, local.fence, shown_id=shown_id)
        except (OwnerMoved, WrongStatus):
            return  # another owner took it already, or it ended: nothing to hand off
        log.info("execution handed off", extra={"executionId": local.execution_id})

    async def quietly(self, execution_id: str, *work: Awaitable[None]) -> None:
        """Best-effort cleanup: stale entries only cost a refused claim later, or expire."""
        for step in work:
            try:
                await step
            except FlowcastError as exc:
                log.warning(
                    "cleanup step failed", extra={"executionId": execution_id, "error": str(exc)}
                )

    async def retrying(self, local: LocalRun, step: Callable[[], Awaitable[Any]]) -> Any:
        """Run a Redis step of a run's work until it succeeds (a stop cancels it)."""
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            try:
                return await step()
            except BufferUnavailable as exc:
                log.warning(
                    "run state step failed; will retry",
                    extra={"executionId": local.execution_id, "error": str(exc)},
                )
                await backoff.wait()

    async def execute(
        self,
        local: LocalRun,
        emitter: ExecutionLog,
        work: Callable[[], Coroutine[Any, Any, Outcome]],
    ) -> None:
        """Run ``work`` as the cancellable part of the run; then emit its last event."""
        started = time.monotonic()
        extra = {"executionId": emitter.execution_id, "workflowId": emitter.workflow_id}
        task: asyncio.Task[Outcome] = asyncio.create_task(work(), name="work")
        local.work = task
        if local.stop_reason is not None:
            task.cancel(local.stop_reason)
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # the run itself is being torn down
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        handed_off = (task.cancelled() and local.stop_reason is StopReason.HANDOFF) or (
            not task.cancelled() and isinstance(task.exception(), HandedOff)
        )
        if not handed_off:
            # A run handed off goes on counting until its takeover counts instead.
            await self._stop_counting(local, task, extra)
        if handed_off:
            # No last event: the process that takes over recovers the run from its
            # checkpoint, once this one stored every event (on letting go).
            log.info("execution to be handed off", extra=extra)
            local.handoff = True
            return
        self._emit_end(local, emitter, task, started, extra)

    async def _stop_counting(
        self, local: LocalRun, task: asyncio.Task[Outcome], extra: dict[str, Any]
    ) -> None:
        """The run stops counting among its tenant's before its end can be seen, so a
        client that saw it end may start another at once (left again when it lets go);
        a pause goes on counting, as its own entry."""
        try:
            paused = (
                not task.cancelled()
                and task.exception() is None
                and isinstance(task.result(), Pause)
            )
            if paused:
                counting = self._admission.count_paused(
                    local.tenant, local.execution_id, local.fence
                )
            else:
                counting = self._admission.leave(local.tenant, local.fence)
            async with asyncio.timeout(1.0):
                await counting
        except (FlowcastError, TimeoutError) as exc:
            extra_error = {**extra, "error": str(exc) or type(exc).__name__}
            log.warning("could not stop counting the run; it will on letting go", extra=extra_error)

    def _emit_end(
        self,
        local: LocalRun,
        emitter: ExecutionLog,
        task: asyncio.Task[Outcome],
        started: float,
        extra: dict[str, Any],
    ) -> None:
        """The run's last event, from how its work ended (none when it was fenced)."""
        if task.cancelled():
            reason = local.stop_reason
            log.info("execution stopped", extra={**extra, "reason": reason})
            if reason is StopReason.FENCED:
                log.warning("execution taken over by another process", extra=extra)
                return  # the new owner writes the end; we may not
            emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})
            return
        failure = task.exception()
        if isinstance(failure, BlockFailed):
            log.info("execution failed", extra={**extra, "blockId": failure.block_id})
            emitter.emit(EXECUTION_FAILED, {"error": failure.as_error()})
        elif isinstance(failure, NotFound):
            log.error("execution state lost", extra={**extra, "error": str(failure)})
            error = {"code": "state_lost", "message": f"the run state was lost: {failure}"}
            emitter.emit(EXECUTION_FAILED, {"error": error})
        elif failure is not None:
            log.error("execution crashed", extra=extra, exc_info=failure)
            message = f"{type(failure).__name__}: {failure}"
            emitter.emit(
                EXECUTION_FAILED, {"error": {"code": "internal_error", "message": message}}
            )
        else:
            outcome = task.result()
            if isinstance(outcome, Pause):
                data = {"blockId": outcome.block_id, "prompt": outcome.prompt}
                emitter.emit(EXECUTION_PAUSED, {**data, "schema": outcome.schema})
                return
            duration_ms = run_duration_ms(local, started)
            emitter.emit(EXECUTION_COMPLETED, {"output": outcome.output, "durationMs": duration_ms})
            log.info("execution completed", extra={**extra, "durationMs": duration_ms})

    async def run_workflow(
        self,
        local: LocalRun,
        emitter: ExecutionLog,
        workflow: Workflow,
        input: Any,
        state: RunState | None,
    ) -> Outcome:
        """The executor's run; a pause is saved (with its deadline) before it is returned."""
        try:
            output = await self._executor.run(
                workflow,
                execution_id=emitter.execution_id,
                input=input,
                emit=emitter.emit,
                state=state,
                keeper=local.keeper,
                drain=local.draining,
                tenant=local.tenant,
            )
        except Paused as paused:
            await self._save_pause(local, paused, workflow, input)
            return paused.pause
        return Completed(output)

    async def _save_pause(
        self, local: LocalRun, paused: Paused, workflow: Workflow, input: Any
    ) -> None:
        """Persist the run state, so a paused status always has state to resume from."""
        execution_id = local.execution_id
        pause = paused.pause
        backoff = Backoff(base=0.05, cap=5.0, factor=4)
        for attempt in range(1, 6):
            try:
                # The checkpoint is the run state; the pause adds its deadline and the
                # time to live of a pause.
                deadline = None
                if pause.timeout_seconds:
                    deadline = await self._watch.now_ms() + pause.timeout_seconds * 1000
                await self._states.save(execution_id, {}, deadline_ms=deadline)
                if deadline is not None:
                    await self._watch.watch_deadline(execution_id, deadline)
                local.saved_pause = SavedPause(workflow, input, paused.state, deadline)
                return
            except BufferUnavailable as exc:
                if attempt == 5:
                    log.error("pause state not saved", extra={"executionId": execution_id})
                    message = f"the pause could not be saved: {exc}"
                    raise BlockFailed(pause.block_id, "pause_not_saved", message) from exc
                await backoff.wait()


def run_duration_ms(local: LocalRun, started: float) -> int:
    """The execution's duration as every view shows it (SPEC §9): from its
    ``createdAt`` to now, its terminal event -- its time in line, its pauses and its
    recoveries included, not only this process's part. From ``started`` (monotonic)
    only when the creation time is unknown."""
    created = local.identity.get(Field.CREATED_AT.value, "")
    if created:
        with contextlib.suppress(ValueError):
            return max(0, int(time.time() * 1000) - created_ms(created))
    return round((time.monotonic() - started) * 1000)


def ending_body(ending: Ending) -> Body:
    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        ending(emitter)

    return body


def identity_of(meta: ExecutionMeta) -> dict[str, str]:
    """The fields a writer recreates the metadata with if the store loses it."""
    return {
        Field.WORKFLOW_ID.value: meta.workflow_id,
        Field.TENANT.value: meta.tenant,
        Field.CREATED_AT.value: meta.created_at,
        Field.INLINE_FILES.value: "1" if meta.inline_files else "",
        Field.RECOVERIES.value: str(meta.recoveries),
        Field.CRASHES.value: str(meta.crashes),
        Field.DEATHS.value: str(meta.deaths),
        **({Field.TRACE.value: meta.trace} if meta.trace else {}),
        **({Field.WEBHOOKS.value: meta.webhooks} if meta.webhooks else {}),
    }
