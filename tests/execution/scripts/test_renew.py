"""renew.lua's contract on a real Valkey: the renewal's reply, the take-back of an
owner the store forgot, and every refusal (GONE, FENCED, BEHIND)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, refusal, script

OWNER, OTHER = "node-a:1111", "node-b:2222"
LEASE_MS = 15_000


async def execution(redis: Redis, keys: Keys, eid: str, **fields: Any) -> None:
    base = {"owner": OWNER, "epoch": 2, "status": "running", "lastId": 5, "leaseUntil": 1}
    await redis.hset(keys.meta(eid), mapping={**base, **fields})


def renew(
    redis: Redis, keys: Keys, eid: str, token: str = OWNER, epoch: int = 2, stored: int = 5
) -> Any:
    args = [token, epoch, LEASE_MS, stored]
    return script(redis, "renew.lua")(keys=[keys.meta(eid)], args=args)


async def lease_until(redis: Redis, keys: Keys, eid: str) -> int:
    return int(await redis.hget(keys.meta(eid), "leaseUntil") or 0)


@pytest.mark.parametrize(("flag", "answer"), [(None, b"0"), ("1", b"1")])
async def test_the_lease_is_extended_on_redis_clock_and_a_cancel_request_reported(
    redis: Redis, keys: Keys, eid: str, flag: str | None, answer: bytes
) -> None:
    await execution(redis, keys, eid, **({"cancelRequested": flag} if flag else {}))
    before = await now_ms(redis, keys.meta(eid))
    requested, until = await renew(redis, keys, eid, stored=3)  # behind the store: fine
    after = await now_ms(redis, keys.meta(eid))
    assert requested == answer
    assert before + LEASE_MS <= until <= after + LEASE_MS
    assert await lease_until(redis, keys, eid) == until


async def test_an_owner_with_a_later_epoch_takes_the_execution_back(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, owner=OTHER, status="paused", pauseBlock="q")
    requested, until = await renew(redis, keys, eid, OWNER, epoch=3)
    assert requested == b"0"
    stored = await redis.hmget(keys.meta(eid), "owner", "epoch", "status", "pauseBlock")
    assert stored == [OWNER.encode(), b"3", b"running", b""]
    assert await lease_until(redis, keys, eid) == until


async def test_gone_when_the_store_lost_the_execution(redis: Redis, keys: Keys, eid: str) -> None:
    assert await refusal(renew(redis, keys, eid)) == "GONE"
    assert await redis.exists(keys.meta(eid)) == 0


@pytest.mark.parametrize(
    ("owner", "epoch"), [(OTHER, 2), (OTHER, 5), ("", 2)], ids=["same", "later", "handed-off"]
)
async def test_fenced_by_another_owner_of_the_same_or_a_later_epoch(
    redis: Redis, keys: Keys, eid: str, owner: str, epoch: int
) -> None:
    await execution(redis, keys, eid, owner=owner, epoch=epoch)
    assert await refusal(renew(redis, keys, eid, OWNER, epoch=2)) == "FENCED"
    assert await lease_until(redis, keys, eid) == 1
    assert await redis.hget(keys.meta(eid), "owner") == owner.encode()


async def test_behind_when_the_store_lost_stored_events_but_the_lease_is_renewed_first(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, lastId=5)
    before = await now_ms(redis, keys.meta(eid))
    assert await refusal(renew(redis, keys, eid, stored=8)) == "BEHIND"
    assert await lease_until(redis, keys, eid) >= before + LEASE_MS
