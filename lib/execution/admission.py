"""How many unfinished executions each tenant has, and whether it may have one more.

Each tenant's ``running`` set (admit.lua, watch.lua) holds the fencing token of each
running ownership, scored by lease end, and ``paused:<eid>`` for each paused execution,
scored by when its keys would expire. An ownership is admitted (counted) before the
transition that creates it, refreshed with its lease renewals, and leaves when its run
stops running; one that took over an execution counted already counts past any cap.
"""

from __future__ import annotations

from typing import Any

from lib.backend import Batch, register, translated
from lib.errors import TooBusy
from lib.execution.buffer import EventBuffer

# How many leases a dead owner's run goes on counting for its tenant, waiting for a
# janitor to take it over (admit.lua).
COUNTED_LEASES = 10


def paused_member(execution_id: str) -> str:
    return f"paused:{execution_id}"


class Admission:
    """Counts ownerships per tenant, up to ``limit`` each (0: no limit)."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float, limit: int = 0) -> None:
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.lease_ms = int(lease_seconds * 1000)
        self.limit = limit
        self._paused_ms = buffer.active_ttl_seconds * 1000
        # Tried again after about a third of a lease: a renewal (or a janitor) may
        # have freed a place by then.
        self._retry_after = max(1, round(lease_seconds / 3))
        self._admit = register(self.redis, __package__, "admit.lua")
        self._watch = register(self.redis, __package__, "watch.lua")

    async def admit(self, tenant: str, fence: str, *, replaces: str = "") -> None:
        """Count an ownership among its tenant's unfinished executions, or ``TooBusy``
        when it has ``limit`` already (``replaces``, e.g. the pause it resumes, does not
        count)."""
        self._refuse_unless(await self._admitted(tenant, fence, replaces))

    def admit_in(self, batch: Batch, tenant: str, fence: str) -> None:
        """``admit`` as one command of ``batch`` (its answer raises ``TooBusy``)."""
        args = [fence, self.lease_ms, self.limit, "", COUNTED_LEASES * self.lease_ms]
        keys = [self.keys.running(tenant)]
        batch.script(self._admit, keys, args, then=self._refuse_unless)

    def _refuse_unless(self, admitted: Any) -> None:
        if not admitted:
            raise TooBusy(
                f"this tenant already runs {self.limit} executions; try again shortly",
                retry_after=self._retry_after,
            )

    @translated
    async def _admitted(self, tenant: str, fence: str, replaces: str) -> bool:
        admitted = await self._admit(
            keys=[self.keys.running(tenant)],
            args=[fence, self.lease_ms, self.limit, replaces, COUNTED_LEASES * self.lease_ms],
        )
        return bool(admitted)

    @translated
    async def count(self, tenant: str, fence: str) -> None:
        """Count an ownership among its tenant's unfinished executions, past any cap (it
        took over an execution that was counted already)."""
        await self._add(tenant, fence, self.lease_ms)

    @translated
    async def count_paused(self, tenant: str, execution_id: str, fence: str) -> None:
        """Count a paused execution among its tenant's unfinished ones in place of the
        ownership ``fence`` that paused it, in one step (so it never counts twice). It
        holds no lease; its entry lasts as long as its keys would."""
        await self._add(tenant, paused_member(execution_id), self._paused_ms, replaces=fence)

    @translated
    async def refresh(self, tenant: str, fence: str) -> None:
        """Move the ownership's entry to its new lease end, only while still counted: a
        renewal racing the run's pause or end must not count it again (the tenant would
        be refused for a lease)."""
        await self._watch(keys=[self.keys.running(tenant)], args=["refresh", fence, self.lease_ms])

    @translated
    async def leave(self, tenant: str, *members: str) -> None:
        """The ownership ``fence`` stopped running (finished, paused or moved on); also
        any other member given (a pause's entry), in the same command."""
        await self.redis.zrem(self.keys.running(tenant), *members)

    def leave_in(self, batch: Batch, tenant: str, *members: str) -> None:
        """``leave`` as one command of ``batch``."""
        batch.call("ZREM", self.keys.running(tenant), *members)

    async def _add(self, tenant: str, member: str, after_ms: int, *, replaces: str = "") -> None:
        await self._watch(
            keys=[self.keys.running(tenant)], args=["add", member, after_ms, replaces]
        )
