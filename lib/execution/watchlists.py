"""The two watch lists the janitors read, on Redis's clock (watch.lua).

``leases`` holds one member ``"<eid> <fence>"`` per running ownership, scored by lease
end, so the cleanup of one run can never remove the entry of the next; ``deadlines``
holds paused executions by approval deadline (Redis time, ms). A lease entry is written
before the claim that needs it (ownership.py), so an execution is never running
without a watched lease.
"""

from __future__ import annotations

from lib.backend import Batch, register, translated
from lib.execution.buffer import EventBuffer


def lease_member(execution_id: str, fence: str) -> str:
    return f"{execution_id} {fence}"


def parse_member(member: bytes | str) -> tuple[str, str]:
    text = member.decode() if isinstance(member, bytes) else member
    execution_id, _, fence = text.partition(" ")
    return execution_id, fence


class WatchLists:
    """The lease and deadline watch lists, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float) -> None:
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.lease_ms = int(lease_seconds * 1000)
        self._watch = register(self.redis, __package__, "watch.lua")

    @translated
    async def hold(self, execution_id: str, fence: str) -> None:
        """Watch the lease of ``fence``'s ownership for a lease from now (before the
        claim that creates it, and at each renewal)."""
        member = lease_member(execution_id, fence)
        await self._watch(keys=[self.keys.leases], args=["add", member, self.lease_ms, ""])

    def hold_in(self, batch: Batch, execution_id: str, fence: str) -> None:
        """``hold`` as one command of ``batch``."""
        member = lease_member(execution_id, fence)
        batch.script(self._watch, [self.keys.leases], ["add", member, self.lease_ms, ""])

    @translated
    async def due_now(self, execution_id: str, fence: str) -> None:
        """Make ``fence``'s lease due at once for every janitor (it was handed off)."""
        await self.redis.zadd(self.keys.leases, {lease_member(execution_id, fence): 0})

    @translated
    async def release(self, execution_id: str, fence: str) -> None:
        """Stop watching ``fence``'s lease: its run stored its last event, was fenced,
        or the execution was taken over (the new owner's entry watches it)."""
        await self.redis.zrem(self.keys.leases, lease_member(execution_id, fence))

    def release_in(self, batch: Batch, execution_id: str, fence: str) -> None:
        """``release`` as one command of ``batch``."""
        batch.call("ZREM", self.keys.leases, lease_member(execution_id, fence))

    @translated
    async def due_leases(self, *, limit: int = 100) -> list[tuple[str, str]]:
        """(execution id, fence) of the leases that ended, on Redis's clock."""
        found = await self._watch(keys=[self.keys.leases], args=["due", limit])
        return [parse_member(member) for member in found]

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
    async def watch_deadline(
        self, execution_id: str, deadline_ms: int, *, not_within_ms: int = 0
    ) -> None:
        """List a pause under its approval deadline (Redis time, ms), for the janitors;
        with ``not_within_ms``, no sooner than that long from now (watch.lua "at")."""
        if not_within_ms <= 0:
            await self.redis.zadd(self.keys.deadlines, {execution_id: deadline_ms})
            return
        await self._watch(
            keys=[self.keys.deadlines], args=["at", execution_id, deadline_ms, not_within_ms]
        )

    @translated
    async def due_deadlines(self, *, limit: int = 100, ahead_ms: int = 0) -> list[str]:
        """Paused executions whose approval deadline passed (or passes within
        ``ahead_ms``), on Redis's clock, soonest first."""
        found = await self._watch(keys=[self.keys.deadlines], args=["due", limit, ahead_ms])
        return [member.decode() for member in found]

    @translated
    async def forget_deadline(self, execution_id: str) -> None:
        await self.redis.zrem(self.keys.deadlines, execution_id)

    @translated
    async def now_ms(self) -> int:
        """Redis's clock, in milliseconds since the epoch (the lists' scores)."""
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000
