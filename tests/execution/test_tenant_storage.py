"""What an execution keeps is counted for its tenant (SPEC §8 "Shares per tenant"), on
a real Valkey: its figure follows its retained bytes as it grows, is exact once it ends,
survives a lost write, and stops counting when its keys expire.

The ledger is lib/quota.py; EventBuffer.append hands it an execution's footprint
(append.lua says when). Found missing by the step 16 hostile-tenant review (issue 24,
row 6: one tenant added 1.07 GB in under a minute).
"""

from __future__ import annotations

import uuid
from typing import Any

from redis.asyncio import Redis

from lib.backend import Batch, Keys
from lib.errors import BufferUnavailable, OverQuota
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.record import Field
from lib.quota import StorageQuota
from tests.execution.scripts.contract import now_ms
from tests.support.api import until

BASE = 100  # the run state's bytes as created


class LosingQuota(StorageQuota):
    """A ledger whose next ``lose`` figures are lost (Redis out of reach)."""

    lose = 0

    async def record(self, tenant: str, member: str, size: int, lifetime_ms: int = 0) -> None:
        if self.lose:
            self.lose -= 1
            raise BufferUnavailable("the buffer is unreachable (a fault of the test)")
        await super().record(tenant, member, size, lifetime_ms)


def chunk(execution_id: str, event_id: int, size: int) -> Event:
    return Event(
        id=event_id,
        type="block:chunk",
        execution_id=execution_id,
        workflow_id="wf",
        data={"blockId": "b", "text": "x" * size},
    )


async def finish(buffer: EventBuffer, execution_id: str, event_id: int) -> None:
    """Store the execution's final event, completed."""
    kind = "execution:completed"
    ended = Event(id=event_id, type=kind, execution_id=execution_id, workflow_id="wf", data={})
    await buffer.append(execution_id, [ended], fence="owner-1", meta={"status": "completed"})


async def started(buffer: EventBuffer, tenant: str) -> str:
    """An execution created as the runner creates one: counted in the start's batch."""
    execution_id = f"ex_{uuid.uuid4().hex}"
    batch = Batch(buffer.redis)
    buffer.reserve_in(batch, tenant, execution_id, BASE)
    await batch.send()
    base = str(BASE)
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant=tenant,
        owner="owner-1",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
        extra={Field.QUOTA_BASE.value: base, Field.QUOTA_RECORDED.value: base},
    )
    return execution_id


def buffer_with(redis: Redis, quota: StorageQuota, unique: str, **options: Any) -> EventBuffer:
    return EventBuffer(
        redis=redis, prefix=f"q{unique}", event_limit=1000, budget_bytes=20_000, quota=quota,
        **options,
    )  # fmt: skip


async def test_an_executions_figure_follows_what_it_retains_and_is_exact_once_it_ends(
    redis: Redis, unique: str
) -> None:
    """While it runs the figure is off what it retains by less than a step plus a batch,
    the ring's eviction lowering it too; its final batch sets it exactly."""
    quota = StorageQuota(redis=redis, limit_bytes=1_000_000, prefix=f"q{unique}")
    buffer = buffer_with(redis, quota, unique)
    tenant = f"t{unique}"
    execution_id = await started(buffer, tenant)
    assert await quota.usage(tenant) == BASE
    for event_id in range(1, 41):
        await buffer.append(execution_id, [chunk(execution_id, event_id, 1000)], fence="owner-1")
        meta = await buffer.meta(execution_id)
        kept = meta.retained_bytes + BASE
        assert abs(await quota.usage(tenant) - kept) < buffer.quota_step + 1100
    assert meta.retained_bytes <= 20_000  # the ring evicted: the figure went down with it
    await finish(buffer, execution_id, 41)
    meta = await buffer.meta(execution_id)
    assert await quota.usage(tenant) == meta.retained_bytes + BASE


async def test_a_lost_figure_is_made_good_and_a_finished_one_stops_counting_at_expiry(
    redis: Redis, unique: str
) -> None:
    """A figure lost between the append and the ledger (the process killed there, or
    Redis out of reach) leaves the total short until the next one, never for good; once
    the execution's keys expire with its retention, its figure no longer counts."""
    quota = LosingQuota(redis=redis, limit_bytes=1_000_000, prefix=f"q{unique}")
    buffer = buffer_with(redis, quota, unique, retention_seconds=1)
    tenant = f"t{unique}"
    execution_id = await started(buffer, tenant)
    quota.lose = 1
    await buffer.append(execution_id, [chunk(execution_id, 1, 6000)], fence="owner-1")
    assert await quota.usage(tenant) == BASE  # lost: the total lags
    await finish(buffer, execution_id, 2)
    meta = await buffer.meta(execution_id)
    assert await quota.usage(tenant) == meta.retained_bytes + BASE

    async def counts_nothing() -> bool:
        return await quota.usage(tenant) == 0

    await until(counts_nothing, "the expired execution stops counting", 10)
    assert not await redis.exists(buffer.keys.meta(execution_id))  # and its keys are gone


async def test_a_start_past_the_quota_is_refused_in_its_batch_and_counts_nothing(
    redis: Redis, unique: str
) -> None:
    """The start's reservation refuses with the figures (OverQuota) and sets nothing;
    another tenant's ledger is its own."""
    quota = StorageQuota(redis=redis, limit_bytes=1000, prefix=f"q{unique}")
    buffer = buffer_with(redis, quota, unique)
    await quota.reserve(f"a{unique}", "w:big", 950)
    batch = Batch(redis)
    buffer.reserve_in(batch, f"a{unique}", "ex_refused", BASE)
    try:
        await batch.send()
    except OverQuota as refused:
        assert (refused.used, refused.limit, refused.needed) == (950, 1000, BASE)
    else:
        raise AssertionError("a start past the quota was counted")
    assert await quota.usage(f"a{unique}") == 950
    await started(buffer, f"b{unique}")
    assert await quota.usage(f"b{unique}") == BASE


async def test_a_paused_executions_figure_counts_as_long_as_its_keys_wait(
    redis: Redis, unique: str
) -> None:
    """A pause keeps its keys for the active TTL (days, for an approval): its figure
    counts that long, not just a retention period; once it ends, a retention period."""
    quota = StorageQuota(redis=redis, limit_bytes=1_000_000, prefix=f"q{unique}")
    buffer = buffer_with(redis, quota, unique, retention_seconds=60, active_ttl_seconds=7200)
    tenant = f"t{unique}"
    execution_id = await started(buffer, tenant)
    kind = "execution:paused"
    paused = Event(id=1, type=kind, execution_id=execution_id, workflow_id="wf", data={})
    await buffer.append(execution_id, [paused], fence="owner-1", meta={"status": "paused"})
    ledger = Keys(f"q{unique}").quota(tenant)[0]
    member = f"e:{execution_id}"

    async def counts_for() -> float:
        score = await redis.zscore(ledger, member)
        assert score is not None
        return (score - await now_ms(redis, ledger)) / 1000

    assert 7100 < await counts_for() <= 7200
    await finish(buffer, execution_id, 2)
    assert 0 < await counts_for() <= 60
