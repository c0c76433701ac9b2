"""The queue: one admission for every tenant's work, and a fair line for what waits
(SPEC §14).

An ``execute`` enters here (``enter``): it runs at once when nothing waits anywhere, the
tenant runs fewer than its running cap and the accepting process has a free worker
slot; else it is queued; past the tenant's cap of unfinished executions it is refused.
A worker with a free slot ``take``s the next execution: among the tenants that wait and
run fewer than their cap, the one with the least service for its weight (start-time
fair queuing: each tenant's virtual time grows by 1/weight per execution served, and a
tenant that starts waiting again begins at the clock, with no credit for its idle time).

Taking is a hint, the claim is the truth: a worker that took an execution then claims
it (claim.lua "take", queued -> running). A claim refused (a cancel won, or another
worker claimed it) drops the delivery. Each delivery stays in ``taken`` until its claim
answered; a taker dead before that is presumed so after a lease, and a janitor
revokes that taker's claim and queues the execution again if it is still queued
(``stale``, ownership.py ``revoke``, ``requeue``).

Redis keeps, for the queue, only what waits: a tenant's line while it has one, the
tenants waiting, the deliveries in flight, the clock and the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from lib.backend import Batch, register, translated
from lib.errors import TooBusy

# How many leases a dead owner's run goes on counting for its tenant (admission.py).
from lib.execution.admission import COUNTED_LEASES
from lib.execution.buffer import EventBuffer
from lib.execution.record import Asked, Script, refused

# Candidate tenants one take looks at (in virtual-time order): the first that may run
# one is served; more are read only while all of these are at their running cap.
CANDIDATES = 16
# A continuation (a resume, a recovery) is queued ahead of every start of its tenant.
CONTINUATION_OFFSET_MS = 10**13
# Tenants' lines counted per round trip by ``backlog``.
BACKLOG_PAGE = 500


@dataclass(frozen=True)
class Entered:
    """How an ``execute`` was admitted: running at once, or queued with ``ahead``."""

    queued: bool
    ahead: int = 0


@dataclass(frozen=True)
class Backlog:
    """What waits in every tenant's line: how many executions, and when the oldest at
    the head of a line was queued (ms since the epoch; None when nothing waits)."""

    queued: int
    oldest_ms: int | None


@dataclass(frozen=True)
class Taken:
    """An execution a worker took from the queue, to claim."""

    execution_id: str
    tenant: str
    # Its score in its line: when it was queued (Redis's clock), less
    # CONTINUATION_OFFSET_MS for a continuation.
    queued_ms: int
    member: str  # its delivery, in ``taken``: "<eid> <taker's fence> <score> <tenant>"

    @property
    def fence(self) -> str:
        """The fencing token its taker admitted (and claims with)."""
        return self.member.split(" ", 3)[1]


class Queue:
    """The admission and the fair queue, on the buffer's Redis (queue.lua)."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        lease_seconds: float,
        max_unfinished: int = 0,
        max_running: int = 0,
        weights: dict[str, float] | None = None,
    ) -> None:
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.lease_ms = int(lease_seconds * 1000)
        self.grace_ms = COUNTED_LEASES * self.lease_ms
        self.max_unfinished = max_unfinished
        self.max_running = max_running
        self.weights = dict(weights or {})
        self._retry_after = max(1, round(lease_seconds / 3))
        self._script = register(self.redis, __package__, "queue.lua")

    @translated
    async def publish_weights(self) -> None:
        """Write this process's ``FLOWCAST_TENANT_WEIGHTS`` where every taker reads them,
        in place of the map found there (every process should be given the same map): a
        weight taken out of the settings went on counting, in Redis, for good."""
        fields = await self.redis.hkeys(self.keys.fair)
        named = {f"w:{tenant}".encode() for tenant in self.weights}
        stale = [
            field
            for field in (f if isinstance(f, bytes) else f.encode() for f in fields)
            if field.startswith(b"w:") and field not in named
        ]
        if self.weights:
            await self.redis.hset(
                self.keys.fair, mapping={f"w:{t}": str(w) for t, w in self.weights.items()}
            )
        if stale:
            await self.redis.hdel(self.keys.fair, *stale)

    def enter_in(
        self, batch: Batch, tenant: str, execution_id: str, fence: str, *, here: bool
    ) -> list[Entered]:
        """``enter`` as one command of ``batch``: the answer lands in the list returned
        (``TooBusy`` is raised by the batch when the tenant has its limit)."""
        answers: list[Entered] = []
        keys = [*self._tenant_keys(tenant), self.keys.waiting, self.keys.fair]
        args = [
            "enter",
            execution_id,
            fence,
            self.lease_ms,
            self.grace_ms,
            self.max_unfinished,
            self.max_running,
            "1" if here else "0",
            tenant,
        ]

        def then(reply: Any) -> None:
            if int(reply[0]) == 0:
                retry = int(reply[1]) if len(reply) > 1 else self._retry_after
                raise TooBusy(
                    f"this tenant already has {self.max_unfinished} unfinished executions"
                    f" (queued, running or paused); at its recent pace one ends in about"
                    f" {retry} s",
                    retry_after=retry,
                )
            answers.append(Entered(int(reply[0]) == 2, int(reply[1]) if len(reply) > 1 else 0))

        batch.script(self._script, keys, args, then=then)
        return answers

    @translated
    async def take(self, fence: str) -> Taken | None:
        """Take the next execution for a worker whose new run will be ``fence``: fairly
        among the tenants that wait; None when none of them may run one now."""
        offset = 0
        while True:
            first: Any = await self.redis.zrange(self.keys.waiting, offset, offset + CANDIDATES - 1)
            tenants = [t.decode() for t in first]
            if not tenants:
                return None
            keys = [self.keys.waiting, self.keys.fair, self.keys.taken]
            for tenant in tenants:
                keys += self._tenant_keys(tenant)
            args = ["take", fence, self.lease_ms, self.grace_ms, self.max_running, 1, *tenants]
            reply = await self._call(keys, args)
            if reply:
                eid, tenant, score, member = reply
                return Taken(eid.decode(), tenant.decode(), int(float(score)), member.decode())
            if len(tenants) < CANDIDATES:
                return None
            offset += CANDIDATES

    @translated
    async def room(self, tenant: str, fence: str) -> bool:
        """Admit a continuation (a resume) as the ownership ``fence`` when its tenant
        runs fewer than its cap; False (nothing written) when it must wait in line."""
        args = ["room", fence, self.lease_ms, self.grace_ms, self.max_running]
        return bool(await self._call([self.keys.running(tenant)], args))

    @translated
    async def line(self, tenant: str, execution_id: str, *, replaces: str = "") -> int:
        """Queue a continuation ahead of its tenant's starts; returns its ``ahead``.
        ``replaces``: what counted it until now (its pause's entry)."""
        keys = [*self._tenant_keys(tenant), self.keys.waiting, self.keys.fair]
        return int(await self._call(keys, ["line", execution_id, tenant, replaces]))

    @translated
    async def again(self, tenant: str, execution_id: str, *, score: int) -> bool:
        """Put a queued execution back in line if no line holds it (the reconciler)."""
        keys = [self.keys.queued(tenant), self.keys.waiting, self.keys.fair]
        return bool(await self._call(keys, ["again", execution_id, tenant, score]))

    @translated
    async def claimed(self, taken: Taken) -> None:
        """The delivery ``taken`` is over: its claim answered (won or refused)."""
        await self._call([self.keys.taken], ["claimed", taken.member])

    @translated
    async def stale(self, limit: int = 100) -> list[Taken]:
        """Deliveries whose taker is presumed dead (it never claimed them)."""
        members = await self._call([self.keys.taken], ["stale", limit])
        found = []
        for raw in members:
            member = raw.decode()
            eid, _fence, score, tenant = member.split(" ", 3)
            found.append(Taken(eid, tenant, int(float(score)), member))
        return found

    @translated
    async def requeue(self, taken: Taken) -> bool:
        """Queue a delivery whose taker died again, at its place (its score), once,
        whoever asks first."""
        keys = [*self._tenant_keys(taken.tenant), self.keys.waiting, self.keys.fair]
        keys.append(self.keys.taken)
        args = [
            "requeue",
            taken.execution_id,
            taken.fence,
            taken.member,
            taken.queued_ms,
            taken.tenant,
        ]
        return bool(await self._call(keys, args))

    @translated
    async def dequeue(self, tenant: str, execution_id: str) -> None:
        """Take a queued execution out of its tenant's line (it was cancelled)."""
        keys = [self.keys.queued(tenant), self.keys.waiting]
        await self._call(keys, ["dequeue", execution_id, tenant])

    @translated
    async def ahead(self, tenant: str, execution_id: str) -> int | None:
        """About how many executions start before this queued one; None when it is not
        queued (any more)."""
        keys = [self.keys.queued(tenant), self.keys.waiting]
        ahead = int(await self._call(keys, ["ahead", execution_id, tenant]))
        return None if ahead < 0 else ahead

    @translated
    async def backlog(self) -> Backlog:
        """Every tenant's line, counted (for /metrics, read when scraped): a page of
        tenants per round trip, so the cost grows with the tenants waiting, never with
        the executions ever run."""
        queued, oldest, offset = 0, None, 0
        while True:
            page: Any = await self.redis.zrange(
                self.keys.waiting, offset, offset + BACKLOG_PAGE - 1
            )
            if not page:
                return Backlog(queued, oldest)
            async with self.redis.pipeline(transaction=False) as pipe:
                for raw in page:
                    line = self.keys.queued(raw.decode())
                    pipe.zcard(line)
                    pipe.zrange(line, 0, 0, withscores=True)
                replies = await pipe.execute()
            for count, head in zip(replies[::2], replies[1::2], strict=True):
                queued += int(count)
                if head:
                    score = int(head[0][1])
                    # A continuation scores below every start of its line.
                    at = score + CONTINUATION_OFFSET_MS if score < 0 else score
                    oldest = at if oldest is None else min(oldest, at)
            if len(page) < BACKLOG_PAGE:
                return Backlog(queued, oldest)
            offset += BACKLOG_PAGE

    @translated
    async def waiting(self) -> int:
        """How many tenants have queued work."""
        return int(await self.redis.zcard(self.keys.waiting))

    def _tenant_keys(self, tenant: str) -> list[str]:
        return [self.keys.running(tenant), self.keys.queued(tenant)]

    async def _call(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._script(keys=keys, args=args)
        except ResponseError as exc:
            raise refused(Script.QUEUE, exc, Asked(str(args[0]))) from None
