"""Takeovers: winning an execution whose owner died, handed it off or let its approval
time out, and carrying it on here.

A run taken over is recovered (SPEC §7): it emits ``execution:recovered`` and carries
on from the checkpoint, so only the blocks that had not completed run again; past
``max_recoveries`` crashes charged to it it ends ``worker_lost`` instead, one charged
with a death as its process's one suspect ends ``quarantined`` (blame.py: who a death is
charged to is judged from the dead process's record, and this process takes at most one
suspect at a time), and one whose cancel was accepted before its owner died ends
cancelled before anything runs again (F5). A pause
past its approval deadline ends ``approval_timeout``. Each starts with a fenced claim
(take over, expire), so of all the processes that try, exactly one wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum
from typing import Any

from lib.errors import (
    BufferUnavailable,
    Conflict,
    LeaseHeld,
    NotDue,
    NotFound,
    SuspectHeld,
    WrongStatus,
)
from lib.execution.admission import paused_member
from lib.execution.blame import DEATHS_PER_RECOVERY, SUSPECT_DEATHS, Suspicion, Verdict
from lib.execution.ceiling import Durable, read_durable
from lib.execution.events import (
    EXECUTION_PAUSED,
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
)
from lib.execution.log import ExecutionLog
from lib.execution.ownership import Claim, node_of
from lib.execution.record import (
    ExecutionMeta,
    Field,
    Mode,
    RecoveryReason,
    Status,
    StopReason,
    Takeover,
)
from lib.execution.values import ValueStoreError
from lib.workflows.executor import RunState
from lib.workflows.finals import Final
from lib.workflows.janitor import approval_timeout, quarantined, worker_lost
from lib.workflows.launcher import Body, Launcher, Outcome, ending_body, identity_of
from lib.workflows.leases import LocalRun
from lib.workflows.model import Workflow
from lib.workflows.parts import Parts
from lib.workflows.runstate import RunStates

log = logging.getLogger(__name__)

# How long a claim waits for the value store to say what a store back behind forgot
# (``recall``): past it, a resume or a cancel answers 503 and a janitor tries again on
# its next pass. An endpoint that answers nothing (black-holed) would hold them for
# minutes (boto3's own timeouts and retries): the fresh-eyes review of e37bdfa saw a
# resume unanswered after 170 s, Valkey back empty and S3 stopped.
RECALL_SECONDS = 5.0
# While the store was not seen behind, the read is a check only (``recall``'s ``ends``):
# it waits this long at most, and after one that failed while the value store answered
# nothing at all the next ones are not sent for ``RECALL_MUTE_SECONDS`` (they would fail
# alike). Without them every resume, cancel and takeover waited the full RECALL_SECONDS
# for a value store that answered nothing, one takeover after another (100 dead runs:
# over 8 minutes). A check that failed while the store answered others (slowed by a
# tenant's large values, or a run with many owners' records) mutes nothing: one
# tenant's load must not switch the check off for all.
UNSEEN_RECALL_SECONDS = 1.0
RECALL_MUTE_SECONDS = 10.0

# How far back a recovery looks for the pause a claimed resume answered: the pause, then
# at most one execution:recovered per takeover since (each bounded by max_recoveries).
RECENT_EVENTS = 64


class Claimed(Enum):
    """How a transition the janitor found due went."""

    WON = "won"  # this process owns it now
    NOT_YET = "not_yet"  # refused for now (the lease runs, the store settles, not due)
    SETTLED = "settled"  # refused for good (another owner or status, gone): forget it


async def load_run(
    launcher: Launcher, states: RunStates, local: LocalRun, emitter: ExecutionLog
) -> tuple[Workflow, Any, RunState]:
    """The workflow, input and checkpoint a resumed or recovered run goes on from
    (retried while the buffer is down; NotFound when the store lost them)."""
    execution_id = local.execution_id
    version, given, run, saved = await launcher.retrying(local, lambda: states.load(execution_id))
    emitter.remember(saved)
    workflow_id = local.identity.get(Field.WORKFLOW_ID, "")
    workflow: Workflow = await launcher.retrying(
        local,
        lambda: states.load_version(version, tenant=local.tenant, workflow_id=workflow_id),
    )
    local.workflow = workflow
    return workflow, given, run


class Takeovers:
    """Wins the executions found due here, and launches what follows."""

    def __init__(
        self, parts: Parts, *, max_recoveries: int = 3, suspicion: Suspicion | None = None
    ) -> None:
        transitions = parts.transitions
        self._parts = parts
        self._buffer = parts.buffer
        self._ownership = transitions.ownership
        self._watch = transitions.watch
        self._admission = transitions.admission
        self._store = transitions.store
        # Until when (monotonic) a check of how a run ended is not sent (``recall``).
        self._recall_muted_until = 0.0
        self._states = parts.states
        self._launcher = parts.launcher
        self._runs = parts.runs
        self._max_recoveries = max_recoveries
        self._suspicion = suspicion
        # One takeover at a time (the janitor's and the hand-off listener's): two at once
        # could both find no suspect here, and take one each.
        self._one_at_a_time = asyncio.Lock()

    async def take_over(self, execution_id: str, fence: str, *, how: Takeover) -> None:
        """Take over an execution from ``fence`` and recover it, if it is due."""
        if execution_id in self._runs or not self._runs.accepting:
            return
        async with self._one_at_a_time:
            claimed = await self._recover(execution_id, fence, how)
        if claimed is not Claimed.NOT_YET:
            # Recovered now by a new owner (whose own entry watches it from here on),
            # or settled already: this entry names nothing left to do.
            await self._watch.release(execution_id, fence)

    async def only_ends(self, execution_id: str) -> bool:
        """Whether a takeover of ``execution_id`` would only end it, running no block:
        a cancel was accepted for it (its record says so; the flag is never taken
        back), so it ends cancelled (``_recovery_body``). False when it is gone."""
        try:
            meta = await self._buffer.meta(execution_id)
        except NotFound:
            return False
        return meta.cancel_requested

    async def expire(self, execution_id: str) -> None:
        """End a pause past its approval deadline, if it is due: win ``expire``, then
        write the ``approval_timeout`` failure."""
        if await self._expire(execution_id) is not Claimed.NOT_YET:
            await self._watch.forget_deadline(execution_id)

    async def _expire(self, execution_id: str) -> Claimed:
        fence = self._parts.new_fence()
        try:
            meta = await self._buffer.meta(execution_id)
            ceiling = await self.recall(execution_id, meta)
            if ceiling is None:
                return Claimed.SETTLED
            await self._watch.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id, Mode.EXPIRE, fence, base_at_least=ceiling
            )
        except ValueStoreError:
            return Claimed.NOT_YET  # the next pass asks again
        except (Conflict, NotFound) as exc:
            await self._launcher.quietly(execution_id, self._watch.release(execution_id, fence))
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
        behind = self._store.came_back_behind()
        claimed = await self._recover_from(execution_id, expected, how)
        if behind and claimed is Claimed.NOT_YET:
            # Not taken over yet (the value store did not answer, the lease is not
            # trusted yet, ...): the store's reservations stay distrusted until it is,
            # or a later try past the window would number below ids a client saw.
            self._store.still_behind()
        return claimed

    async def _recover_from(self, execution_id: str, expected: str, how: Takeover) -> Claimed:
        fence = self._parts.new_fence()
        try:
            await self._store.wait_settled()
            meta = await self._buffer.meta(execution_id)
            ceiling = await self.recall(execution_id, meta, expected)
        except BufferUnavailable:
            return Claimed.NOT_YET
        except ValueStoreError as exc:
            log.warning(
                "takeover waits for the value store",
                extra={"executionId": execution_id, "error": str(exc)},
            )
            return Claimed.NOT_YET
        except NotFound:
            return Claimed.SETTLED
        if ceiling is None:
            return Claimed.SETTLED
        try:
            verdict, busy = await self._judge(meta, expected)
            await self._watch.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id,
                Mode.TAKEOVER,
                fence,
                expected=expected,
                takeover=how,
                base_at_least=ceiling,
                verdict=verdict,
                busy=busy,
            )
        except (Conflict, NotFound) as exc:
            await self._launcher.quietly(
                execution_id,
                self._watch.release(execution_id, fence),
                self._settle_suspect(execution_id, suspect=False),
            )
            if isinstance(exc, WrongStatus) and exc.status == Status.QUEUED:
                # Its lease entry outlived a resume that died before putting it in line
                # (runner.py ``_in_line``): in line now (once; a place kept stays).
                await self._in_line(meta)
            waits = isinstance(exc, LeaseHeld | SuspectHeld)
            return Claimed.NOT_YET if waits else Claimed.SETTLED
        except BaseException:
            # Not claimed (the store failed, or this was cancelled): nor a suspect here.
            await self._launcher.quietly(
                execution_id, self._settle_suspect(execution_id, suspect=False)
            )
            raise
        # The new owner counts for the tenant in place of the one it took over from.
        await self._launcher.quietly(
            execution_id,
            self._admission.count(meta.tenant, fence),
            self._admission.leave(meta.tenant, expected),
        )
        body, runs_again = self._recovery_body(execution_id, claim)
        self._launcher.launch(
            execution_id, claim, identity=_recovered_identity(meta, claim), body=body, meta=meta
        )
        # A run whose owners died runs here as this process's suspect (blame.py).
        suspect = runs_again and claim.deaths >= SUSPECT_DEATHS
        await self._launcher.quietly(
            execution_id, self._settle_suspect(execution_id, suspect=suspect)
        )
        return Claimed.WON

    async def _in_line(self, meta: ExecutionMeta) -> None:
        queue = self._parts.transitions.queue
        await queue.line(meta.tenant, meta.id, replaces=paused_member(meta.id))
        await self._launcher.quietly(meta.id, self._parts.transitions.control.announce_queued())

    async def recall(
        self, execution_id: str, meta: ExecutionMeta, expected: str = "", *, ends: bool = True
    ) -> int | None:
        """What a claim on ``meta`` (read just before) must know of what the store may
        have forgotten: the id to number above (0 when the store did not come back
        behind), or None when the run's end was stored again instead (the claim is
        moot). Every claim that takes an execution over asks first: a takeover, an
        expiry, a resume, a cancel (a cancel of a run the store brought back paused
        after it completed stored a second event under a shown id: the fault storm).

        The store may have forgotten ids an owner showed, or how the run ended, and the
        process that knew is not here to re-assert it: what the owners recorded
        outside it says (ceiling.py, finals.py). Asked for a while after this process saw
        the store behind, and for good of an execution nobody wrote since the store was
        last found so (a completed run back paused and cancelled an hour later; before,
        only within the while, which a busy machine outlasted in a CI run).
        ``ValueStoreError`` when it cannot say (the window of ``came_back_behind`` then
        lasts until it can). ``expected``: the owner a takeover replaces (it stops
        counting if the end is stored again).

        And whether the store was seen behind or not, how the run ended is asked every
        time (``ends``; a take of a queued run, on the start path, does not): a restore
        can come too soon after the snapshot for any live process to see it (a check
        every quarter second), and a resume of a run restored paused after it completed
        was answered 202 (one run in five of its test). The ids to number above are
        used only when the store was seen behind (a hand-off must not jump a block).
        If the value store cannot say then, the claim goes on as it would have."""
        behind = self._store.came_back_behind() or self._store.predates(meta.written_ms)
        if not (behind or ends):
            return 0
        if not behind and time.monotonic() < self._recall_muted_until:
            return 0  # the last check failed a moment ago: it would fail alike
        try:
            async with asyncio.timeout(RECALL_SECONDS if behind else UNSEEN_RECALL_SECONDS):
                durable = await read_durable(self._launcher.values, execution_id)
        except (ValueStoreError, TimeoutError) as exc:
            if not behind:
                silent = self._launcher.values.silent_seconds() >= UNSEEN_RECALL_SECONDS / 2
                if silent:
                    self._recall_muted_until = time.monotonic() + RECALL_MUTE_SECONDS
                log.warning(
                    "could not read how a run ended before claiming it; claiming it as stored"
                    + (", and the next ones for a while without asking" if silent else ""),
                    extra={
                        "executionId": execution_id,
                        "error": str(exc) or "timeout",
                        "muteSeconds": RECALL_MUTE_SECONDS if silent else 0,
                    },
                )
                return 0
            self._store.still_behind()
            if isinstance(exc, TimeoutError):
                raise ValueStoreError(
                    f"the value store did not answer within {RECALL_SECONDS:g} s"
                ) from exc
            raise
        if await self._ended_before(execution_id, meta, expected, durable):
            return None
        return durable.ceiling if behind else 0

    async def recalled(self, execution_id: str, meta: ExecutionMeta, *, ends: bool = True) -> int:
        """``recall`` for a request (a resume, a cancel) or a take: the id its claim
        numbers above; a run whose end the store had lost has it stored again, and the
        claim then meets that end (409 with the status that won). BufferUnavailable
        (503) when the value store cannot say what the store forgot."""
        try:
            ceiling = await self.recall(execution_id, meta, ends=ends)
        except ValueStoreError as exc:
            raise BufferUnavailable(
                f"the store came back behind and the value store cannot say what it lost: {exc}"
            ) from exc
        return 0 if ceiling is None else ceiling

    async def _judge(self, meta: ExecutionMeta, expected: str) -> tuple[Verdict, bool]:
        """Who the death of the owner is charged to, from its process's record, and
        whether this process runs a suspect already. A run whose owners died
        ``SUSPECT_DEATHS`` times, this death counted (a hand-off is none), is a
        suspect: unless this process runs one, it is recorded as this process's suspect
        before the claim, so that a death from the moment it runs here is charged to it
        (blame.py)."""
        if self._suspicion is None:
            return Verdict.ALONE, False
        died = meta.owner != ""  # a hand-off leaves no owner: nobody died
        verdict = Verdict.ALONE
        if died:
            record = await self._suspicion.records.read(node_of(expected or meta.owner))
            verdict = record.verdict(meta.id) if record is not None else Verdict.ALONE
        busy = self._suspicion.busy()
        if meta.deaths + died >= SUSPECT_DEATHS and not busy:
            if self._suspicion.suspect in self._runs or self._suspicion.crowded():
                # This process's suspect outlived its probation (or a crowd runs here):
                # the rest come as a crowd, so none waits longer than a probation.
                await self._suspicion.join(meta.id)
            else:
                await self._suspicion.take(meta.id)
        return verdict, busy

    async def _settle_suspect(self, execution_id: str, *, suspect: bool) -> None:
        if self._suspicion is not None:
            await self._suspicion.settle(execution_id, suspect=suspect)

    async def _ended_before(
        self, execution_id: str, meta: ExecutionMeta, expected: str, durable: Durable
    ) -> bool:
        """A store back behind says "running" (or "paused"), but the run's final record
        says it ended (or paused) later, and no owner started after that: store its last event
        again, as the process that ended it would have (finals.py), instead of running
        it a second time. False when there is none, or the store refused it."""
        record = durable.final
        if record is None or record["id"] <= max(meta.last_id, durable.base):
            return False
        final = Final.from_record(record)
        log.warning(
            "a run the store brought back running had ended; storing its end again",
            extra={"executionId": execution_id, "eventId": final.event.id},
        )
        if not await self._parts.finals.restore(execution_id, final, meta.last_id):
            return False
        # What counted for the tenant (the owner replaced, or the pause) stops counting.
        member = expected or (paused_member(execution_id) if meta.status == Status.PAUSED else "")
        if member:
            await self._launcher.quietly(execution_id, self._admission.leave(meta.tenant, member))
        return True

    def _recovery_body(self, execution_id: str, claim: Claim) -> tuple[Body, bool]:
        """What a won takeover runs: the accepted cancel, the ``quarantined`` ending of
        one charged as its process's suspect, the ``worker_lost`` ending of one that
        crashed too often, or the run carried on from its checkpoint; and whether that
        runs its blocks again."""
        extra = {
            "executionId": execution_id,
            "reason": claim.reason,
            "recovery": claim.recovery,
            "deaths": claim.deaths,
        }
        if claim.cancel_requested:
            # Its owner accepted a cancel and stopped before writing it (F5): the
            # cancel is honoured before anything runs again, so no block starts here.
            log.warning("recovering a cancelled execution; ending it", extra=extra)
            return self._cancelled(claim), False
        if claim.reason is RecoveryReason.QUARANTINED:
            log.warning("execution quarantined: its owners kept dying; ending it", extra=extra)
            return ending_body(quarantined(claim.deaths)), False
        if claim.reason is RecoveryReason.WORKER_LOST and lost_too_often(
            claim, self._max_recoveries
        ):
            log.warning("execution lost its owner too often; ending it", extra=extra)
            return ending_body(worker_lost), False
        log.warning("recovering an execution", extra=extra)

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            async def work() -> Outcome:
                workflow, given, run = await load_run(self._launcher, self._states, local, emitter)
                run.recovered = True
                rerun = [b.id for b in workflow.blocks if b.id in run.unfinished()]
                unresumed = await self._unresumed(execution_id, claim.last_id, run)
                _announce_recovery(emitter, claim, workflow, given, run, rerun)
                for block_id in unresumed:
                    # Its resume took effect (the claim stored the answer) and its owner
                    # died before the event was stored: the log says so now.
                    answer = {"blockId": block_id, "input": run.answers[block_id]}
                    emitter.emit(EXECUTION_RESUMED, answer)
                return await self._launcher.run_workflow(local, emitter, workflow, given, run)

            await self._launcher.execute(local, emitter, work)

        return body, True

    async def _unresumed(self, execution_id: str, last_id: int, run: RunState) -> list[str]:
        """The answered pauses whose ``execution:resumed`` was never stored: the resume's
        claim stored the answer in the checkpoint, and its owner died before the event
        (the blocks answered, not completed, whose latest pause or resume event among
        the last stored ones is the pause)."""
        waiting = [block_id for block_id in run.answers if block_id not in run.outputs]
        if not waiting:
            return []
        recent = await self._buffer.after(execution_id, after=max(0, last_id - RECENT_EVENTS))
        latest: dict[str, str] = {}
        for event in recent:
            if event.type in (EXECUTION_PAUSED, EXECUTION_RESUMED):
                latest[str(event.data.get("blockId", ""))] = event.type
        return [block_id for block_id in waiting if latest.get(block_id) == EXECUTION_PAUSED]

    def _cancelled(self, claim: Claim) -> Body:
        """A takeover of an execution whose cancel was accepted: ``execution:recovered``
        (nothing to run again), then ``execution:cancelled``.

        The recovered event says why the ids may jump (the previous owner died) and
        what the checkpoint kept, as every takeover does; the cancel is its ending.
        """

        async def body(local: LocalRun, emitter: ExecutionLog) -> None:
            async def work() -> Outcome:
                workflow, given, run = await load_run(self._launcher, self._states, local, emitter)
                _announce_recovery(emitter, claim, workflow, given, run, rerun=[])
                # Ended as a stopped run ends: its last event is the cancel.
                local.stop(StopReason.CANCEL)
                raise asyncio.CancelledError

            await self._launcher.execute(local, emitter, work)

        return body


def lost_too_often(claim: Claim, max_recoveries: int) -> bool:
    """Whether a run taken over after a death ends ``worker_lost``: past
    ``max_recoveries`` crashes charged to it (0: no recovery at all, charged or not), or
    past ``DEATHS_PER_RECOVERY`` deaths per recovery allowed, whoever was to blame (a
    run that kills its process only after its probation as a suspect: blame.py)."""
    if max_recoveries == 0 or claim.crashes > max_recoveries:
        return True
    return claim.deaths > DEATHS_PER_RECOVERY * (max_recoveries + 1)


def _recovered_identity(meta: ExecutionMeta, claim: Claim) -> dict[str, str]:
    """The fields to write back with the metadata should the store lose it: this
    recovery's number and the crashes so far are part of what it must not forget."""
    return {
        **identity_of(meta),
        Field.RECOVERIES.value: str(claim.recovery),
        Field.CRASHES.value: str(claim.crashes),
        Field.DEATHS.value: str(claim.deaths),
    }


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
        emitter.emit(EXECUTION_STARTED, {"input": given, "queuedMs": 0})
    completed = [b.id for b in workflow.blocks if b.id in run.outputs]
    data = {
        "reason": claim.reason,
        "recovery": claim.recovery,
        "rerun": rerun,
        "completed": completed,
    }
    emitter.emit(EXECUTION_RECOVERED, data)
