"""The webhook deliveries owed, durable in Redis (SPEC §15).

How a delivery is never lost: an execution's webhooks are written into its metadata
when it is created (``Field.WEBHOOKS``), and the writer of its events (flush.py) writes
a *hint* ``"<eid> <eventId>"`` into ``owed`` before it sends the batch that stores a
matching or final event. A process that dies right after the event is stored has left
the hint behind it. The hint is only a hint: a delivery process (deliver.py) looks at
the stored event (``materialize``): when it is stored and some webhook wants its type,
the deliveries are owed (a record per webhook in the execution's delivery hash, a
member in its tenant's ``due`` line); when the batch never got stored (another owner
took over, or a cancel replaced a final event under its id) nothing is owed; while the
event may still be stored, the hint is looked at again.

Leases: a delivery being attempted is pushed ahead in its line by the attempt's timeout
and some margin, so if its process dies it is due again then, and attempted again by
whichever delivery process is alive (at least once; the same ``webhook-id``).

Keys all under ``{webhooks}`` (outbox.lua documents them); the delivery states of one
execution are the hash ``fc:{webhooks}:d:<eid>`` (field ``"<eventId>.<n>"``: its JSON
state; ``"b:<eventId>"``: the body sent), kept for the retries' span plus retention.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from lib.backend import register, translated

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


@dataclass(frozen=True)
class Delivery:
    """One delivery: an event of an execution to one of its webhooks (index ``hook``)."""

    tenant: str
    execution_id: str
    event_id: int
    hook: int

    @property
    def member(self) -> str:
        return f"{self.execution_id} {self.event_id} {self.hook}"

    @property
    def field(self) -> str:
        return f"{self.event_id}.{self.hook}"

    @property
    def webhook_id(self) -> str:
        """The Standard Webhooks id: the same on every attempt, for receivers to dedupe."""
        return f"{self.execution_id}.{self.event_id}"

    @classmethod
    def parse(cls, tenant: str, member: str) -> Delivery:
        eid, event_id, hook = member.split(" ")
        return cls(tenant, eid, int(event_id), int(hook))


class OutboxKeys:
    """The names of the outbox's keys under one prefix."""

    def __init__(self, prefix: str) -> None:
        base = f"{prefix}:{{webhooks}}"
        self.owed = f"{base}:owed"
        self.tenants = f"{base}:tenants"
        self.pending = f"{base}:pending"
        self.served = f"{base}:served"
        # Pub/sub, not a key: something may be due sooner (outbox.lua publishes on it;
        # the delivery processes' tails subscribe, lib/execution/tails.py).
        self.wake = f"{base}:wake"
        self._base = base

    def due(self, tenant: str) -> str:
        return f"{self._base}:due:{tenant}"

    def states(self, execution_id: str) -> str:
        return f"{self._base}:d:{execution_id}"


async def hint(redis: Redis, prefix: str, execution_id: str, event_ids: list[int]) -> None:
    """Say that these events of an execution with webhooks may be owed, before storing
    them (the caller translates errors: it is the event writer, which retries)."""
    script = _scripts.get(redis)
    if script is None:
        script = _scripts[redis] = register(redis, __package__, "outbox.lua")
    hints = [f"{execution_id} {event_id}" for event_id in event_ids]
    await script(keys=[OutboxKeys(prefix).owed], args=["hint", HINT_DELAY_MS, *hints])


# The outbox script as registered on each client the event writers use (once per client).
_scripts: weakref.WeakKeyDictionary[Redis, AsyncScript] = weakref.WeakKeyDictionary()
# A hint is first looked at after this: by then the batch it precedes is usually stored
# (one seen too early is looked at again).
HINT_DELAY_MS = 200


