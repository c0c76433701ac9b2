"""The Redis replay buffer on a real Valkey server: append, order, fencing, ring bounds."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from lib.errors import NotFound, WriteRefused
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event


def make_events(execution_id: str, first: int, count: int, *, size: int = 10) -> list[Event]:
    return [
        Event(
            id=i,
            type="execution:started" if i == 1 else "block:chunk",
            execution_id=execution_id,
            workflow_id="wf",
            data={"blockId": "b", "text": "x" * size},
        )
        for i in range(first, first + count)
    ]


@pytest.fixture
async def buffer(redis: Redis) -> AsyncIterator[EventBuffer]:
    yield EventBuffer(
        redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}", event_limit=50, budget_bytes=20_000
    )


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


async def test_creating_an_existing_execution_again_writes_nothing(
    buffer: EventBuffer, redis: Redis
) -> None:
    """An id named in advance (an Idempotency-Key's record) may be created by two
    requests at once: the second is told so (start.lua answers 0) and changes nothing.
    Found by the step 15 fault review (F2)."""
    execution_id = await create(buffer, owner="owner-1")
    await buffer.append(execution_id, make_events(execution_id, 1, 2), fence="owner-1")
    before = await redis.hgetall(buffer.keys.meta(execution_id))
    listed = await redis.zscore(buffer.keys.index("t"), execution_id)
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(f"{buffer.prefix}:status")
        await pubsub.get_message(timeout=1)  # the subscribe confirmation
        again = await buffer.create(
            execution_id,
            workflow_id="other",
            tenant="t",
            owner="owner-2",
            created_at="2026-01-02T00:00:00.000Z",
            created_ms=2,
            state={"input": b"{}"},
        )
        assert again is False
        assert await pubsub.get_message(timeout=0.2) is None
    assert await redis.hgetall(buffer.keys.meta(execution_id)) == before
    assert not await redis.exists(buffer.keys.state(execution_id))
    assert await redis.zscore(buffer.keys.index("t"), execution_id) == listed


@pytest.mark.timeout(10)
async def test_a_record_and_its_run_state_are_read_together(buffer: EventBuffer) -> None:
    """What a worker reads of an execution it took (issue 25: one round trip, not two):
    the record and the run state as start.lua wrote them; NotFound before it exists."""
    execution_id = f"ex_{uuid.uuid4().hex}"
    with pytest.raises(NotFound):
        await buffer.meta_and_state(execution_id)
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner="",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
        state={"input": b'{"v": 1}', "workflow": b'{"v": "abc"}'},
    )
    meta, state = await buffer.meta_and_state(execution_id)
    assert (meta.id, meta.workflow_id, meta.tenant) == (execution_id, "wf", "t")
    assert state == {b"input": b'{"v": 1}', b"workflow": b'{"v": "abc"}'}


async def test_append_stores_contiguous_batches_and_updates_metadata(buffer: EventBuffer) -> None:
    execution_id = await create(buffer)
    await buffer.append(execution_id, make_events(execution_id, 1, 3), fence="owner-1")
    result = await buffer.append(
        execution_id, make_events(execution_id, 4, 2), fence="owner-1", meta={"status": "completed"}
    )
    assert result.last_id == 5 and result.first_id == 1 and result.retained_count == 5
    page = await buffer.read(execution_id, after=0, limit=100)
    assert [event.id for event in page.events] == [1, 2, 3, 4, 5]
    assert page.meta.status == "completed"
    assert page.meta.last_id == 5
    assert page.events[0].data["text"] == "x" * 10
    assert (await buffer.read(execution_id, after=3, limit=1)).events[0].id == 4


async def test_append_refuses_a_batch_that_does_not_follow_the_last_id(buffer: EventBuffer) -> None:
    execution_id = await create(buffer)
    await buffer.append(execution_id, make_events(execution_id, 1, 2), fence="owner-1")
    for first in (2, 4):
        with pytest.raises(WriteRefused) as refused:
            await buffer.append(execution_id, make_events(execution_id, first, 1), fence="owner-1")
        assert refused.value.reason == "order" and refused.value.last_id == 2
    assert (await buffer.meta(execution_id)).last_id == 2


async def test_append_refuses_a_writer_that_is_not_the_owner(buffer: EventBuffer) -> None:
    execution_id = await create(buffer, owner="owner-1")
    with pytest.raises(WriteRefused) as refused:
        await buffer.append(execution_id, make_events(execution_id, 1, 1), fence="intruder")
    assert refused.value.reason == "fenced"
    assert (await buffer.read(execution_id, after=0, limit=10)).events == []


async def test_append_to_an_unknown_execution_is_refused(buffer: EventBuffer) -> None:
    with pytest.raises(WriteRefused) as refused:
        await buffer.append("ex_missing", make_events("ex_missing", 1, 1), fence="x")
    assert refused.value.reason == "gone"
    with pytest.raises(NotFound):
        await buffer.meta("ex_missing")


async def test_ring_keeps_the_newest_events_within_the_event_limit(buffer: EventBuffer) -> None:
    execution_id = await create(buffer)
    for first in range(1, 121, 10):
        await buffer.append(execution_id, make_events(execution_id, first, 10), fence="owner-1")
    page = await buffer.read(execution_id, after=0, limit=1000)
    assert [event.id for event in page.events] == list(range(71, 121))
    assert page.meta.first_id == 71 and page.meta.retained_count == 50


async def test_ring_keeps_the_newest_events_within_the_byte_budget(buffer: EventBuffer) -> None:
    execution_id = await create(buffer)
    for first in range(1, 41, 5):
        await buffer.append(
            execution_id, make_events(execution_id, first, 5, size=2_000), fence="owner-1"
        )
    page = await buffer.read(execution_id, after=0, limit=1000)
    assert page.meta.retained_bytes <= 20_000
    assert page.events[-1].id == 40
    assert [event.id for event in page.events] == list(range(page.meta.first_id, 41))
    assert sum(len(event.json) for event in page.events) == page.meta.retained_bytes


async def test_keys_share_one_hash_tag_and_expire_after_retention_once_finished(
    buffer: EventBuffer, redis: Redis
) -> None:
    execution_id = await create(buffer)
    await buffer.append(execution_id, make_events(execution_id, 1, 1), fence="owner-1")
    keys = buffer.keys.execution(execution_id)
    assert all(f"{{{execution_id}}}" in key for key in keys)
    stream_key, meta_key = keys[0], keys[1]
    for key in (stream_key, meta_key):
        assert buffer.retention_seconds < await redis.ttl(key) <= buffer.active_ttl_seconds
    await buffer.append(
        execution_id, make_events(execution_id, 2, 1), fence="owner-1", meta={"status": "completed"}
    )
    for key in (stream_key, meta_key):
        assert 0 < await redis.ttl(key) <= buffer.retention_seconds


async def test_a_batch_after_dropped_ids_records_the_range_atomically(buffer: EventBuffer) -> None:
    execution_id = await create(buffer)
    await buffer.append(execution_id, make_events(execution_id, 1, 3), fence="owner-1")
    with pytest.raises(WriteRefused):
        await buffer.append(execution_id, make_events(execution_id, 8, 2), fence="owner-1")
    await buffer.append(
        execution_id, make_events(execution_id, 8, 2), fence="owner-1", after_drop=True
    )
    page = await buffer.read(execution_id, after=0, limit=100)
    assert [event.id for event in page.events] == [1, 2, 3, 8, 9]
    assert page.dropped == [(4, 7)]
    assert page.gap_reason(3, 8) == "dropped"


async def test_a_hole_above_the_first_retained_id_is_dropped_never_evicted(
    buffer: EventBuffer,
) -> None:
    # The ring only evicts below the first retained id: a hole above it is a drop, even
    # one whose range only the writer knows yet (it is recorded by its next batch).
    execution_id = await create(buffer)
    for first in range(1, 60, 10):
        await buffer.append(execution_id, make_events(execution_id, first, 10), fence="owner-1")
    page = await buffer.read(execution_id, after=0, limit=100)
    assert page.meta.first_id > 1 and page.dropped == []
    assert page.gap_reason(0, page.meta.first_id) == "evicted"
    assert page.gap_reason(page.meta.last_id, page.meta.last_id + 5) == "dropped"


@pytest.mark.timeout(30)
async def test_a_batch_that_writes_back_a_large_checkpoint_is_stored_whole(
    redis: Redis,
) -> None:
    # After the store lost writes, a writer writes its whole checkpoint back with its
    # next batch (log.py: checkpoint=self._mirror): two fields per block run (its
    # attempt and its output), so over 4000 for a workflow of some 2000 blocks.
    # append.lua set them with HSET(unpack(...)), and Lua unpacks at most ~8000 values:
    # the script failed after storing the events and the metadata, so the batch was
    # half applied, the writer took the retry's ORDER for success, and the checkpoint
    # (what a recovery goes on from) was never written back.
    """Found by the step 14 review."""
    from lib.execution.buffer import EventBuffer
    from lib.execution.events import Event

    buffer = EventBuffer(redis=redis, prefix=f"b14c{uuid.uuid4().hex[:6]}")
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner="owner-1",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    checkpoint = {}
    for block in range(2100):
        checkpoint[f"t:b{block}"] = b"1"
        checkpoint[f"o:b{block}"] = b'"done"'
    started = Event(
        id=1,
        type="execution:started",
        execution_id=execution_id,
        workflow_id="wf",
        data={"input": {}},
    )
    await buffer.append(execution_id, [started], fence="owner-1", checkpoint=checkpoint)
    stored = await redis.hlen(buffer.keys.state(execution_id))
    assert stored == len(checkpoint)
