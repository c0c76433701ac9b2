"""Who owns an execution, as one state machine: every transition is one Lua call.

The table is ``TRANSITIONS`` below (tests/execution/test_transitions.py drives each row
against a real server, and checks that this drawing is the table):

    state    transition  script      to        who may ask; the refusals it may get
    -------  ----------  ----------  --------  --------------------------------------------
    (none)   start       start.lua   running   the process that accepted the execute
    running  pause       append.lua  paused    the owner, storing execution:paused
                                               refused: NOEXEC FENCED ORDER CANCEL
    running  complete    append.lua  terminal  the owner, storing the terminal event
                                               (a cancel accepted before wins: CANCEL)
                                               refused: NOEXEC FENCED ORDER CANCEL
    running  renew       renew.lua   running   the owner, every third of a lease
                                               refused: GONE FENCED BEHIND
    paused   resume      claim.lua   running   any process, for a valid answer (once)
                                               refused: NOEXEC STATUS BLOCK
    paused   cancel      claim.lua   running   any process; it then writes the cancel
                                               refused: NOEXEC STATUS
    running  cancel      claim.lua   running   any process: flags cancelRequested; the
                                               owner's next final event becomes the cancel
                                               refused: NOEXEC STATUS
    paused   expire      claim.lua   running   any janitor, past the approval deadline
                                               refused: NOEXEC STATUS NOTDUE
    running  take over   claim.lua   running   any janitor, past the owner's lease; any
                                               process once the owner handed it off; the
                                               next process of the owner's node, which
                                               proved it dead, at once. The new owner
                                               recovers the run, or ends it cancelled
                                               if the claim says a cancel was accepted
                                               (nothing runs again)
                                               refused: NOEXEC STATUS LEASE MOVED
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

When another Redis server starts answering (a restart, a replica promoted), it may have
forgotten recent transitions: every process notices within ``check_seconds`` and
re-asserts what it holds at once, and no ownership moves until a short settle
(``settle_seconds``) has let them; a request that would move one waits it out.

Two watch lists tell the janitors what to look at: ``leases`` holds one member
``"<eid> <fence>"`` per running ownership, scored by lease end, so the cleanup of one
run can never remove the entry of the next; ``deadlines`` holds paused executions by
approval deadline. The lease entry is written before the claim that needs it, so an
execution is never running without a watched lease. A cancel for an execution owned by
another process is also a message on that process's control stream, and a hand-off is
announced on the ``handoffs`` stream that every process reads.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.exceptions import ResponseError

from lib.backend import register, translated
from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.record import (
    Asked,
    Field,
    Mode,
    RecoveryReason,
    Reply,
    Script,
    Status,
    Takeover,
    refused,
)

# How many leases a dead owner's run goes on counting for its tenant, waiting for a
# janitor to take it over (admit.lua).
COUNTED_LEASES = 10
# After another Redis server starts answering, how long ownership waits for the owners
# to re-assert what it may have forgotten (store.lua). Every process looks at which
# server answers four times within it and re-asserts at once when it changed, so a
# short wait covers them; it is also what an approval deadline may be late by.
SETTLE_SECONDS = 1.0
# What a request that moves ownership (a resume, a cancel) waits of a settle, beyond
# the settle itself, before it answers 503 (the store keeps changing servers).
SETTLE_GRACE_SECONDS = 1.0



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

TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        None, "start", Script.START, None, (Status.RUNNING,),
        "the process that accepted the execute", (),
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
        "any process, for a valid answer (once)", (Reply.NOEXEC, Reply.STATUS, Reply.BLOCK),
    ),
    Transition(
        Status.PAUSED, "cancel", Script.CLAIM, Mode.CANCEL, (Status.RUNNING,),
        "any process; it then writes the cancel", (Reply.NOEXEC, Reply.STATUS),
    ),
    Transition(
        Status.RUNNING, "cancel", Script.CLAIM, Mode.CANCEL, (Status.RUNNING,),
        "any process: flags cancelRequested; the\nowner's next final event becomes the cancel",
        (Reply.NOEXEC, Reply.STATUS),
    ),
    Transition(
        Status.PAUSED, "expire", Script.CLAIM, Mode.EXPIRE, (Status.RUNNING,),
        "any janitor, past the approval deadline", (Reply.NOEXEC, Reply.STATUS, Reply.NOTDUE),
    ),
    Transition(
        Status.RUNNING, "take over", Script.CLAIM, Mode.TAKEOVER, (Status.RUNNING,),
        "any janitor, past the owner's lease; any\nprocess once the owner handed it off; the"
        "\nnext process of the owner's node, which\nproved it dead, at once. The new owner"
        "\nrecovers the run, or ends it cancelled\nif the claim says a cancel was accepted"
        "\n(nothing runs again)",
        (Reply.NOEXEC, Reply.STATUS, Reply.LEASE, Reply.MOVED),
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
class Store:
    """The Redis server that answers, and how long ownership must still wait."""

    identity: str
    settling_seconds: float


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
    crashes: int = 0  # a takeover: recoveries for "worker_lost" so far, this one included
    # A cancel was accepted and is not written yet: a takeover ends the run cancelled.
    cancel_requested: bool = False


def node_of(token: str) -> str:
    """The process a fencing token belongs to (tokens are ``<node>:<random>``)."""
    return token.partition(":")[0]


def paused_member(execution_id: str) -> str:
    return f"paused:{execution_id}"


def lease_member(execution_id: str, fence: str) -> str:
    return f"{execution_id} {fence}"


def parse_member(member: bytes | str) -> tuple[str, str]:
    text = member.decode() if isinstance(member, bytes) else member
    execution_id, _, fence = text.partition(" ")
    return execution_id, fence


class Ownership:
    """The transitions, leases, run state and control messages, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float) -> None:
        self.buffer = buffer
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.lease_ms = int(lease_seconds * 1000)
        self.settle_seconds = min(SETTLE_SECONDS, 2 * lease_seconds)
        # How often each process asks which server answers (and looks at deadlines).
        self.check_seconds = self.settle_seconds / 4
        package = __package__
        self._claim = register(self.redis, package, "claim.lua")
        self._renew = register(self.redis, package, "renew.lua")
        self._admit = register(self.redis, package, "admit.lua")
        self._watch = register(self.redis, package, "watch.lua")
        self._store = register(self.redis, package, "store.lua")

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
    ) -> Claim | None:
        """Create an execution, running and owned by ``fence`` (watched first), with its
        run state fields ``state``; None when it exists already (its id was named in
        advance and another process created it first: that one runs it)."""
        await self.hold(execution_id, fence)
        created = await self.buffer.create(
            execution_id,
            workflow_id=workflow_id,
            tenant=tenant,
            owner=fence,
            created_at=created_at,
            created_ms=created_ms,
            lease_ms=self.lease_ms,
            extra=extra,
            state=state,
        )
        if not created:
            await self.forget_lease(execution_id, fence)
            return None
        return Claim(0, 0, None, fence, 1)

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
    ) -> Claim:
        """Win a transition (see claim.lua); its refusal otherwise (``WrongStatus`` with
        the status that won, ``NotFound``, …: see ``TRANSITIONS``).

        A resume's ``answer`` (JSON) is checkpointed with the claim: the 202 holds if
        this process dies before its resumed event is stored.
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
            ) = await self._claim(
                keys=[self.keys.meta(execution_id), self.keys.state(execution_id)],
                args=[
                    mode,
                    fence,
                    self.lease_ms,
                    argument,
                    takeover.value,
                    answer,
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
        )

    @translated
    async def hand_off(self, execution_id: str, fence: str, *, shown_id: int) -> None:
        """Let go of a running execution now (a shutdown) and announce it, so another
        process takes it over at once; ``shown_id`` is the highest id it showed live
        (the ids it reserved above that go back). ``OwnerMoved`` when ``fence`` no
        longer owns it, ``WrongStatus`` when it is no longer running."""
        await self.claim(execution_id, Mode.HANDOFF, fence, expected=str(shown_id))
        # Due at once for every janitor, should the announcement be missed.
        await self.redis.zadd(self.keys.leases, {lease_member(execution_id, fence): 0})
        await self.redis.xadd(
            self.keys.handoffs,
            {"executionId": execution_id, "fence": fence},
            maxlen=10_000,
            approximate=True,
        )

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
        await self._add(self.keys.leases, lease_member(execution_id, fence))
        # Only while still counted: a renewal racing the run's pause or end must not
        # count it again (the tenant would be refused for a lease).
        await self._watch(keys=[self.keys.running(tenant)], args=["refresh", fence, self.lease_ms])
        return bool(requested == b"1")

    # -- watch lists -----------------------------------------------------------------

    async def _add(
        self, key: str, member: str, after_ms: int | None = None, *, replaces: str = ""
    ) -> None:
        delay = self.lease_ms if after_ms is None else after_ms
        await self._watch(keys=[key], args=["add", member, delay, replaces])

    @translated
    async def hold(self, execution_id: str, fence: str) -> None:
        """Watch the lease of ``fence``'s ownership (before the claim that creates it)."""
        await self._add(self.keys.leases, lease_member(execution_id, fence))

    @translated
    async def release(self, execution_id: str, fence: str) -> None:
        """Stop watching ``fence``'s lease: its run stored its last event, or was fenced."""
        await self.redis.zrem(self.keys.leases, lease_member(execution_id, fence))

    @translated
    async def due_leases(self, *, limit: int = 100) -> list[tuple[str, str]]:
        """(execution id, fence) of the leases that ended, on Redis's clock."""
        found = await self._watch(keys=[self.keys.leases], args=["due", limit])
        return [parse_member(member) for member in found]

    @translated
    async def due_deadlines(self, *, limit: int = 100) -> list[str]:
        """Paused executions whose approval deadline passed, on Redis's clock."""
        found = await self._watch(keys=[self.keys.deadlines], args=["due", limit])
        return [member.decode() for member in found]

    @translated
    async def watch_deadline(self, execution_id: str, deadline_ms: int) -> None:
        """List a pause under its approval deadline (Redis time, ms), for the janitors."""
        await self.redis.zadd(self.keys.deadlines, {execution_id: deadline_ms})

    @translated
    async def forget_lease(self, execution_id: str, fence: str) -> None:
        await self.redis.zrem(self.keys.leases, lease_member(execution_id, fence))

    @translated
    async def forget_deadline(self, execution_id: str) -> None:
        await self.redis.zrem(self.keys.deadlines, execution_id)

    @translated
    async def store(self) -> Store:
        """Which Redis server answers, and how long ownership must still wait after its
        data changed servers (store.lua)."""
        info: Any = await self.redis.info("server")
        nodes = [info] if "run_id" in info else list(info.values())
        identity = ",".join(sorted(str(node.get("run_id", "")) for node in nodes))
        settle_ms = int(self.settle_seconds * 1000)
        remaining = await self._store(keys=[self.keys.store], args=[identity, settle_ms])
        return Store(identity, int(remaining) / 1000)

    async def check_settled(self) -> None:
        """Wait out the rest of a settle before moving ownership; BufferUnavailable only
        if it lasts past the settle and a grace (the store keeps changing servers).

        Data that now answers from another server (a restart, a replica promoted) may
        have forgotten recent transitions; until every process had a chance to
        re-assert what it knows (``settle_seconds``), a claim could hand out ids that
        clients already saw. The wait is short, so a request waits, not the client.
        """
        deadline = time.monotonic() + self.settle_seconds + SETTLE_GRACE_SECONDS
        while (remaining := (await self.store()).settling_seconds) > 0:
            if time.monotonic() + remaining > deadline:
                raise BufferUnavailable(
                    "the event store restarted just now and is still being checked; "
                    "try again in a second"
                )
            await asyncio.sleep(remaining)

    @translated
    async def leases_of(self, nodes: tuple[str, ...]) -> list[tuple[str, str]]:
        """(execution id, fence) of every lease held by the processes ``nodes``."""
        found: list[tuple[str, str]] = []
        for node in nodes:
            async for member, _score in self.redis.zscan_iter(
                self.keys.leases, match=f"* {node}:*"
            ):
                found.append(parse_member(member))
        return found

    @translated
    async def now_ms(self) -> int:
        """Redis's clock, in milliseconds since the epoch."""
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # -- admission -------------------------------------------------------------------

    @translated
    async def admit(self, tenant: str, fence: str, *, limit: int, replaces: str = "") -> bool:
        """Count an ownership among its tenant's unfinished executions, if under ``limit``
        (``replaces``, e.g. the pause it resumes, does not count)."""
        admitted = await self._admit(
            keys=[self.keys.running(tenant)],
            args=[fence, self.lease_ms, limit, replaces, COUNTED_LEASES * self.lease_ms],
        )
        return bool(admitted)

    @translated
    async def count_paused(self, tenant: str, execution_id: str, fence: str) -> None:
        """Count a paused execution among its tenant's unfinished ones in place of the
        ownership ``fence`` that paused it, in one step (so it never counts twice). It
        holds no lease; its entry lasts as long as its keys would."""
        after_ms = self.buffer.active_ttl_seconds * 1000
        member = paused_member(execution_id)
        await self._add(self.keys.running(tenant), member, after_ms, replaces=fence)

    @translated
    async def count(self, tenant: str, fence: str) -> None:
        """Count an ownership among its tenant's unfinished executions, past any cap (it
        took over an execution that was counted already)."""
        await self._add(self.keys.running(tenant), fence)

    @translated
    async def leave(self, tenant: str, *members: str) -> None:
        """The ownership ``fence`` stopped running (finished, paused or moved on); also
        any other member given (a pause's entry), in the same command."""
        await self.redis.zrem(self.keys.running(tenant), *members)

    # -- run state -------------------------------------------------------------------

    @translated
    async def save_state(
        self, execution_id: str, fields: dict[str, Any], *, deadline_ms: int | None = None
    ) -> None:
        """Persist what a resume needs (JSON values), with the pause deadline if any."""
        encoded = {name: orjson.dumps(value) for name, value in fields.items()}
        async with self.redis.pipeline(transaction=False) as pipe:
            if encoded:
                pipe.hset(self.keys.state(execution_id), mapping=encoded)  # type: ignore[arg-type]
            pipe.expire(self.keys.state(execution_id), self.buffer.active_ttl_seconds)
            if deadline_ms is not None:
                pipe.hset(self.keys.meta(execution_id), Field.PAUSE_DEADLINE, str(deadline_ms))
            await pipe.execute()

    @translated
    async def load_state(self, execution_id: str) -> dict[str, Any]:
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.state(execution_id)))
        return {name.decode(): orjson.loads(value) for name, value in raw.items()}

    # -- control messages ------------------------------------------------------------

    @translated
    async def send_cancel(self, node: str, execution_id: str) -> None:
        """Ask the process ``node`` to cancel an execution it runs."""
        await self.redis.xadd(
            self.keys.control(node), {"cancel": execution_id}, maxlen=1000, approximate=True
        )

    @translated
    async def control_cursors(self, node: str) -> dict[str, str]:
        """Where ``node`` starts reading its control stream and the hand-offs: after
        the newest message of each."""
        cursors = {}
        for key in (self.keys.control(node), self.keys.handoffs):
            entries: Any = await self.redis.xrevrange(key, count=1)
            cursors[key] = entries[0][0].decode() if entries else "0-0"
        return cursors

    @translated
    async def next_control(
        self, cursors: dict[str, str], *, block_ms: int
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Block for cancels to this node and hand-offs after ``cursors`` (advanced in
        place): (execution ids to cancel, (execution id, fence) handed off)."""
        streams: Any = cursors
        reply: Any = await self.buffer.tail_redis.xread(streams, count=100, block=block_ms)
        cancels: list[str] = []
        handed: list[tuple[str, str]] = []
        for stream, entries in reply or []:
            key = stream.decode()
            cursors[key] = entries[-1][0].decode()
            for _, fields in entries:
                if key == self.keys.handoffs:
                    handed.append((fields[b"executionId"].decode(), fields[b"fence"].decode()))
                elif b"cancel" in fields:
                    cancels.append(fields[b"cancel"].decode())
        return cancels, handed

    @translated
    async def wake_control(self, node: str) -> None:
        """End ``node``'s blocking control read now (it is stopping)."""
        await self.redis.xadd(self.keys.control(node), {"wake": "1"}, maxlen=1000, approximate=True)
