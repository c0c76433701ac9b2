"""Who owns an execution, as one state machine: every transition is one Lua call.

The table is ``TRANSITIONS`` below (tests/execution/test_transitions.py drives each row
against a real server, and checks that this drawing is the table):

    state    transition  script      to        who may ask; the refusals it may get
    -------  ----------  ----------  --------  --------------------------------------------
    (none)   start       start.lua   running   the process that accepted the execute,
                                               when it has a free slot, nothing waits
                                               and its tenant may run one more
                                               (queue.py)
    (none)   queue       start.lua   queued    the process that accepted the execute,
                                               otherwise: owned by nobody, in its
                                               tenant's line (queue.py)
    queued   take        claim.lua   running   a worker that took it from the queue
                                               (a stale delivery is refused: dropped)
                                               refused: NOEXEC STATUS REVOKED
    queued   revoke      claim.lua   queued    any janitor, a lease after a worker took
                                               it and did not claim it: that worker's
                                               take is refused from then on, however
                                               late; then it is queued again (queue.py)
                                               refused: STATUS
    queued   cancel      claim.lua   running   any process; it takes it out of line,
                                               then writes execution:started and the
                                               cancel (it never ran)
                                               refused: NOEXEC STATUS
    running  pause       append.lua  paused    the owner, storing execution:paused
                                               refused: NOEXEC FENCED ORDER CANCEL
    running  complete    append.lua  terminal  the owner, storing the terminal event
                                               (a cancel accepted before wins: CANCEL)
                                               refused: NOEXEC FENCED ORDER CANCEL
    running  renew       renew.lua   running   the owner, every third of a lease
                                               refused: GONE FENCED BEHIND
    paused   resume      claim.lua   running   any process, for a valid answer (once);
                                               not while the store is behind (a lease
                                               after it came back without writes it had
                                               acknowledged: store.py), nor for a lease
                                               after a replica stored the pause again
                                               (it came back empty: finals.py): HELD
                                               refused: NOEXEC STATUS BLOCK HELD
    paused   resume later  claim.lua   queued    any process, for a valid answer (once),
                                               when it may not run it now (its tenant
                                               runs its cap, or no free slot here): in
                                               line before its tenant's starts
                                               refused: NOEXEC STATUS BLOCK HELD
    paused   cancel      claim.lua   running   any process; it then writes the cancel
                                               (HELD as a resume is)
                                               refused: NOEXEC STATUS HELD
    running  cancel      claim.lua   running   any process: flags cancelRequested; the
                                               owner's next final event becomes the cancel
                                               refused: NOEXEC STATUS
    paused   expire      claim.lua   running   any janitor, past the approval deadline
                                               (a lease later if the store came back
                                               behind: store.py)
                                               refused: NOEXEC STATUS NOTDUE
    running  take over   claim.lua   running   any janitor, past the owner's lease; any
                                               process once the owner handed it off; the
                                               next process of the owner's node, which
                                               proved it dead, at once. The new owner
                                               recovers the run, or ends it cancelled
                                               if the claim says a cancel was accepted
                                               (nothing runs again). After the store
                                               came back behind (store.py), it numbers
                                               above the durable ceiling (ceiling.py),
                                               or, if the run's final record says it
                                               ended, stores that end again as its
                                               owner would have (finals.py). A death
                                               charged to it as its process's one
                                               suspect quarantines it: the new owner
                                               ends it failed (blame.py). A process
                                               runs one suspect at a time: SUSPECT
                                               refused: NOEXEC STATUS LEASE MOVED SUSPECT
    running  hand off    claim.lua   running   the owner, shutting down: no owner, for
                                               another process to take over at once
                                               refused: NOEXEC STATUS MOVED

A refusal is the script's error reply, raised as the exception ``record.REFUSALS``
maps it to (drawn in record.py): ``STATUS`` a ``WrongStatus`` with the status that
won, ``NOEXEC`` a ``NotFound`` (for append.lua ``WriteGone``), and so on. A claim sent
again by the owner it made (its first answer was lost) answers as the first did.

A claim gives the caller a new fencing token and epoch: append.lua refuses any other
writer, so a stalled old owner can never append after it. An owner whose epoch is above
the stored one is the owner a store restored from an older snapshot forgot; it takes
its execution back. Leases and deadlines are on Redis's clock (``TIME``).

The transitions keep the other parts of ownership in step, each its own module: the
watch lists the janitors read (watchlists.py: a lease entry is written before the
claim that needs it, so an execution is never running without a watched lease), the
tenant counts (admission.py), the control and hand-off streams (control.py), and which
Redis server answers, with the short settle after it changed (store.py), which a
request that would move ownership waits out first.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import ResponseError

from lib.backend import Batch, register, translated
from lib.errors import FlowcastError
from lib.execution.admission import COUNTED_LEASES, Admission
from lib.execution.blame import Verdict
from lib.execution.buffer import EventBuffer
from lib.execution.control import ControlStreams
from lib.execution.indexes import Listed
from lib.execution.queue import Entered, Queue
from lib.execution.record import (
    Asked,
    Mode,
    RecoveryReason,
    Reply,
    Script,
    Status,
    Takeover,
    refused,
)
from lib.execution.watchlists import WatchLists


@dataclass(frozen=True)
class Transition:
    """One row of the state machine: from which status, by which script (and claim
    mode), to which status, who may ask, and the refusals it may get."""

    before: Status | None  # None: the execution does not exist yet
    name: str
    script: Script
    mode: Mode | None  # claim.lua's transition, for the rows it makes
    after: tuple[Status, ...]
    who: str  # may span lines ("\n"), as drawn
    refusals: tuple[Reply, ...]


_APPEND_REFUSALS = (Reply.NOEXEC, Reply.FENCED, Reply.ORDER, Reply.CANCEL)

log = logging.getLogger(__name__)

# Reserved by start.lua with the creation: the first event (``execution:started``) is
# shown as it is emitted, not an append later. A process dead before storing it left a
# client maybe seeing it: the next owner numbers above it, and its id is a dropped gap.
START_RESERVED = 1

TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        None, "start", Script.START, None, (Status.RUNNING,),
        "the process that accepted the execute,\nwhen it has a free slot, nothing waits\n"
        "and its tenant may run one more\n(queue.py)", (),
    ),
    Transition(
        None, "queue", Script.START, None, (Status.QUEUED,),
        "the process that accepted the execute,\notherwise: owned by nobody, in its\n"
        "tenant's line (queue.py)", (),
    ),
    Transition(
        Status.QUEUED, "take", Script.CLAIM, Mode.TAKE, (Status.RUNNING,),
        "a worker that took it from the queue\n(a stale delivery is refused: dropped)",
        (Reply.NOEXEC, Reply.STATUS, Reply.REVOKED),
    ),
    Transition(
        Status.QUEUED, "revoke", Script.CLAIM, Mode.REVOKE, (Status.QUEUED,),
        "any janitor, a lease after a worker took\nit and did not claim it: that worker's\n"
        "take is refused from then on, however\nlate; then it is queued again (queue.py)",
        (Reply.STATUS,),
    ),
    Transition(
        Status.QUEUED, "cancel", Script.CLAIM, Mode.CANCEL, (Status.RUNNING,),
        "any process; it takes it out of line,\nthen writes execution:started and the\n"
        "cancel (it never ran)",
        (Reply.NOEXEC, Reply.STATUS),
    ),
    Transition(
        Status.RUNNING, "pause", Script.APPEND, None, (Status.PAUSED,),
        "the owner, storing execution:paused", _APPEND_REFUSALS,
    ),
    Transition(
        Status.RUNNING, "complete", Script.APPEND, None,
        (Status.COMPLETED, Status.FAILED, Status.CANCELLED),
        "the owner, storing the terminal event\n(a cancel accepted before wins: CANCEL)",
        _APPEND_REFUSALS,
    ),
    Transition(
        Status.RUNNING, "renew", Script.RENEW, None, (Status.RUNNING,),
        "the owner, every third of a lease", (Reply.GONE, Reply.FENCED, Reply.BEHIND),
    ),
    Transition(
        Status.PAUSED, "resume", Script.CLAIM, Mode.RESUME, (Status.RUNNING,),
        "any process, for a valid answer (once);\nnot while the store is behind (a lease\n"
        "after it came back without writes it had\nacknowledged: store.py), nor for a lease\n"
        "after a replica stored the pause again\n(it came back empty: finals.py): HELD",
        (Reply.NOEXEC, Reply.STATUS, Reply.BLOCK, Reply.HELD),
    ),
    Transition(
        Status.PAUSED, "resume later", Script.CLAIM, Mode.RESUME, (Status.QUEUED,),
        "any process, for a valid answer (once),\nwhen it may not run it now (its tenant\n"
        "runs its cap, or no free slot here): in\nline before its tenant's starts",
        (Reply.NOEXEC, Reply.STATUS, Reply.BLOCK, Reply.HELD),
    ),
    Transition(
        Status.PAUSED, "cancel", Script.CLAIM, Mode.CANCEL, (Status.RUNNING,),
        "any process; it then writes the cancel\n(HELD as a resume is)",
        (Reply.NOEXEC, Reply.STATUS, Reply.HELD),
    ),
    Transition(
        Status.RUNNING, "cancel", Script.CLAIM, Mode.CANCEL, (Status.RUNNING,),
        "any process: flags cancelRequested; the\nowner's next final event becomes the cancel",
        (Reply.NOEXEC, Reply.STATUS),
    ),
    Transition(
        Status.PAUSED, "expire", Script.CLAIM, Mode.EXPIRE, (Status.RUNNING,),
        "any janitor, past the approval deadline\n(a lease later if the store came back\n"
        "behind: store.py)",
        (Reply.NOEXEC, Reply.STATUS, Reply.NOTDUE),
    ),
    Transition(
        Status.RUNNING, "take over", Script.CLAIM, Mode.TAKEOVER, (Status.RUNNING,),
        "any janitor, past the owner's lease; any\nprocess once the owner handed it off; the"
        "\nnext process of the owner's node, which\nproved it dead, at once. The new owner"
        "\nrecovers the run, or ends it cancelled\nif the claim says a cancel was accepted"
        "\n(nothing runs again). After the store\ncame back behind (store.py), it numbers"
        "\nabove the durable ceiling (ceiling.py),\nor, if the run's final record says it"
        "\nended, stores that end again as its\nowner would have (finals.py). A death"
        "\ncharged to it as its process's one\nsuspect quarantines it: the new owner"
        "\nends it failed (blame.py). A process\nruns one suspect at a time: SUSPECT",
        (Reply.NOEXEC, Reply.STATUS, Reply.LEASE, Reply.MOVED, Reply.SUSPECT),
    ),
    Transition(
        Status.RUNNING, "hand off", Script.CLAIM, Mode.HANDOFF, (Status.RUNNING,),
        "the owner, shutting down: no owner, for\nanother process to take over at once",
        (Reply.NOEXEC, Reply.STATUS, Reply.MOVED),
    ),
)  # fmt: skip


def draw_transitions() -> str:
    """``TRANSITIONS`` as the table the module docstring shows."""
    lines = [
        "    state    transition  script      to        who may ask; the refusals it may get",
        "    -------  ----------  ----------  --------  " + "-" * 44,
    ]
    for row in TRANSITIONS:
        after = "terminal" if len(row.after) > 1 else row.after[0]
        first, *more = row.who.split("\n")
        if row.refusals:
            more.append("refused: " + " ".join(row.refusals))
        before = row.before or "(none)"
        lines.append(f"    {before:<7}  {row.name:<10}  {row.script:<10}  {after:<8}  {first}")
        lines += [f"    {'':<43}{line}" for line in more]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Claim:
    """A won transition: where the new owner's numbering starts, and what it replaced.

    ``last_id`` is the last stored id; the new owner numbers from ``base`` + 1 (above
    every id the previous owner may have shown live). ``owner`` and ``epoch`` are the
    caller's, except for a cancel of a running execution: then they are the owner's.
    """

    last_id: int
    base: int
    status_before: Status | None  # None: it was just created
    owner: str
    epoch: int
    recovery: int = 0  # a takeover: which recovery of the execution this is (1, 2, …)
    reason: RecoveryReason | None = None  # a takeover: why
    crashes: int = 0  # a takeover: deaths charged to it so far, this one included
    # A cancel was accepted and is not written yet: a takeover ends the run cancelled.
    cancel_requested: bool = False
    # The highest id reserved for the new owner already (``base`` when none above it):
    # it shows the events up to it as it emits them (a start reserves its first).
    reserved: int = 0
    # Every death of an owner while it ran (charged or not): a suspect once above 0.
    deaths: int = 0


def node_of(token: str) -> str:
    """The process a fencing token belongs to (tokens are ``<node>:<random>``)."""
    return token.partition(":")[0]


class Ownership:
    """The transitions, on the buffer's Redis; each keeps the watch lists, the tenant
    counts and the hand-off stream in step with it."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        lease_seconds: float,
        watch: WatchLists,
        admission: Admission,
        control: ControlStreams,
        queue: Queue | None = None,
    ) -> None:
        self.buffer = buffer
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.lease_ms = int(lease_seconds * 1000)
        self._watch = watch
        self._admission = admission
        self._control = control
        # Without a queue of its own (a test's), the admission's cap, nothing queued
        # beyond a running cap.
        self.queue = queue or Queue(
            buffer=buffer, lease_seconds=lease_seconds, max_unfinished=admission.limit
        )
        self._claim = register(self.redis, __package__, "claim.lua")
        self._renew = register(self.redis, __package__, "renew.lua")
        # Admissions of starts that did not happen, not taken back yet (Redis could not
        # be reached then): (tenant, fence) -> when (monotonic) the start gave up.
        self._owed: dict[tuple[str, str], float] = {}

    def new_fence(self, node: str) -> str:
        return f"{node}:{secrets.token_hex(8)}"

    # -- transitions ---------------------------------------------------------------

    async def start(
        self,
        execution_id: str,
        *,
        fence: str,
        workflow_id: str,
        tenant: str,
        created_at: str,
        created_ms: int,
        extra: dict[str, str] | None = None,
        state: dict[str, bytes] | None = None,
        checked: Callable[[Batch], None] | None = None,
        alongside: Callable[[Batch], None] | None = None,
        here: bool = True,
        announce: Callable[[Batch], None] | None = None,
    ) -> Claim | Entered | None:
        """Create an execution, running and owned by ``fence``, with its run state fields
        ``state``; None when it exists already (its id was named in advance and another
        process created it first: that one runs it). ``TooBusy`` when its tenant may
        not have one more.

        Before the creation, in one round trip (none needs another's answer): the
        tenant's admission, the lease entry that watches the new owner (when it may
        run here: one that cannot is queued, owned by nobody), its listing in
        the tenant's index, and what ``alongside`` adds to the batch, which the caller
        must have stored before the execution exists (its workflow version). ``checked``
        adds reads whose answers may refuse the start (the workflow the caller went on
        with, still the stored one), judged before the admission. The admission, the
        lease entry and the listing this call made are taken back when the batch fails
        or a check refuses (a refusal changes nothing); cleanup that fails is logged.
        The new owner shows its first event as it emits it (``START_RESERVED``).

        The admission is the queue's (queue.py): the execution runs here at once when
        ``here`` (this process has a free worker slot), nothing waits and the tenant
        may run one more; else it is created ``queued``, owned by nobody, and the
        answer is the ``Entered`` that says how many are ahead of it; ``announce`` adds
        to the creation's round trip of a queued one what tells the workers (the queue's
        wake-up: sent after the creation's answer, it cost every queued start a round
        trip before a worker heard of it, issue 25).
        """
        batch = Batch(self.redis)
        # The listing's answer is handed over before the admission's refusal stops the
        # others: a start refused takes back the listing it made (a 429 changes nothing).
        listed: list[int] = []
        where = Listed(tenant, workflow_id, created_ms)
        self.buffer.index_in(batch, execution_id, where, then=listed.append)
        if checked is not None:
            checked(batch)
        entered = self.queue.enter_in(batch, tenant, execution_id, fence, here=here)
        if here:
            # Not ``here``, queue.lua queues it whatever it finds: no owner, no lease to
            # watch (a lease entry written, then taken back, cost an API replica
            # without free slots a command and a round trip per start, issue 25).
            self._watch.hold_in(batch, execution_id, fence)
        if alongside is not None:
            alongside(batch)
        try:
            await batch.send()
        except BaseException:
            await self._undo_start(execution_id, tenant, fence)
            # It may have been queued before a check refused it.
            await self._quietly(
                "take back a place in line", execution_id, self.queue.dequeue(tenant, execution_id)
            )
            if listed == [1]:
                unlisting = self.buffer.unlist(execution_id, where)
                await self._quietly("take back a listing", execution_id, unlisting)
            raise
        queued = entered[0] if entered and entered[0].queued else None
        if queued is not None and here:
            # Nobody owns it until a worker takes it: no lease to watch.
            await self._quietly(
                "take back a lease entry", execution_id, self._watch.release(execution_id, fence)
            )
        try:
            created = await self.buffer.create(
                execution_id,
                workflow_id=workflow_id,
                tenant=tenant,
                owner="" if queued is not None else fence,
                created_at=created_at,
                created_ms=created_ms,
                lease_ms=self.lease_ms,
                reserved=START_RESERVED,
                extra=extra,
                state=state,
                listed=True,
                beside=announce if queued is not None else None,
            )
        except BaseException:
            if queued is not None:
                # It may exist all the same (a reply lost): left queued, it runs.
                raise
            # It may exist all the same (a reply lost): its lease entry stays watched.
            await self._undo_start(execution_id, tenant, fence, watched=True)
            raise
        if not created:
            # A place in line is the execution's (its id), not this request's: the
            # request that created it queued the same id (ZADD NX: one entry) and needs
            # it; if that one runs already, its stale entry is a delivery dropped.
            if queued is None:
                await self._undo_start(execution_id, tenant, fence)
            return None
        if listed != [1]:
            # Listed by another request starting the same id, which may take it back.
            await self._quietly(
                "list again", execution_id, self.buffer.list_again(execution_id, where)
            )
        if queued is not None:
            return queued
        return Claim(0, 0, None, fence, 1, reserved=START_RESERVED)

    async def _undo_start(
        self, execution_id: str, tenant: str, fence: str, *, watched: bool = False
    ) -> None:
        """Take back a start's admission and, unless ``watched``, its lease entry (best
        effort: a stale entry only expires, or is found pointing at nothing)."""
        try:
            await self._admission.leave(tenant, fence)
        except FlowcastError as exc:
            # Left, it would count for its tenant for COUNTED_LEASES leases: the janitor
            # passes take it back once Redis answers (``take_back_owed``).
            self._owed[(tenant, fence)] = time.monotonic()
            log.warning(
                "start cleanup failed; retried by the janitor",
                extra={"executionId": execution_id, "step": "admission", "error": str(exc)},
            )
        if not watched:
            await self._quietly(
                "take back a lease entry", execution_id, self._watch.release(execution_id, fence)
            )

    async def take_back_owed(self) -> None:
        """Take back the admissions of failed starts that could not be taken back then
        (each janitor pass asks; one still unreachable waits for the next). One owed
        longer than its entry can count is dropped: the admission forgets it anyway."""
        counted_for = (COUNTED_LEASES + 1) * self.lease_ms / 1000
        for (tenant, fence), since in list(self._owed.items()):
            if time.monotonic() - since > counted_for:
                del self._owed[(tenant, fence)]
                continue
            try:
                await self._admission.leave(tenant, fence)
            except FlowcastError:
                return  # still unreachable: the next pass tries again
            del self._owed[(tenant, fence)]

    @staticmethod
    async def _quietly(what: str, execution_id: str, step: Awaitable[None]) -> None:
        """Best-effort cleanup of a start that did not happen: a failure is logged, not
        raised (the start's own error is what the caller must see)."""
        try:
            await step
        except FlowcastError as exc:
            log.warning(
                "start cleanup failed",
                extra={"executionId": execution_id, "step": what, "error": str(exc)},
            )

    @translated
    async def claim(
        self,
        execution_id: str,
        mode: Mode,
        fence: str,
        *,
        block_id: str = "",
        expected: str = "",
        takeover: Takeover = Takeover.EXPIRED,
        answer: bytes = b"",
        base_at_least: int = 0,
        verdict: Verdict = Verdict.ALONE,
        busy: bool = False,
        later: bool = False,
        behind_ms: int = 0,
    ) -> Claim:
        """Win a transition (see claim.lua); its refusal otherwise (``WrongStatus`` with
        the status that won, ``NotFound``, …: see ``TRANSITIONS``).

        A resume's ``answer`` (JSON) is checkpointed with the claim: the 202 holds if
        this process dies before its resumed event is stored. ``base_at_least`` (the
        durable ceiling, after the store came back behind: takeovers.py ``recall``)
        puts the new owner's numbering above it, whatever the transition. A takeover's
        ``verdict`` says who the dead owner's death is charged to; ``busy``, that the
        caller runs a suspect already (``SuspectHeld`` for a run whose owners died:
        blame.py). A resume ``later`` puts the execution in line instead of running it
        here (the claim's owner is then ""). ``behind_ms``: how long the store is still
        behind (store.py): a resume or cancel of a pause is refused ``PauseHeld`` so long.
        """
        argument = block_id if mode is Mode.RESUME else expected
        try:
            (
                last,
                base,
                status,
                owner,
                epoch,
                recovery,
                reason,
                crashes,
                cancel,
                deaths,
            ) = await self._claim(
                keys=self._claim_keys(execution_id),
                args=[
                    mode,
                    fence,
                    self.lease_ms,
                    argument,
                    "queue" if later else takeover.value,
                    answer,
                    base_at_least,
                    verdict.value,
                    "busy" if busy else "",
                    self.keys.status,
                    execution_id,
                    behind_ms,
                ],
            )
        except ResponseError as exc:
            raise refused(Script.CLAIM, exc, Asked(execution_id, block_id)) from None
        return Claim(
            int(last),
            int(base),
            Status(status.decode()),
            owner.decode(),
            int(epoch),
            int(recovery),
            RecoveryReason(reason.decode()) if reason else None,
            int(crashes),
            cancel == b"1",
            deaths=int(deaths),
        )

    def _claim_keys(self, execution_id: str) -> list[str]:
        keys = self.keys
        return [keys.meta(execution_id), keys.state(execution_id), keys.revoked(execution_id)]

    @translated
    async def revoke(self, execution_id: str, taker: str) -> bool:
        """Fence the worker whose token is ``taker`` out of its take of a queued
        execution it never claimed (its delivery goes back to the line): its claim is
        refused from now on (``DeliveryRevoked``). True when the record is there, False
        when it is not yet (the mark waits for it); ``WrongStatus`` when the execution
        is no longer queued (the take was claimed, or a cancel won)."""
        try:
            found = await self._claim(
                keys=self._claim_keys(execution_id),
                args=[Mode.REVOKE, taker, self.buffer.active_ttl_seconds * 1000],
            )
        except ResponseError as exc:
            raise refused(Script.CLAIM, exc, Asked(execution_id)) from None
        return bool(found)

    @translated
    async def hand_off(self, execution_id: str, fence: str, *, shown_id: int) -> None:
        """Let go of a running execution now (a shutdown) and announce it, so another
        process takes it over at once; ``shown_id`` is the highest id it showed live
        (the ids it reserved above that go back). ``OwnerMoved`` when ``fence`` no
        longer owns it, ``WrongStatus`` when it is no longer running."""
        await self.claim(execution_id, Mode.HANDOFF, fence, expected=str(shown_id))
        # Due at once for every janitor, should the announcement be missed.
        await self._watch.due_now(execution_id, fence)
        await self._control.announce_handoff(execution_id, fence)

    @translated
    async def renew(
        self, execution_id: str, fence: str, epoch: int, tenant: str, stored_id: int = 0
    ) -> bool:
        """Extend the lease; True when a cancel was requested.

        ``Fenced`` when another owner holds it; ``RecordLost`` when the store lost it,
        whole or in part (the owner's writer then writes it back).
        """
        try:
            requested, _until = await self._renew(
                keys=[self.keys.meta(execution_id)], args=[fence, epoch, self.lease_ms, stored_id]
            )
        except ResponseError as exc:
            # Any other error (OOM at maxmemory, READONLY, MISCONF) is the store's
            # trouble, not a new owner: an outage (BufferUnavailable), renewed again later.
            raise refused(Script.RENEW, exc, Asked(execution_id)) from None
        await self._watch.hold(execution_id, fence)
        await self._admission.refresh(tenant, fence)
        return bool(requested == b"1")
