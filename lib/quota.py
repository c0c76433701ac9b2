"""Each tenant's share of the Redis all tenants use (SPEC §8 "Shares per tenant").

What a tenant keeps in Redis (its workflows, secrets, retained executions and the
workflow versions they run) is counted in a ledger of its own (``quota.lua``): one
figure per thing, each replacing the previous one, and the things that expire
(executions, versions) scored by when they stop counting. A new workflow, secret or
execution is refused (``OverQuota``) before it is written when its figure would take
the tenant's total past the limit; a running execution's figure is always kept (its
events are never refused for the quota).

The ledger lives under the tenant's hash tag ``{t:<tenant>}``, another slot than any
execution's on a cluster: an execution's figure is set by a command of its own after
the batch that changed it (``EventBuffer.append``), never in the same script. A figure
that replaces is safe either way round under a crash: a figure lost between the two
writes is set again by the next one, and a figure left behind stops counting when the
thing it counts expires.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lib.backend import Batch, Keys, register, translated
from lib.errors import OverQuota

if TYPE_CHECKING:
    from redis.asyncio import Redis

# Retry-After when nothing the tenant keeps expires by itself (only deleting helps).
NO_EXPIRY_RETRY_SECONDS = 60
FORGET = -1  # a lifetime that forgets the thing


class Thing(NamedTuple):
    """One thing a tenant keeps: its ledger name, its size, how long it counts (ms from
    now; 0: until set again or forgotten)."""

    member: str
    size: int
    lifetime_ms: int = 0


def execution_member(execution_id: str) -> str:
    return f"e:{execution_id}"


def version_member(digest: str) -> str:
    return f"v:{digest}"


def workflow_member(workflow_id: str) -> str:
    return f"w:{workflow_id}"


def secret_member(name: str) -> str:
    return f"s:{name}"


class StorageQuota:
    """One ledger per tenant of the bytes it keeps in Redis, under ``limit_bytes``
    (0: counted, never refused)."""

    def __init__(self, *, redis: Redis, limit_bytes: int, prefix: str = "fc") -> None:
        self._redis = redis
        self.limit_bytes = limit_bytes
        self._keys = Keys(prefix)
        self._script = register(redis, __package__, "quota.lua")

    def reserve_in(self, batch: Batch, tenant: str, things: Sequence[Thing]) -> None:
        """Set the figures of ``things`` as one command of ``batch``, all or none, refused
        when they would take the tenant past its limit: its answer then raises
        ``OverQuota`` (and nothing was set)."""
        batch.script(
            self._script,
            self._keys.quota(tenant),
            [self.limit_bytes, *_flat(things)],
            then=lambda reply: self._judge(tenant, reply),
        )

    @translated
    async def reserve(self, tenant: str, member: str, size: int, lifetime_ms: int = 0) -> int:
        """Set ``member``'s figure to ``size`` unless that takes the tenant past its
        limit (``OverQuota``, nothing set); its previous figure."""
        reply = await self._call(tenant, self.limit_bytes, [Thing(member, size, lifetime_ms)])
        self._judge(tenant, reply)
        return int(reply[2])

    @translated
    async def record(self, tenant: str, member: str, size: int, lifetime_ms: int = 0) -> None:
        """Set ``member``'s figure to ``size``, whatever the total (what is stored)."""
        await self._call(tenant, 0, [Thing(member, size, lifetime_ms)])

    @translated
    async def forget(self, tenant: str, member: str) -> None:
        """``member`` keeps nothing any more (deleted)."""
        await self._call(tenant, 0, [Thing(member, 0, FORGET)])

    @translated
    async def usage(self, tenant: str) -> int:
        """The bytes the tenant keeps, as counted now."""
        reply = await self._call(tenant, 0, [])
        return int(reply[1])

    async def _call(self, tenant: str, limit: int, things: Sequence[Thing]) -> list[Any]:
        reply: list[Any] = await self._script(
            keys=self._keys.quota(tenant), args=[limit, *_flat(things)]
        )
        return reply

    def _judge(self, tenant: str, reply: list[Any]) -> None:
        if int(reply[0]) == 1:
            return
        total, needed, retry_ms = int(reply[1]), int(reply[2]), int(reply[3])
        retry = math.ceil(retry_ms / 1000) if retry_ms >= 0 else NO_EXPIRY_RETRY_SECONDS
        raise OverQuota(
            tenant, used=total, limit=self.limit_bytes, needed=needed, retry_after=max(1, retry)
        )


def _flat(things: Sequence[Thing]) -> list[Any]:
    return [value for thing in things for value in thing]
