"""The fair queue (queue.py, queue.lua) on a real Valkey: tenants that both keep work
queued share the slots by weight, however long one's line is; a tenant at its running
cap is passed over, not waited for; a delivery whose taker died is queued again once;
and nothing is left in Redis once the lines are empty."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from redis.asyncio import Redis

from lib.backend import Batch
from lib.errors import TooBusy
from lib.execution.buffer import EventBuffer
from lib.execution.queue import Entered, Queue


def queue_on(redis: Redis, **options: object) -> Queue:
    buffer = EventBuffer(redis=redis, prefix=f"q{uuid.uuid4().hex[:6]}")
    return Queue(buffer=buffer, lease_seconds=15, **options)  # type: ignore[arg-type]


async def enqueue(queue: Queue, tenant: str, count: int) -> list[str]:
    ids = []
    for n in range(count):
        execution_id = f"ex_{tenant}_{n}"
        batch = Batch(queue.redis)
        answers = queue.enter_in(batch, tenant, execution_id, f"n:{tenant}{n}", here=False)
        await batch.send()
        assert answers == [Entered(True, answers[0].ahead)]
        ids.append(execution_id)
    return ids


@pytest.mark.timeout(30)
async def test_two_backlogged_tenants_take_turns_whatever_their_backlog(redis: Redis) -> None:
    queue = queue_on(redis)
    await enqueue(queue, "flood", 200)
    await enqueue(queue, "light", 10)
    served = [(await queue.take(f"w:{n}")) for n in range(20)]
    tenants = [taken.tenant for taken in served if taken is not None]
    assert Counter(tenants) == {"flood": 10, "light": 10}, tenants
    # Oldest first within a tenant.
    light = [t.execution_id for t in served if t is not None and t.tenant == "light"]
    assert light == [f"ex_light_{n}" for n in range(10)]


@pytest.mark.timeout(30)
async def test_weights_share_the_slots(redis: Redis) -> None:
    queue = queue_on(redis, weights={"gold": 3.0})
    await queue.publish_weights()
    await enqueue(queue, "gold", 60)
    await enqueue(queue, "plain", 60)
    served: Counter[str] = Counter()
    for n in range(40):
        taken = await queue.take(f"w:{n}")
        assert taken is not None
        served[taken.tenant] += 1
    assert served == {"gold": 30, "plain": 10}, served


@pytest.mark.timeout(30)
async def test_a_tenant_at_its_running_cap_is_passed_over(redis: Redis) -> None:
    queue = queue_on(redis, max_running=2)
    await enqueue(queue, "busy", 10)
    await enqueue(queue, "other", 2)
    served = [await queue.take(f"w:{n}") for n in range(5)]
    tenants = [taken.tenant if taken else None for taken in served]
    # busy runs 2 at once at most, with 8 more waiting: other is served beside it.
    assert Counter(tenants) == {"busy": 2, "other": 2, None: 1}, tenants
    assert await queue.take("w:x") is None
    # One of busy's runs ends: its next one may run.
    _eid, fence, _score, _tenant = next(t for t in served if t and t.tenant == "busy").member.split(
        " "
    )
    await redis.zrem(queue.keys.running("busy"), fence)
    again = await queue.take("w:y")
    assert again is not None and again.tenant == "busy"


@pytest.mark.timeout(30)
async def test_the_unfinished_cap_counts_queued_executions(redis: Redis) -> None:
    queue = queue_on(redis, max_unfinished=3)
    await enqueue(queue, "t", 3)
    batch = Batch(redis)
    queue.enter_in(batch, "t", "ex_t_more", "n:more", here=False)
    with pytest.raises(Exception, match="unfinished"):
        await batch.send()
    assert await redis.zcard(queue.keys.queued("t")) == 3


@pytest.mark.timeout(30)
async def test_a_dead_takers_delivery_is_queued_again_once_and_nothing_is_left(
    redis: Redis,
) -> None:
    queue = queue_on(redis)
    [execution_id] = await enqueue(queue, "t", 1)
    taken = await queue.take("w:dead")
    assert taken is not None and await queue.take("w:other") is None
    # The taker died before claiming: past its deadline the delivery is stale.
    await redis.zadd(queue.keys.taken, {taken.member: 0})
    [stale] = await queue.stale()
    assert stale.execution_id == execution_id
    assert await queue.requeue(stale) is True
    assert await queue.requeue(stale) is False  # once, whoever asks first
    assert await queue.ahead("t", execution_id) == 0
    again = await queue.take("w:live")
    assert again is not None and again.execution_id == execution_id
    await queue.claimed(again)
    await redis.zrem(queue.keys.running("t"), "w:live")
    left = [key async for key in redis.scan_iter(match=f"{queue.keys.prefix}:*")]
    assert sorted(k.decode() for k in left) == [queue.keys.fair], left


@pytest.mark.timeout(30)
async def test_a_refusal_says_when_to_retry_from_the_tenants_drain_rate(redis: Redis) -> None:
    queue = queue_on(redis, max_unfinished=10)
    for n in range(10):
        batch = Batch(redis)
        answers = queue.enter_in(batch, "t", f"ex_{n}", f"n:{n}", here=True)
        await batch.send()
        assert answers == [Entered(False)]
    assert await redis.zcard(queue.keys.running("t")) == 10
    batch = Batch(redis)
    queue.enter_in(batch, "t", "ex_more", "n:more", here=True)
    with pytest.raises(TooBusy) as refused:
        await batch.send()
    # Ten runs admitted within the last minute: one ends about every 6 s.
    assert refused.value.retry_after == 6, refused.value
