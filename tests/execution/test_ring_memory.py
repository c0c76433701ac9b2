"""The ring's real footprint on Valkey: 50 times the budget goes through one execution,
and the keys' ``MEMORY USAGE`` stays within the budget plus Redis's own overhead."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.flush import EventWriter

BUDGET = 1024 * 1024
# Redis's own bookkeeping on top of the envelope bytes the budget counts: stream nodes
# (listpack headers, entry ids and field names, radix tree), the hash and the key objects.
OVERHEAD_ALLOWANCE = 0.25
OVERHEAD_CONSTANT = 16 * 1024


async def create(buffer: EventBuffer, owner: str = "owner-1") -> str:
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner=owner,
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    return execution_id


def chunk(execution_id: str, event_id: int, size: int) -> Event:
    return Event(
        id=event_id,
        type="execution:started" if event_id == 1 else "block:chunk",
        execution_id=execution_id,
        workflow_id="wf",
        data={"blockId": "b", "text": "x" * size},
    )


async def footprint(redis: Redis, buffer: EventBuffer, execution_id: str) -> int:
    """Bytes Redis holds for the execution's keys, every stream node counted."""
    total = 0
    for key in buffer.keys.execution(execution_id):
        total += int(await redis.memory_usage(key, samples=0) or 0)  # None: no such key
    return total


async def retained(buffer: EventBuffer, execution_id: str) -> list[Event]:
    found: list[Event] = []
    after = 0
    while True:
        page = await buffer.read(execution_id, after=after, limit=1_000)
        found += page.events
        if len(page.events) < 1_000:
            return found
        after = page.events[-1].id


@pytest.fixture
async def buffer(redis: Redis) -> AsyncIterator[EventBuffer]:
    prefix = f"mem{uuid.uuid4().hex[:6]}"
    yield EventBuffer(redis=redis, prefix=prefix, event_limit=10_000, budget_bytes=BUDGET)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_fifty_budgets_through_one_execution_keep_the_footprint_within_the_budget(
    buffer: EventBuffer, redis: Redis
) -> None:
    rng = random.Random(20261129)
    execution_id = await create(buffer)
    sizes: dict[int, int] = {}
    events: list[Event] = []
    total = 0
    while total < 50 * BUDGET:
        # Log-uniform between a few hundred bytes and tens of kilobytes.
        event = chunk(execution_id, len(events) + 1, int(2 ** rng.uniform(8, 15.5)))
        events.append(event)
        sizes[event.id] = len(event.json)
        total += len(event.json)
    limit = BUDGET * (1 + OVERHEAD_ALLOWANCE) + OVERHEAD_CONSTANT
    samples: list[int] = []
    done = asyncio.Event()

    async def sample_while_writing() -> None:
        # Each append is one script, so every sample sees the state between two batches.
        while not done.is_set():
            samples.append(await footprint(redis, buffer, execution_id))
            meta = await buffer.meta(execution_id)
            assert meta.retained_bytes <= BUDGET, meta

    sampler = asyncio.create_task(sample_while_writing())
    try:
        async with EventWriter(buffer=buffer, execution_id=execution_id, fence="owner-1") as writer:
            for event in events:
                writer.put(event)
                if rng.random() < 0.1:
                    await writer.drained()  # batches of varied length, not one huge one
    finally:
        done.set()
        await sampler
    assert writer.stored_id == len(events) and writer.failures == 0

    used = await footprint(redis, buffer, execution_id)
    samples.append(used)
    assert max(samples) <= limit, f"footprint {max(samples)} > {limit:.0f} (budget {BUDGET})"
    meta = await buffer.meta(execution_id)
    assert meta.retained_bytes <= BUDGET
    assert meta.last_id == len(events)

    kept = await retained(buffer, execution_id)
    ids = [event.id for event in kept]
    assert ids == list(range(meta.first_id, meta.last_id + 1)), "not the newest, contiguous"
    assert len(ids) == meta.retained_count
    assert sum(len(event.json) for event in kept) == meta.retained_bytes
    assert [len(event.json) for event in kept] == [sizes[i] for i in ids]
    # Nothing was evicted that would still have fitted.
    assert meta.retained_bytes + sizes[meta.first_id - 1] > BUDGET
    print(
        f"\n{total / BUDGET:.1f} budgets through, {len(events)} events; footprint "
        f"{used} bytes ({used / BUDGET:.3f} x budget), peak sampled {max(samples)} "
        f"over {len(samples)} samples; retained {meta.retained_count} events, "
        f"{meta.retained_bytes} bytes"
    )


async def test_tiny_events_never_keep_more_than_the_event_limit(redis: Redis) -> None:
    event_limit = 500
    buffer = EventBuffer(
        redis=redis,
        prefix=f"lim{uuid.uuid4().hex[:6]}",
        event_limit=event_limit,
        budget_bytes=64 * 1024 * 1024,
    )
    rng = random.Random(7)
    execution_id = await create(buffer)
    next_id = 1
    while next_id <= 20 * event_limit:
        batch = [
            chunk(execution_id, next_id + i, rng.randint(0, 8)) for i in range(rng.randint(1, 300))
        ]
        result = await buffer.append(execution_id, batch, fence="owner-1")
        next_id += len(batch)
        assert result.retained_count <= event_limit
        assert await redis.xlen(buffer.keys.events(execution_id)) == result.retained_count
    meta = await buffer.meta(execution_id)
    assert meta.retained_count == event_limit
    assert meta.last_id == next_id - 1
    assert meta.first_id == meta.last_id - event_limit + 1
    kept = await retained(buffer, execution_id)
    assert [event.id for event in kept] == list(range(meta.first_id, meta.last_id + 1))
    assert sum(len(event.json) for event in kept) == meta.retained_bytes
