"""Who owns an execution, as one state machine: every transition is one Lua call.

    state      transition  script      to        who may
    ---------  ----------  ----------  --------  ---------------------------------------
    (none)     start       start.lua   running   the process that accepted the execute
    running    pause       append.lua  paused    the owner, storing execution:paused
    running    complete    append.lua  terminal  the owner, storing the terminal event
    paused     resume      claim.lua   running   any process, for a valid answer (once)
    paused     cancel      claim.lua   running   any process; it then writes the cancel
    running    cancel      claim.lua   running   any process: flags cancelRequested; the
                                                 owner's next final event becomes the cancel
    paused     expire      claim.lua   running   any janitor, past the approval deadline
    running    take over   claim.lua   running   any janitor, past the owner's lease, or
                                                 any process once the owner handed it off;
                                                 the new owner recovers the run
    running    hand off    claim.lua   running   the owner, shutting down: no owner, for
                                                 another process to take over at once

A claim gives the caller a new fencing token and epoch: append.lua refuses any other
writer, so a stalled old owner can never append after it. An owner whose epoch is above
the stored one is the owner a store restored from an older snapshot forgot; it takes
its execution back. Leases and deadlines are on Redis's clock (``TIME``).

Two watch lists tell the janitors what to look at: ``leases`` holds one member
``"<eid> <fence>"`` per running ownership, scored by lease end, so the cleanup of one
run can never remove the entry of the next; ``deadlines`` holds paused executions by
approval deadline. The lease entry is written before the claim that needs it, so an
execution is never running without a watched lease. A cancel for an execution owned by
another process is also a message on that process's control stream, and a hand-off is
announced on the ``handoffs`` stream that every process reads.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.exceptions import ResponseError

from lib.backend import load_script, translated
from lib.errors import BufferUnavailable, Conflict, NotFound
from lib.execution.buffer import EventBuffer

# How many leases a dead owner's run goes on counting for its tenant, waiting for a
# janitor to take it over (admit.lua).
COUNTED_LEASES = 10


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
    status_before: str
    owner: str
    epoch: int
    recovery: int = 0  # a takeover: which recovery of the execution this is (1, 2, …)
    reason: str = ""  # a takeover: "handoff" or "worker_lost"
    crashes: int = 0  # a takeover: recoveries for "worker_lost" so far, this one included


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
        self.settle_seconds = 2 * lease_seconds
        package = __package__
        self._claim = self.redis.register_script(load_script(package, "claim.lua"))
        self._renew = self.redis.register_script(load_script(package, "renew.lua"))
        self._admit = self.redis.register_script(load_script(package, "admit.lua"))
        self._watch = self.redis.register_script(load_script(package, "watch.lua"))
        self._store = self.redis.register_script(load_script(package, "store.lua"))

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
        return Claim(0, 0, "", fence, 1)

    @translated
    async def claim(
        self,
        execution_id: str,
        mode: str,
        fence: str,
        *,
        block_id: str = "",
        expected: str = "",
        handoff_only: bool = False,
        answer: bytes = b"",
    ) -> Claim:
        """Win a transition (see claim.lua); Conflict with the status that won otherwise.

        A resume's ``answer`` (JSON) is checkpointed with the claim: the 202 holds if
        this process dies before its resumed event is stored.
        """
        argument = block_id if mode == "resume" else expected
        try:
            last, base, status, owner, epoch, recovery, reason, crashes = await self._claim(
                keys=[self.keys.meta(execution_id), self.keys.state(execution_id)],
                args=[
                    mode,
                    fence,
                    self.lease_ms,
                    argument,
                    "handoff" if handoff_only else "",
                    answer,
                ],
            )
        except ResponseError as exc:
            reason, _, detail = str(exc).partition(" ")
            if reason == "NOEXEC":
                raise NotFound("execution", execution_id) from None
            if reason == "BLOCK":
                raise Conflict(
                    "not_paused_there",
                    f"the execution is paused at {detail!r}, not at {block_id!r}",
                    status="paused",
                    pausedAt=detail,
                ) from None
            if reason == "STATUS":
                raise Conflict(
                    f"execution_{detail}", f"the execution is {detail}", status=detail
                ) from None
            raise Conflict(reason.lower(), str(exc)) from None
        return Claim(
            int(last),
            int(base),
            status.decode(),
            owner.decode(),
            int(epoch),
            int(recovery),
            reason.decode(),
            int(crashes),
        )

    @translated
    async def hand_off(self, execution_id: str, fence: str) -> None:
        """Let go of a running execution now (a shutdown) and announce it, so another
        process takes it over at once. Conflict when ``fence`` no longer owns it."""
        await self.claim(execution_id, "handoff", fence)
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

        Conflict("fenced") when another owner holds it; NotFound when the store lost it
        (the owner's writer then recreates it).
        """
        try:
            requested, _until = await self._renew(
                keys=[self.keys.meta(execution_id)], args=[fence, epoch, self.lease_ms, stored_id]
            )
        except ResponseError as exc:
            if str(exc).startswith(("GONE", "BEHIND")):
                # Lost by the store, whole or in part: the owner's writer repairs it.
                raise NotFound("execution", execution_id) from None
            if str(exc).startswith("FENCED"):
                raise Conflict("fenced", f"this process no longer owns {execution_id}") from None
            # Any other refusal (OOM at maxmemory, READONLY, MISCONF) is the store's
            # trouble, not a new owner: an outage (BufferUnavailable), renewed again later.
            raise
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
        """Refuse to move ownership (BufferUnavailable) while the store settles.

        Data that now answers from another server (a restart, a replica promoted) may
        have forgotten recent transitions; until every process had a chance to
        re-assert what it knows (two leases), a claim could hand out ids that clients
        already saw.
        """
        if (await self.store()).settling_seconds > 0:
            raise BufferUnavailable(
                "the buffer restarted moments ago; ownership moves again shortly"
            )

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
                pipe.hset(self.keys.meta(execution_id), "pauseDeadline", str(deadline_ms))
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
