"""admit.lua's contract on a real Valkey: a run admitted (1) or refused at its tenant's
cap (0), what counts towards the cap, and the entries that stop counting."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, script

LEASE_MS = 15_000
GRACE_MS = 45_000


def admit(
    redis: Redis, keys: Keys, fence: str, *, limit: int, replaces: str = "", grace: int = GRACE_MS
) -> Any:
    args = [fence, LEASE_MS, limit, replaces, grace]
    return script(redis, "admit.lua")(keys=[keys.running("acme")], args=args)


async def members(redis: Redis, keys: Keys) -> list[bytes]:
    return list(await redis.zrange(keys.running("acme"), 0, -1))


async def test_a_run_under_the_cap_is_counted_until_its_lease_ends(
    redis: Redis, keys: Keys
) -> None:
    key = keys.running("acme")
    before = await now_ms(redis, key)
    assert await admit(redis, keys, "f1", limit=2) == 1
    after = await now_ms(redis, key)
    score = await redis.zscore(key, "f1")
    assert score is not None and before + LEASE_MS <= score <= after + LEASE_MS


async def test_a_run_at_the_cap_is_refused_and_not_counted(redis: Redis, keys: Keys) -> None:
    assert await admit(redis, keys, "f1", limit=2) == 1
    assert await admit(redis, keys, "f2", limit=2) == 1
    assert await admit(redis, keys, "f3", limit=2) == 0
    assert sorted(await members(redis, keys)) == [b"f1", b"f2"]


async def test_a_run_already_counted_is_admitted_at_the_cap(redis: Redis, keys: Keys) -> None:
    await admit(redis, keys, "f1", limit=1)
    first = await redis.zscore(keys.running("acme"), "f1")
    assert await admit(redis, keys, "f1", limit=1) == 1
    again = await redis.zscore(keys.running("acme"), "f1")
    assert first is not None and again is not None and again >= first


async def test_the_pause_a_run_resumes_does_not_count(redis: Redis, keys: Keys) -> None:
    await redis.zadd(keys.running("acme"), {"paused:ex1": 10**13})
    assert await admit(redis, keys, "f1", limit=1) == 0
    assert await admit(redis, keys, "f1", limit=1, replaces="paused:ex1") == 1
    # Replacing is the caller's to do (watch.lua): admit only leaves it uncounted.
    assert sorted(await members(redis, keys)) == [b"f1", b"paused:ex1"]


async def test_a_replaced_member_that_is_not_listed_changes_nothing(
    redis: Redis, keys: Keys
) -> None:
    await admit(redis, keys, "f1", limit=1)
    assert await admit(redis, keys, "f2", limit=1, replaces="paused:ex9") == 0


async def test_no_cap_with_a_limit_of_0(redis: Redis, keys: Keys) -> None:
    for i in range(5):
        assert await admit(redis, keys, f"f{i}", limit=0) == 1
    assert len(await members(redis, keys)) == 5


async def test_an_entry_stops_counting_a_grace_after_its_lease_ended(
    redis: Redis, keys: Keys
) -> None:
    now = await now_ms(redis, keys.running("acme"))
    await redis.zadd(
        keys.running("acme"), {"long-gone": now - GRACE_MS - 1_000, "just-ended": now - 1_000}
    )
    assert await admit(redis, keys, "f1", limit=2) == 1
    assert sorted(await members(redis, keys)) == [b"f1", b"just-ended"]
    assert await admit(redis, keys, "f2", limit=2) == 0
