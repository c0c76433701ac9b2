"""quota.lua's contract on a real Valkey: a tenant's storage ledger, every reply.

The ARGV layout is built here from the script's header, not by StorageQuota, so the
header and the script are checked against each other.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys, register
from tests.execution.scripts.contract import now_ms

INF = float("inf")


def setting(redis: Redis, keys: Keys, *things: tuple[str, int, int], limit: int = 0) -> Any:
    """One call: each (thing, size, lifetime in ms) set, all under ``limit``."""
    ledger = register(redis, "lib", "quota.lua")
    return ledger(keys=keys.quota("acme"), args=[limit, *(v for thing in things for v in thing)])


async def test_a_figure_replaces_the_previous_one_and_the_total_follows(
    redis: Redis, keys: Keys
) -> None:
    """Setting a figure twice counts it once; the reply is {1, total, previous...}."""
    assert await setting(redis, keys, ("w:a", 300, 0)) == [1, 300, 0]
    assert await setting(redis, keys, ("w:a", 300, 0)) == [1, 300, 300]
    both = await setting(redis, keys, ("e:x", 200, 60_000), ("v:d", 50, 60_000))
    assert both == [1, 550, 0, 0]
    assert await setting(redis, keys, ("w:a", 100, 0)) == [1, 350, 300]
    ledger, sizes = keys.quota("acme")
    assert await redis.zscore(ledger, "w:a") == INF
    assert await redis.hget(sizes, "total") == b"350"


async def test_growth_past_the_limit_is_refused_whole_and_changes_nothing(
    redis: Redis, keys: Keys
) -> None:
    """Past the limit things that grow in all are refused {0, total, needed, retry_ms},
    with the time until the first expiring thing stops counting, and none of them is
    set; shrinking is never refused."""
    ledger = keys.quota("acme")[0]
    await setting(redis, keys, ("w:a", 600, 0), limit=1000)
    before = await now_ms(redis, ledger)
    await setting(redis, keys, ("e:x", 300, 60_000), limit=1000)
    refused = await setting(redis, keys, ("e:y", 60, 60_000), ("v:d", 41, 60_000), limit=1000)
    assert refused[:3] == [0, 900, 101]
    assert 55_000 <= refused[3] <= 60_000 + (await now_ms(redis, ledger) - before)
    assert await redis.zscore(ledger, "e:y") is None and await redis.zscore(ledger, "v:d") is None
    fits = await setting(redis, keys, ("e:y", 60, 60_000), ("v:d", 40, 60_000), limit=1000)
    assert fits == [1, 1000, 0, 0]  # exactly at the limit
    assert await setting(redis, keys, ("w:a", 50, 0), limit=1000) == [1, 450, 600]
    assert (await setting(redis, keys, ("e:x", 900, 60_000)))[:2] == [1, 1050]  # no limit


async def test_without_anything_that_expires_the_refusal_says_so(redis: Redis, keys: Keys) -> None:
    """Only deletions make room when nothing counted expires: retry_ms is -1."""
    await setting(redis, keys, ("w:a", 900, 0), limit=1000)
    assert await setting(redis, keys, ("s:k", 200, 0), limit=1000) == [0, 900, 200, -1]


async def test_a_thing_past_its_time_stops_counting_and_a_forgotten_one_at_once(
    redis: Redis, keys: Keys
) -> None:
    """An expired figure leaves the total at the next call (a crash cannot keep it for
    good); a lifetime of -1 forgets a thing; no thing at all only answers the total."""
    await setting(redis, keys, ("e:gone", 500, 1), ("w:a", 40, 0))
    ledger = keys.quota("acme")[0]
    start = await now_ms(redis, ledger)
    while await now_ms(redis, ledger) < start + 2:
        pass  # Redis's clock passes the lifetime of 1 ms
    assert await setting(redis, keys) == [1, 40]
    assert await redis.zscore(ledger, "e:gone") is None
    assert await setting(redis, keys, ("w:a", 0, -1)) == [1, 0, 40]
    assert await setting(redis, keys, ("w:never", 0, -1)) == [1, 0, 0]
    assert await redis.zcard(ledger) == 0
