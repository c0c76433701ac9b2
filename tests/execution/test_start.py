"""The start transition as the runner asks it (``Ownership.start``): the admission, the
lease entry, the listing and the workflow version go in one round trip before
start.lua, which reserves the first id (step 15, the event path's latency: a first
frame waited for five round trips one after another)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from lib.backend import Batch
from lib.errors import BufferUnavailable, TooBusy
from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.ownership import START_RESERVED, Ownership
from lib.execution.watchlists import lease_member
from tests.support.ownership import ownership_parts

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def buffer(redis: Redis) -> EventBuffer:
    return EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")


async def start(ownership: Ownership, fence: str, **options: Any) -> str | None:
    execution_id = f"ex_{uuid.uuid4().hex}"
    claim = await ownership.start(
        execution_id,
        fence=fence,
        workflow_id="wf",
        tenant="t",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
        **options,
    )
    return execution_id if claim is not None else None


async def test_a_start_is_admitted_watched_listed_and_reserves_its_first_id(
    buffer: EventBuffer, redis: Redis
) -> None:
    ownership = ownership_parts(buffer, 15).ownership
    stored: list[object] = []
    execution_id = await start(
        ownership,
        "node-a:1",
        alongside=lambda batch: batch.call("SET", f"{buffer.prefix}:x", "v", then=stored.append),
    )
    assert execution_id is not None
    keys = buffer.keys
    assert await redis.zscore(keys.running("t"), "node-a:1") is not None
    assert await redis.zscore(keys.leases, lease_member(execution_id, "node-a:1")) is not None
    assert await redis.zscore(keys.index("t"), execution_id) == 1
    assert stored == [True] and await redis.get(f"{buffer.prefix}:x") == b"v"
    meta = await redis.hmget(keys.meta(execution_id), "reserved", "lastId")
    assert meta == [str(START_RESERVED).encode(), b"0"]


async def test_a_start_refused_by_its_tenants_cap_takes_its_lease_entry_back(
    buffer: EventBuffer, redis: Redis
) -> None:
    parts = ownership_parts(buffer, 15)
    capped = Admission(buffer=buffer, lease_seconds=15, limit=1)
    ownership = Ownership(
        buffer=buffer,
        lease_seconds=15,
        watch=parts.watch,
        admission=capped,
        control=parts.control,
    )
    assert await start(ownership, "node-a:1") is not None
    with pytest.raises(TooBusy):
        await start(ownership, "node-a:2")
    assert await redis.zrange(buffer.keys.running("t"), 0, -1) == [b"node-a:1"]
    leases = await redis.zrange(buffer.keys.leases, 0, -1)
    assert len(leases) == 1 and leases[0].endswith(b"node-a:1")


async def test_a_batch_loads_the_scripts_a_restarted_store_forgot(
    buffer: EventBuffer, redis: Redis
) -> None:
    ownership = ownership_parts(buffer, 15).ownership
    await redis.script_flush()
    assert await start(ownership, "node-a:1") is not None
    # A batch whose command the server refuses raises it, as BufferUnavailable.
    batch = Batch(redis)
    batch.call("INCR", f"{buffer.prefix}:not-a-number-{uuid.uuid4().hex}")
    batch.call("HSET", buffer.keys.index("t"), "a", "b")  # a sorted set: WRONGTYPE
    with pytest.raises(BufferUnavailable):
        await batch.send()
