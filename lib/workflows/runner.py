"""Runs executions in this process: start, pause, resume, cancel, end.

The runner owns the execution tasks it starts. Each one emits its first event
(``execution:started`` or ``execution:resumed``), lets its work (the executor, and the
saving of a pause) run as a separate task, then emits exactly one last event —
``execution:paused`` or a terminal one — and returns only once the writer has stored
everything, the last event last. A stop (cancel, shutdown, fencing) cancels only the
work, never the run, so the run always writes its ending, even when the stop arrives
before its work began or while a pause is being saved.

Every change of ownership is a transition of ``Ownership`` (one Lua call each): any
replica may resume a pause or cancel an execution, and the janitor of any replica takes
over executions whose owner died or handed them off, and ends those whose approval
timed out. A request either wins its transition (202) or gets 409 with the status that
won; once it won, the run it launched retries whatever Redis work follows, so a 202
always takes effect.

A run taken over is recovered (SPEC §7): it emits ``execution:recovered`` and carries
on from the checkpoint, so only the blocks that had not completed run again; past
``max_recoveries`` crashes it ends ``worker_lost`` instead. A shutdown drains: no new
block starts, the running ones may finish within the grace, then each run hands its
execution off (no last event) for another process to recover at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lib.backoff import Backoff
from lib.errors import (
    BufferUnavailable,
    Conflict,
    FlowcastError,
    InvalidInput,
    NotFound,
    ShuttingDown,
    TooBusy,
)
from lib.execution.buffer import EventBuffer, ExecutionMeta
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
    utc_timestamp,
)
from lib.execution.hub import Hub
from lib.execution.log import ExecutionLog
from lib.execution.offload import OffloadPolicy
from lib.execution.ownership import Claim, Ownership, node_of, paused_member
from lib.execution.values import ValueStore
from lib.metrics import Metrics
from lib.workflows.checkpoint import Keeper, answer_field
from lib.workflows.executor import BlockFailed, Executor, HandedOff, Pause, Paused, RunState
from lib.workflows.finals import Finals, SavedPause
from lib.workflows.janitor import Ending, Janitor, cancelled, worker_lost
from lib.workflows.leases import LeaseKeeper, LocalRun
from lib.workflows.model import Workflow
from lib.workflows.runstate import RunStates
from lib.workflows.schemas import answer_problems

log = logging.getLogger(__name__)


# How long the runner's tasks may take to stop once cancelled at shutdown.
STOP_SECONDS = 2.0


def new_execution_id() -> str:
    """An unguessable execution id (144 random bits)."""
    return "ex_" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class Started:
    execution_id: str
    status: str


@dataclass(frozen=True)
class Completed:
    output: Any


# What a run's work ends with, when it is not a block failure (or a hand-off, raised
# as HandedOff): its output, or a pause whose state is saved.
Outcome = Completed | Pause
# What an execution task does between its log opening and closing.
Body = Callable[[LocalRun, ExecutionLog], Awaitable[None]]


class Runner:
    """Starts, resumes and cancels executions; owns the tasks that run them here."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub,
        executor: Executor,
        values: ValueStore,
        ownership: Ownership,
        offload: OffloadPolicy | None = None,
        max_pending_events: int = 10_000,
        lease_seconds: float = 15.0,
        shutdown_grace_seconds: float = 30.0,
        max_executions_per_tenant: int = 0,
        max_recoveries: int = 3,
        metrics: Metrics | None = None,
        node_id: str | None = None,
    ) -> None:
        self._buffer = buffer
        self._hub = hub
        self._executor = executor
        self._values = values
        self._ownership = ownership
        self._states = RunStates(ownership=ownership, values=values)
        self._offload = offload or OffloadPolicy()
        self._max_pending = max_pending_events
        self._lease_seconds = lease_seconds
        self._grace = shutdown_grace_seconds
        self._per_tenant = max_executions_per_tenant
        self._max_recoveries = max_recoveries
        self._metrics = metrics
        self.node_id = node_id or secrets.token_hex(6)
        self._locals: dict[str, LocalRun] = {}
        self._finals = Finals(buffer=buffer, ownership=ownership, states=self._states)
        self._keeper = LeaseKeeper(
            ownership=ownership,
            lease_seconds=lease_seconds,
            node_id=self.node_id,
            runs=self._locals,
        )
        self._loops: list[asyncio.Task[None]] = []
        self.accepting = True

    async def __aenter__(self) -> Runner:
        try:
            # Marks the data as this server's before this process writes any (store.lua).
            await self._ownership.store()
        except FlowcastError as exc:
            log.warning("the buffer is not reachable at start", extra={"error": str(exc)})
        janitor = Janitor(
            ownership=self._ownership,
            lease_seconds=self._lease_seconds,
            is_local=self._locals.__contains__,
            finish=self._claim_and_end,
            recover=self._recover,
            accepting=lambda: self.accepting,
            restarted=self._finals.reassert,
        )
        self._loops = [
            asyncio.create_task(self._keeper.renew_loop(), name="lease-renewal"),
            asyncio.create_task(
                self._keeper.control_loop(
                    lambda eid, fence: janitor.take_over(eid, fence, handoff_only=True)
                ),
                name="control-listener",
            ),
            asyncio.create_task(janitor.run(), name="janitor"),
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Shutdown: start nothing new, let running blocks finish within the grace
        # period, then hand every execution still running off to another process.
        self.accepting = False
        running = self._tasks()
        for local in list(self._locals.values()):
            local.drain()
        if running:
            log.info("draining executions", extra={"count": len(running), "grace": self._grace})
            await asyncio.wait(running, timeout=self._grace)
        for local in list(self._locals.values()):
            local.stop("handoff")
        if remaining := self._tasks():
            await asyncio.wait(remaining, timeout=10)
        tasks = [*self._tasks(), *self._loops]
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a task stuck in a client library that ignores the cancel must
            # not keep the process from exiting (its lease then expires, as on a crash).
            _done, stuck = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            if stuck:
                names = sorted(task.get_name() for task in stuck)
                where = [
                    f"{frame.f_code.co_filename}:{frame.f_lineno}"
                    for task in stuck
                    for frame in task.get_stack()
                ]
                log.warning("tasks did not stop", extra={"tasks": names, "where": where})

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [local.task for local in self._locals.values() if local.task is not None]

    def pending_events(self) -> int:
        """Events emitted by the runs here and not stored yet."""
        return sum(run.pending() for run in self._locals.values())

    def retained_bytes(self) -> int:
        """Bytes the rings of the runs here retain, as their compactors model them."""
        return sum(run.retained() for run in self._locals.values())

    def _fence(self) -> str:
        return self._ownership.new_fence(self.node_id)

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
        fence = self._fence()
        await self._admit(tenant, fence)
        now = datetime.now(UTC)
        identity = {
            "workflowId": workflow.id,
            "tenant": tenant,
            "createdAt": utc_timestamp(now),
            "inlineFiles": "1" if inline_files else "",
        }
        try:
            claim = await self._ownership.start(
                execution_id,
                fence=fence,
                workflow_id=workflow.id,
                tenant=tenant,
                created_at=identity["createdAt"],
                created_ms=int(now.timestamp() * 1000),
                extra={"inlineFiles": identity["inlineFiles"]},
            )
        except FlowcastError:
            await self._quietly(execution_id, self._ownership.leave(tenant, fence))
            raise

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            emitter.emit(EXECUTION_STARTED, {"input": input})

            async def work() -> Outcome:
                # What a resume (or, later, a recovery) needs, saved off the start path.
                version = await self._retrying(local, lambda: self._states.save_version(workflow))
                await self._retrying(
                    local,
                    lambda: self._states.save(execution_id, {"workflow": version, "input": input}),
                )
                return await self._run_workflow(local, emitter, workflow, input, None)

            await self._execute(local, emitter, work)

        self._launch(execution_id, claim, identity=identity, body=body)
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
        fence = self._fence()
        await self._admit(tenant, fence, replaces=paused_member(execution_id))
        claim = await self._claim(execution_id, "resume", fence, tenant, block_id=paused_at)

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            # First, whatever follows: the resume took effect even if a cancel stops
            # the run before its work begins. The answer goes into the checkpoint with
            # it (as a ref when large), so a recovery after this point still has it.
            kept, kept_json = await local.keeper.keep(input)
            checkpoint = answer_field(paused_at, kept_json)
            emitter.emit(EXECUTION_RESUMED, {"blockId": paused_at, "input": kept}, checkpoint)

            async def work() -> Outcome:
                version, given, run = await self._retrying(
                    local, lambda: self._states.load(execution_id)
                )
                workflow = await self._retrying(local, lambda: self._states.load_version(version))
                run.answers[paused_at] = kept
                return await self._run_workflow(local, emitter, workflow, given, run)

            await self._execute(local, emitter, work)

        self._launch(execution_id, claim, identity=_identity(meta), body=body, meta=meta)
        return Started(execution_id, "running")

    async def cancel(self, execution_id: str, *, tenant: str) -> Started:
        """Cancel a running or paused execution wherever it runs.

        The claim decides, in Redis, against everything racing with it: a paused
        execution becomes this process's to end; a running one gets its cancel flag, so
        its owner's next final event becomes the cancel (append.lua), and the owner is
        told at once. A finished one is a 409 with the status that won.
        """
        meta = await self._owned(execution_id, tenant)
        fence = self._fence()
        claim = await self._claim(execution_id, "cancel", fence, tenant)
        if claim.status_before != "running":
            self._launch(
                execution_id, claim, identity=_identity(meta), body=_ending(cancelled), meta=meta
            )
            return Started(execution_id, "cancelling")
        await self._quietly(execution_id, self._ownership.release(execution_id, fence))
        local = self._locals.get(execution_id)
        if local is not None and local.fence == claim.owner:
            local.stop("cancel")
        else:
            # The flag reaches the owner with its next write or renewal anyway.
            await self._quietly(
                execution_id, self._ownership.send_cancel(node_of(claim.owner), execution_id)
            )
        return Started(execution_id, "cancelling")

    async def _owned(self, execution_id: str, tenant: str) -> ExecutionMeta:
        meta = await self._buffer.meta(execution_id)
        if meta.tenant != tenant:
            raise NotFound("execution", execution_id)
        return await self._buffer.resolved(meta)

    async def _claim(
        self, execution_id: str, mode: str, fence: str, tenant: str, *, block_id: str = ""
    ) -> Claim:
        """Watch ``fence``'s lease, then win the transition with it.

        A refused claim undoes the watch. One whose answer was lost (the buffer failed
        mid-call) keeps it: if the claim did apply, the lease it set expires unrenewed
        and a janitor ends the execution, so it is never running with nobody watching.
        """
        try:
            await self._ownership.check_settled()
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(execution_id, mode, fence, block_id=block_id)
        except (Conflict, NotFound):
            await self._quietly(
                execution_id,
                self._ownership.release(execution_id, fence),
                self._ownership.leave(tenant, fence),
            )
            raise
        except FlowcastError:
            await self._quietly(execution_id, self._ownership.leave(tenant, fence))
            raise
        if claim.status_before == "paused":
            # The pause stops counting as such: its new owner counts (or it ends).
            await self._quietly(
                execution_id, self._ownership.leave(tenant, paused_member(execution_id))
            )
        return claim

    async def _claim_and_end(
        self, execution_id: str, mode: str, expected: str, ending: Ending
    ) -> str | None:
        """The janitor's transitions: take over or expire, then write ``ending``."""
        fence = self._fence()
        try:
            meta = await self._buffer.meta(execution_id)
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(execution_id, mode, fence, expected=expected)
        except (Conflict, NotFound) as exc:
            await self._quietly(execution_id, self._ownership.release(execution_id, fence))
            return exc.code
        log.warning("ending an execution", extra={"executionId": execution_id, "mode": mode})
        self._launch(execution_id, claim, identity=_identity(meta), body=_ending(ending), meta=meta)
        return None

    async def _recover(self, execution_id: str, expected: str, handoff_only: bool) -> str | None:
        """The janitor's takeover: win the execution from ``expected`` (only if it handed
        off, when ``handoff_only``), then carry it on from its checkpoint here."""
        fence = self._fence()
        try:
            if (await self._ownership.store()).settling_seconds > 0:
                return "settling"
            meta = await self._buffer.meta(execution_id)
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id, "takeover", fence, expected=expected, handoff_only=handoff_only
            )
        except (Conflict, NotFound) as exc:
            await self._quietly(execution_id, self._ownership.release(execution_id, fence))
            return exc.code
        identity = _identity(meta)
        extra = {
            "executionId": execution_id,
            "reason": claim.reason,
            "recovery": claim.recovery,
        }
        if claim.reason == "worker_lost" and claim.crashes > self._max_recoveries:
            log.warning("execution lost its owner too often; ending it", extra=extra)
            self._launch(
                execution_id, claim, identity=identity, body=_ending(worker_lost), meta=meta
            )
            return None
        log.warning("recovering an execution", extra=extra)

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            async def work() -> Outcome:
                version, given, run = await self._retrying(
                    local, lambda: self._states.load(execution_id)
                )
                workflow = await self._retrying(local, lambda: self._states.load_version(version))
                run.recovered = True
                completed = [b.id for b in workflow.blocks if b.id in run.outputs]
                rerun = [b.id for b in workflow.blocks if b.id in run.unfinished()]
                data = {
                    "reason": claim.reason,
                    "recovery": claim.recovery,
                    "rerun": rerun,
                    "completed": completed,
                }
                emitter.emit(EXECUTION_RECOVERED, data)
                return await self._run_workflow(local, emitter, workflow, given, run)

            await self._execute(local, emitter, work)

        self._launch(execution_id, claim, identity=identity, body=body, meta=meta)
        return None

    # -- running -------------------------------------------------------------------

    def _launch(
        self,
        execution_id: str,
        claim: Claim,
        *,
        identity: dict[str, str],
        body: Body,
        meta: ExecutionMeta | None = None,
    ) -> None:
        """Run ``body`` here as the owner ``claim`` made this process."""
        tenant = identity["tenant"]
        local = LocalRun(
            execution_id, claim.owner, claim.epoch, tenant, checked_at=time.monotonic()
        )
        events = ExecutionLog(
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
            retained_bytes=meta.retained_bytes if meta is not None else 0,
            checkpoint_bytes=meta.checkpoint_bytes if meta is not None else 0,
            live_for_seconds=self._lease_seconds,
            renewed_at=lambda: local.checked_at,
            on_cancel=lambda: local.stop("cancel"),
            on_lost=lambda: self._rewatch(execution_id, local),
            max_pending=self._max_pending,
            metrics=self._metrics,
        )
        local.identity = identity
        local.pending = lambda: events.pending
        local.retained = lambda: events.retained_bytes
        local.repair = events.repair
        local.keeper = Keeper(execution_id=execution_id, compact=events.keep, store=self._values)
        if not self.accepting:
            local.drain()  # launched as the shutdown began: handed off at once

        async def run() -> None:
            try:
                async with events:
                    await body(local, events)
            finally:
                await self._let_go(local, events)

        def forget(_task: asyncio.Task[None]) -> None:
            # A resume or cancel here may already have launched the next run of this
            # execution (its pause was stored before this task let go): keep that one.
            if self._locals.get(execution_id) is local:
                del self._locals[execution_id]

        local.task = asyncio.create_task(run(), name=f"execution:{execution_id}")
        self._locals[execution_id] = local
        local.task.add_done_callback(forget)

    async def _rewatch(self, execution_id: str, local: LocalRun) -> None:
        """The store lost a running execution: watch its lease and list it again."""
        await self._ownership.hold(execution_id, local.fence)
        await self._buffer.index_again(execution_id, local.tenant)

    async def _let_go(self, local: LocalRun, writer: ExecutionLog) -> None:
        """Leave the tenant's running set; stop watching the lease once it is settled.

        A run whose last event was not stored (and that was not fenced out) keeps its
        lease entry: the lease expires and a janitor ends the execution, so it is never
        left running with nobody watching.
        """
        work = [self._ownership.leave(local.tenant, local.fence)]
        final = writer.final_stored
        if final is not None and final.type != EXECUTION_PAUSED:
            # Ended, also when a cancel won over its pause: it no longer counts at all.
            work.append(self._ownership.leave(local.tenant, paused_member(local.execution_id)))
        settled = (
            writer.final_stored is not None
            or writer.refused is not None
            or local.stop_reason == "fenced"
        )
        if writer.final_stored is not None and writer.refused is None:
            self._finals.remember(local, writer.final_stored)
        if local.handoff and writer.refused is None:
            # Let go for another process to take over now (its lease entry, due at
            # once, stays watched until then). If this fails, the lease expires.
            work.append(self._hand_off(local))
        elif settled:
            work.append(self._ownership.release(local.execution_id, local.fence))
        else:
            log.warning(
                "a run ended without storing its last event; its lease will expire",
                extra={"executionId": local.execution_id},
            )
        await self._quietly(local.execution_id, *work)

    async def _hand_off(self, local: LocalRun) -> None:
        try:
            await self._ownership.hand_off(local.execution_id, local.fence)
        except Conflict:
            return  # another owner took it already, or it ended: nothing to hand off
        log.info("execution handed off", extra={"executionId": local.execution_id})

    async def _quietly(self, execution_id: str, *work: Awaitable[None]) -> None:
        """Best-effort cleanup: stale entries only cost a refused claim later, or expire."""
        for step in work:
            try:
                await step
            except FlowcastError as exc:
                log.warning(
                    "cleanup step failed", extra={"executionId": execution_id, "error": str(exc)}
                )

    async def _admit(self, tenant: str, fence: str, *, replaces: str = "") -> None:
        if not await self._ownership.admit(
            tenant, fence, limit=self._per_tenant, replaces=replaces
        ):
            raise TooBusy(
                f"this tenant already runs {self._per_tenant} executions; try again shortly",
                retry_after=max(1, round(self._lease_seconds / 3)),
            )

    async def _retrying(self, local: LocalRun, step: Callable[[], Awaitable[Any]]) -> Any:
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

    async def _execute(
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
        # The run stops counting among its tenant's before its end can be seen, so a
        # client that saw it end may start another at once (left again when it lets
        # go); a pause goes on counting, as its own entry.
        handed_off = (task.cancelled() and local.stop_reason == "handoff") or (
            not task.cancelled() and isinstance(task.exception(), HandedOff)
        )
        try:
            paused = (
                not task.cancelled()
                and task.exception() is None
                and isinstance(task.result(), Pause)
            )
            if paused:
                counting = self._ownership.count_paused(
                    local.tenant, local.execution_id, local.fence
                )
            else:
                counting = self._ownership.leave(local.tenant, local.fence)
            await asyncio.wait_for(counting, 1.0)
        except (FlowcastError, TimeoutError) as exc:
            extra_error = {**extra, "error": str(exc) or type(exc).__name__}
            log.warning("could not stop counting the run; it will on letting go", extra=extra_error)
        if handed_off:
            # No last event: the process that takes over recovers the run from its
            # checkpoint, once this one stored every event (on letting go).
            log.info("execution to be handed off", extra=extra)
            local.handoff = True
            return
        if task.cancelled():
            reason = local.stop_reason
            log.info("execution stopped", extra={**extra, "reason": reason})
            if reason == "fenced":
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
            duration_ms = round((time.monotonic() - started) * 1000)
            emitter.emit(EXECUTION_COMPLETED, {"output": outcome.output, "durationMs": duration_ms})
            log.info("execution completed", extra={**extra, "durationMs": duration_ms})

    async def _run_workflow(
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
                    deadline = await self._ownership.now_ms() + pause.timeout_seconds * 1000
                await self._states.save(execution_id, {}, deadline_ms=deadline)
                if deadline is not None:
                    await self._ownership.watch_deadline(execution_id, deadline)
                local.saved_pause = SavedPause(workflow, input, paused.state, deadline)
                return
            except BufferUnavailable as exc:
                if attempt == 5:
                    log.error("pause state not saved", extra={"executionId": execution_id})
                    message = f"the pause could not be saved: {exc}"
                    raise BlockFailed(pause.block_id, "pause_not_saved", message) from exc
                await backoff.wait()


def _ending(ending: Ending) -> Body:
    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        ending(emitter)

    return body


def _identity(meta: ExecutionMeta) -> dict[str, str]:
    """The fields a writer recreates the metadata with if the store loses it."""
    return {
        "workflowId": meta.workflow_id,
        "tenant": meta.tenant,
        "createdAt": meta.created_at,
        "inlineFiles": "1" if meta.inline_files else "",
    }


def _check_answer(schema: dict[str, Any], answer: Any) -> None:
    """Refuse a resume input that its pause's JSON Schema does not accept (422)."""
    problems = answer_problems(schema, answer)
    if problems:
        raise InvalidInput("the input does not match the pause's schema", problems)
