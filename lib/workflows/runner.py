"""Decides what runs in this process: start, resume, cancel, recover, shut down.

The runner wins each transition, then has the launcher (launcher.py) run what follows
here, one task per ownership.

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
import contextlib
import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

import orjson

from lib.errors import (
    BufferUnavailable,
    Conflict,
    FlowcastError,
    InvalidInput,
    LeaseHeld,
    NotDue,
    NotFound,
    NotPausedThere,
    ShuttingDown,
    TooBusy,
)
from lib.execution.buffer import EventBuffer, ExecutionMeta
from lib.execution.events import (
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
    utc_timestamp,
)
from lib.execution.hub import Hub
from lib.execution.log import ExecutionLog
from lib.execution.offload import OffloadPolicy
from lib.execution.ownership import Claim, Ownership, node_of, paused_member
from lib.execution.record import Field, Mode, RecoveryReason, Status, StopReason, Takeover
from lib.execution.values import ValueStore
from lib.metrics import Metrics
from lib.workflows.checkpoint import answer_field
from lib.workflows.executor import Executor, RunState
from lib.workflows.finals import Finals
from lib.workflows.janitor import Janitor, approval_timeout, cancelled, worker_lost
from lib.workflows.launcher import Body, Launcher, Outcome, ending_body, identity_of
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


class Claimed(Enum):
    """How a transition the janitor found due went."""

    WON = "won"  # this process owns it now
    NOT_YET = "not_yet"  # refused for now (the lease runs, the store settles, not due)
    SETTLED = "settled"  # refused for good (another owner or status, gone): forget it


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
        dead_nodes: tuple[str, ...] = (),
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
        # Earlier processes of this node, known dead: their runs are this one's at once.
        self._dead_nodes = dead_nodes
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
        self._launcher = Launcher(
            buffer=buffer,
            hub=hub,
            executor=executor,
            values=values,
            ownership=ownership,
            states=self._states,
            finals=self._finals,
            runs=self._locals,
            accepting=lambda: self.accepting,
            offload=self._offload,
            max_pending_events=max_pending_events,
            lease_seconds=lease_seconds,
            metrics=metrics,
        )

    async def __aenter__(self) -> Runner:
        try:
            # Marks the data as this server's before this process writes any (store.lua).
            await self._ownership.store()
        except FlowcastError as exc:
            log.warning("the buffer is not reachable at start", extra={"error": str(exc)})
        janitor = Janitor(
            ownership=self._ownership,
            lease_seconds=self._lease_seconds,
            dead_nodes=self._dead_nodes,
        )

        async def handed_off(execution_id: str, fence: str) -> None:
            await self._take_over(execution_id, fence, how=Takeover.HANDOFF)

        control = asyncio.create_task(
            self._keeper.control_loop(handed_off),
            name="control-listener",
        )
        self._loops = [
            asyncio.create_task(self._keeper.renew_loop(), name="lease-renewal"),
            control,
            asyncio.create_task(self._tend(janitor), name="janitor"),
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
            local.stop(StopReason.HANDOFF)
        if remaining := self._tasks():
            await asyncio.wait(remaining, timeout=10)
        control = next(task for task in self._loops if task.get_name() == "control-listener")
        # The control loop ends on a wake-up message: a blocking read, once cancelled,
        # may be retried by the client and hold the shutdown up.
        with contextlib.suppress(FlowcastError, TimeoutError):
            await asyncio.wait_for(self._keeper.stop_listening(), STOP_SECONDS)
            await asyncio.wait([control], timeout=STOP_SECONDS)
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
        self,
        workflow: Workflow,
        *,
        input: Any,
        tenant: str,
        inline_files: bool = False,
        execution_id: str | None = None,
    ) -> Started:
        """Create an execution and start running it here; returns once it is replayable.

        ``inline_files`` keeps file values' content inline up to their own cap, exempt
        from the pressure threshold (SPEC §5). An ``execution_id`` named in advance (an
        Idempotency-Key's record names it before it exists) may be created by another
        request first: then that one runs it, and this one starts nothing.
        """
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and starts no new executions")
        execution_id = execution_id or new_execution_id()
        fence = self._fence()
        await self._admit(tenant, fence)
        now = datetime.now(UTC)
        identity: dict[str, str] = {
            Field.WORKFLOW_ID.value: workflow.id,
            Field.TENANT.value: tenant,
            Field.CREATED_AT.value: utc_timestamp(now),
            Field.INLINE_FILES.value: "1" if inline_files else "",
        }
        try:
            # What a resume or a recovery needs is there from the start, in the same
            # write that creates the execution: a process may die right after the 202.
            version = await self._states.save_version(workflow)
            saved = await self._states.encode(execution_id, {"workflow": version, "input": input})
            claim = await self._ownership.start(
                execution_id,
                fence=fence,
                workflow_id=workflow.id,
                tenant=tenant,
                created_at=identity[Field.CREATED_AT],
                created_ms=int(now.timestamp() * 1000),
                extra={Field.INLINE_FILES.value: identity[Field.INLINE_FILES]},
                state=saved,
            )
        except FlowcastError:
            await self._launcher.quietly(execution_id, self._ownership.leave(tenant, fence))
            raise
        if claim is None:
            await self._launcher.quietly(execution_id, self._ownership.leave(tenant, fence))
            log.info("execution created by another request", extra={"executionId": execution_id})
            return Started(execution_id, "running")

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            emitter.emit(EXECUTION_STARTED, {"input": input})
            emitter.remember(saved)
            local.workflow = workflow

            async def work() -> Outcome:
                return await self._launcher.run_workflow(local, emitter, workflow, input, None)

            await self._launcher.execute(local, emitter, work)

        self._launcher.launch(execution_id, claim, identity=identity, body=body)
        return Started(execution_id, "running")

    async def resume(
        self, execution_id: str, *, tenant: str, block_id: str | None, input: Any
    ) -> Started:
        """Answer a pause: validate ``input``, win the claim, run on here."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and resumes nothing")
        meta = await self._owned(execution_id, tenant)
        if meta.status != Status.PAUSED or not isinstance(meta.pause, dict):
            raise Conflict(
                "not_paused", f"the execution is {meta.status}, not paused", status=meta.status
            )
        paused_at = str(meta.pause.get("blockId", ""))
        if block_id is not None and block_id != paused_at:
            raise NotPausedThere(execution_id, paused_at=paused_at, asked=block_id)
        _check_answer(meta.pause.get("schema") or {}, input)
        fence = self._fence()
        await self._admit(tenant, fence, replaces=paused_member(execution_id))
        claim = await self._claim(
            execution_id, Mode.RESUME, fence, tenant, block_id=paused_at, answer=orjson.dumps(input)
        )

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            # First, whatever follows: the resume took effect even if a cancel stops
            # the run before its work begins. The answer goes into the checkpoint with
            # it (as a ref when large), so a recovery after this point still has it.
            kept, kept_json = await local.keeper.keep(input)
            checkpoint = answer_field(paused_at, kept_json)
            emitter.emit(EXECUTION_RESUMED, {"blockId": paused_at, "input": kept}, checkpoint)

            async def work() -> Outcome:
                workflow, given, run = await self._load_run(local, emitter)
                run.answers[paused_at] = kept
                return await self._launcher.run_workflow(local, emitter, workflow, given, run)

            await self._launcher.execute(local, emitter, work)

        self._launcher.launch(execution_id, claim, identity=identity_of(meta), body=body, meta=meta)
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
        claim = await self._claim(execution_id, Mode.CANCEL, fence, tenant)
        if claim.status_before is not Status.RUNNING:
            self._launcher.launch(
                execution_id,
                claim,
                identity=identity_of(meta),
                body=ending_body(cancelled),
                meta=meta,
            )
            return Started(execution_id, "cancelling")
        await self._launcher.quietly(execution_id, self._ownership.release(execution_id, fence))
        local = self._locals.get(execution_id)
        if local is not None and local.fence == claim.owner:
            local.stop(StopReason.CANCEL)
        else:
            # The flag reaches the owner with its next write or renewal anyway.
            await self._launcher.quietly(
                execution_id, self._ownership.send_cancel(node_of(claim.owner), execution_id)
            )
        return Started(execution_id, "cancelling")

    async def _load_run(
        self, local: LocalRun, emitter: ExecutionLog
    ) -> tuple[Workflow, Any, RunState]:
        """The workflow, input and checkpoint a resumed or recovered run goes on from
        (retried while the buffer is down; NotFound when the store lost them)."""
        execution_id = local.execution_id
        version, given, run, saved = await self._launcher.retrying(
            local, lambda: self._states.load(execution_id)
        )
        emitter.remember(saved)
        workflow: Workflow = await self._launcher.retrying(
            local, lambda: self._states.load_version(version)
        )
        local.workflow = workflow
        return workflow, given, run

    async def _owned(self, execution_id: str, tenant: str) -> ExecutionMeta:
        meta = await self._buffer.meta(execution_id)
        if meta.tenant != tenant:
            raise NotFound("execution", execution_id)
        return await self._buffer.resolved(meta)

    async def _claim(
        self,
        execution_id: str,
        mode: Mode,
        fence: str,
        tenant: str,
        *,
        block_id: str = "",
        answer: bytes = b"",
    ) -> Claim:
        """Watch ``fence``'s lease, then win the transition with it.

        A refused claim undoes the watch. One whose answer was lost (the buffer failed
        mid-call) keeps it: if the claim did apply, the lease it set expires unrenewed
        and a janitor ends the execution, so it is never running with nobody watching.
        """
        try:
            await self._ownership.check_settled()
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id, mode, fence, block_id=block_id, answer=answer
            )
        except (Conflict, NotFound):
            await self._launcher.quietly(
                execution_id,
                self._ownership.release(execution_id, fence),
                self._ownership.leave(tenant, fence),
            )
            raise
        except FlowcastError:
            await self._launcher.quietly(execution_id, self._ownership.leave(tenant, fence))
            raise
        if claim is None:
            await self._launcher.quietly(execution_id, self._ownership.leave(tenant, fence))
            log.info("execution created by another request", extra={"executionId": execution_id})
            return Started(execution_id, "running")
        if claim.status_before is Status.PAUSED:
            # The pause stops counting as such: its new owner counts (or it ends).
            await self._launcher.quietly(
                execution_id, self._ownership.leave(tenant, paused_member(execution_id))
            )
        return claim

    # -- what the janitor found due ------------------------------------------------

    async def _tend(self, janitor: Janitor) -> None:
        """Act on what each janitor pass finds due, in order: re-assert into a store
        that changed servers, take over the expired leases, end the expired pauses."""
        async for due in janitor.passes():
            if not self.accepting:
                continue  # shutting down: this process takes nothing over any more
            try:
                if due.restarted:
                    await self._reassert()
                for execution_id, fence in due.dead:
                    await self._take_over(execution_id, fence, how=Takeover.DEAD)
                for execution_id, fence in due.leases:
                    await self._take_over(execution_id, fence, how=due.takeover)
                for execution_id in due.deadlines:
                    if await self._expire(execution_id) is not Claimed.NOT_YET:
                        await self._ownership.forget_deadline(execution_id)
            except FlowcastError as exc:
                # As a failed pass: owners need a lease to renew before anyone may
                # call their lease expired.
                janitor.distrust()
                log.warning("janitor pass failed", extra={"error": str(exc)})

    async def _reassert(self) -> None:
        """Another Redis server answers: tell it at once what it may have forgotten (the
        runs here, by renewing their leases; how the latest runs here ended), within
        the short settle every process waits for."""
        await self._keeper.renew_now()
        await self._finals.reassert()

    async def _take_over(self, execution_id: str, fence: str, *, how: Takeover) -> None:
        """Take over an execution from ``fence`` and recover it, if it is due."""
        if execution_id in self._locals or not self.accepting:
            return
        if await self._recover(execution_id, fence, how) is not Claimed.NOT_YET:
            # Recovered now by a new owner (whose own entry watches it from here on),
            # or settled already: this entry names nothing left to do.
            await self._ownership.forget_lease(execution_id, fence)

    async def _expire(self, execution_id: str) -> Claimed:
        """End a pause past its approval deadline: win ``expire``, then write the
        ``approval_timeout`` failure."""
        fence = self._fence()
        try:
            meta = await self._buffer.meta(execution_id)
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(execution_id, Mode.EXPIRE, fence)
        except (Conflict, NotFound) as exc:
            await self._launcher.quietly(execution_id, self._ownership.release(execution_id, fence))
            return Claimed.NOT_YET if isinstance(exc, NotDue) else Claimed.SETTLED
        extra = {"executionId": execution_id, "mode": Mode.EXPIRE.value}
        log.warning("ending an execution", extra=extra)
        self._launcher.launch(
            execution_id,
            claim,
            identity=identity_of(meta),
            body=ending_body(approval_timeout),
            meta=meta,
        )
        return Claimed.WON

    async def _recover(self, execution_id: str, expected: str, how: Takeover) -> Claimed:
        """Win the execution from ``expected`` (the owner it may replace: see
        Takeover), then carry it on from its checkpoint here."""
        fence = self._fence()
        try:
            await self._ownership.check_settled()
        except BufferUnavailable:
            return Claimed.NOT_YET
        try:
            meta = await self._buffer.meta(execution_id)
            await self._ownership.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id, Mode.TAKEOVER, fence, expected=expected, takeover=how
            )
        except (Conflict, NotFound) as exc:
            await self._launcher.quietly(execution_id, self._ownership.release(execution_id, fence))
            return Claimed.NOT_YET if isinstance(exc, LeaseHeld) else Claimed.SETTLED
        # The new owner counts for the tenant in place of the one it took over from.
        await self._launcher.quietly(
            execution_id,
            self._ownership.count(meta.tenant, fence),
            self._ownership.leave(meta.tenant, expected),
        )
        # Written back with the metadata should the store lose it: this recovery's
        # number and the crashes so far are part of what it must not forget.
        identity = {
            **identity_of(meta),
            Field.RECOVERIES.value: str(claim.recovery),
            Field.CRASHES.value: str(claim.crashes),
        }
        extra = {
            "executionId": execution_id,
            "reason": claim.reason,
            "recovery": claim.recovery,
        }
        if claim.cancel_requested:
            # Its owner accepted a cancel and stopped before writing it (F5): the
            # cancel is honoured before anything runs again, so no block starts here.
            log.warning("recovering a cancelled execution; ending it", extra=extra)
            self._launcher.launch(
                execution_id, claim, identity=identity, body=self._cancelled(claim), meta=meta
            )
            return Claimed.WON
        if claim.reason is RecoveryReason.WORKER_LOST and claim.crashes > self._max_recoveries:
            log.warning("execution lost its owner too often; ending it", extra=extra)
            self._launcher.launch(
                execution_id, claim, identity=identity, body=ending_body(worker_lost), meta=meta
            )
            return Claimed.WON
        log.warning("recovering an execution", extra=extra)

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            async def work() -> Outcome:
                workflow, given, run = await self._load_run(local, emitter)
                run.recovered = True
                rerun = [b.id for b in workflow.blocks if b.id in run.unfinished()]
                _announce_recovery(emitter, claim, workflow, given, run, rerun)
                return await self._launcher.run_workflow(local, emitter, workflow, given, run)

            await self._launcher.execute(local, emitter, work)

        self._launcher.launch(execution_id, claim, identity=identity, body=body, meta=meta)
        return Claimed.WON

    def _cancelled(self, claim: Claim) -> Body:
        """A takeover of an execution whose cancel was accepted: ``execution:recovered``
        (nothing to run again), then ``execution:cancelled``.

        The recovered event says why the ids may jump (the previous owner died) and
        what the checkpoint kept, as every takeover does; the cancel is its ending.
        """

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            async def work() -> Outcome:
                workflow, given, run = await self._load_run(local, emitter)
                _announce_recovery(emitter, claim, workflow, given, run, rerun=[])
                # Ended as a stopped run ends: its last event is the cancel.
                local.stop(StopReason.CANCEL)
                raise asyncio.CancelledError

            await self._launcher.execute(local, emitter, work)

        return body

    # -- running -------------------------------------------------------------------

    async def _admit(self, tenant: str, fence: str, *, replaces: str = "") -> None:
        if not await self._ownership.admit(
            tenant, fence, limit=self._per_tenant, replaces=replaces
        ):
            raise TooBusy(
                f"this tenant already runs {self._per_tenant} executions; try again shortly",
                retry_after=max(1, round(self._lease_seconds / 3)),
            )


def _announce_recovery(
    emitter: ExecutionLog,
    claim: Claim,
    workflow: Workflow,
    given: Any,
    run: RunState,
    rerun: list[str],
) -> None:
    """The first events of a run taken over: ``execution:recovered`` naming the blocks
    that run again and those kept from the checkpoint."""
    if claim.base == 0:
        # Its owner died before anything was stored or shown, even its first event:
        # the log starts as every log does.
        emitter.emit(EXECUTION_STARTED, {"input": given})
    completed = [b.id for b in workflow.blocks if b.id in run.outputs]
    data = {
        "reason": claim.reason,
        "recovery": claim.recovery,
        "rerun": rerun,
        "completed": completed,
    }
    emitter.emit(EXECUTION_RECOVERED, data)


def _check_answer(schema: dict[str, Any], answer: Any) -> None:
    """Refuse a resume input that its pause's JSON Schema does not accept (422)."""
    problems = answer_problems(schema, answer)
    if problems:
        raise InvalidInput("the input does not match the pause's schema", problems)