class Outbox:
    """The owed deliveries and their states (outbox.lua)."""

    def __init__(self, *, redis: Redis, prefix: str, keep_seconds: int) -> None:
        self.redis = redis
        self.keys = OutboxKeys(prefix)
        self.keep_seconds = keep_seconds
        self._script = register(redis, __package__, "outbox.lua")

    @translated
    async def look(self, lease_ms: int, limit: int = 50) -> list[tuple[str, int]]:
        """Hints due now, leased for ``lease_ms``: (execution id, event id) each."""
        found = await self._script(keys=[self.keys.owed], args=["look", lease_ms, limit])
        hints = []
        for raw in found:
            eid, event_id = raw.decode().split(" ")
            hints.append((eid, int(event_id)))
        return hints

    @translated
    async def owe(
        self,
        tenant: str,
        execution_id: str,
        event_id: int,
        states: dict[int, dict[str, Any]],
        body: bytes,
    ) -> None:
        """Owe the deliveries of one stored event (one per webhook in ``states``) and
        drop its hint; a delivery owed already keeps its state."""
        key = self.keys.states(execution_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, f"b:{event_id}", body)
            for hook, state in states.items():
                pipe.hsetnx(key, f"{event_id}.{hook}", orjson.dumps(state))
            pipe.expire(key, self.keep_seconds)
            await pipe.execute()
        members = [Delivery(tenant, execution_id, event_id, h).member for h in states]
        keys = [self.keys.owed, self.keys.tenants, self.keys.due(tenant), self.keys.pending,
                self.keys.served]  # fmt: skip
        await self._script(keys=keys, args=["owe", f"{execution_id} {event_id}", *members])

    @translated
    async def next_ms(self) -> int:
        """Milliseconds until the earliest hint or delivery is due (0: now), -1: none."""
        found: Any = await self._script(keys=[self.keys.owed, self.keys.tenants], args=["next"])
        return int(found)

    @translated
    async def drop_hint(self, execution_id: str, event_id: int) -> None:
        """Nothing is owed for this hint."""
        await self.redis.zrem(self.keys.owed, f"{execution_id} {event_id}")

    @translated
    async def due_tenants(self, limit: int = 64) -> list[str]:
        """Tenants with a delivery due now, earliest first."""
        now_s, now_us = await self.redis.time()
        now = now_s * 1000 + now_us // 1000
        found: Any = await self.redis.zrangebyscore(self.keys.tenants, "-inf", now, 0, limit)
        return [raw.decode() for raw in found]

    @translated
    async def take(self, tenant: str, lease_ms: int) -> Delivery | None:
        """Lease the tenant's earliest due delivery for ``lease_ms``; None if none is due."""
        keys = [self.keys.tenants, self.keys.due(tenant), self.keys.served]
        member: Any = await self._script(keys=keys, args=["take", lease_ms])
        return Delivery.parse(tenant, member.decode()) if member else None

    @translated
    async def read(self, delivery: Delivery) -> tuple[dict[str, Any], bytes] | None:
        """A delivery's state and body; None when they are gone (expired)."""
        key = self.keys.states(delivery.execution_id)
        state, body = await self.redis.hmget(key, [delivery.field, f"b:{delivery.event_id}"])
        if state is None or body is None:
            return None
        return orjson.loads(state), cast(bytes, body)

    @translated
    async def settle(self, delivery: Delivery, state: dict[str, Any], retry_ms: int | None) -> None:
        """Record an attempt's outcome: over (``retry_ms`` None) or due again then."""
        key = self.keys.states(delivery.execution_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, delivery.field, orjson.dumps(state))
            pipe.expire(key, self.keep_seconds)
            await pipe.execute()
        keys = [self.keys.tenants, self.keys.due(delivery.tenant), self.keys.pending,
                self.keys.served]  # fmt: skip
        delay = "" if retry_ms is None else str(retry_ms)
        await self._script(keys=keys, args=["settle", delivery.member, delay])

    @translated
    async def states(self, execution_id: str) -> list[dict[str, Any]]:
        """Every delivery of an execution, in event order, for its snapshot."""
        raw: Any = await self.redis.hgetall(self.keys.states(execution_id))
        found = []
        for field, value in raw.items():
            name = field.decode()
            if name.startswith("b:"):
                continue
            event_id, hook = name.split(".")
            found.append(((int(event_id), int(hook)), orjson.loads(value)))
        return [state for _, state in sorted(found, key=lambda item: item[0])]

    @translated
    async def oldest_pending_ms(self) -> int | None:
        """When the oldest delivery still pending was owed (ms since the epoch)."""
        head = await self.redis.zrange(self.keys.pending, 0, 0, withscores=True)
        return int(head[0][1]) if head else None
