"""watch.lua's contract on a real Valkey: "add" and "refresh" (the score they answer,
the member they replace) and "due" (the members whose time passed); no refusal."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, script


def watch(redis: Redis, key: str, *args: Any) -> Any:
    return script(redis, "watch.lua")(keys=[key], args=list(args))


async def test_add_lists_a_member_scored_from_redis_clock(redis: Redis, keys: Keys) -> None:
    before = await now_ms(redis, keys.leases)
    score = await watch(redis, keys.leases, "add", "ex1 f1", 15_000)
    after = await now_ms(redis, keys.leases)
    assert before + 15_000 <= score <= after + 15_000
    assert await redis.zscore(keys.leases, "ex1 f1") == score


async def test_add_removes_the_member_it_replaces_in_the_same_step(
    redis: Redis, keys: Keys
) -> None:
    key = keys.running("acme")
    await watch(redis, key, "add", "f1", 15_000)
    await watch(redis, key, "add", "paused:ex1", 60_000, "f1")
    assert await redis.zrange(key, 0, -1) == [b"paused:ex1"]
    await watch(redis, key, "add", "f2", 15_000, "")
    assert sorted(await redis.zrange(key, 0, -1)) == [b"f2", b"paused:ex1"]


async def test_refresh_moves_a_listed_member_only(redis: Redis, keys: Keys) -> None:
    key = keys.running("acme")
    await redis.zadd(key, {"f1": 1, "f2": 1})
    score = await watch(redis, key, "refresh", "f1", 15_000)
    assert await redis.zscore(key, "f1") == score
    late = await watch(redis, key, "refresh", "gone", 15_000, "f2")
    assert late >= score  # answered, yet nothing listed; the replaced member still goes
    assert await redis.zrange(key, 0, -1) == [b"f1"]


async def test_due_reads_the_members_whose_time_passed_oldest_first_up_to_a_count(
    redis: Redis, keys: Keys
) -> None:
    now = await now_ms(redis, keys.deadlines)
    await redis.zadd(keys.deadlines, {"ex3": now - 10, "ex1": now - 30, "ex2": now - 20})
    await redis.zadd(keys.deadlines, {"later": now + 60_000})
    assert await watch(redis, keys.deadlines, "due", 2) == [b"ex1", b"ex2"]
    assert await watch(redis, keys.deadlines, "due", 10) == [b"ex1", b"ex2", b"ex3"]
    assert await redis.zcard(keys.deadlines) == 4  # reading takes nothing off the list
    # Looking ahead: what is due within that many milliseconds too.
    assert await watch(redis, keys.deadlines, "due", 10, 120_000) == [
        b"ex1",
        b"ex2",
        b"ex3",
        b"later",
    ]
    assert await watch(redis, keys.deadlines, "due", 10, 0) == [b"ex1", b"ex2", b"ex3"]


async def test_any_other_operation_reads_as_due(redis: Redis, keys: Keys) -> None:
    await redis.zadd(keys.leases, {"ex1 f1": 1})
    assert await watch(redis, keys.leases, "list", 10) == [b"ex1 f1"]


async def test_at_scores_a_member_no_sooner_than_the_hold_from_now(
    redis: Redis, keys: Keys
) -> None:
    now = await now_ms(redis, keys.deadlines)
    # A deadline long past is held: scored at least the hold from Redis's clock.
    held = await watch(redis, keys.deadlines, "at", "ex1", now - 60_000, 15_000)
    assert held >= now + 15_000
    assert await redis.zscore(keys.deadlines, "ex1") == held
    # A deadline later than the hold keeps its own time.
    later = now + 3_600_000
    assert await watch(redis, keys.deadlines, "at", "ex2", later, 15_000) == later
    assert await watch(redis, keys.deadlines, "due", 10) == []
