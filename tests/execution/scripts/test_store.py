"""store.lua's contract on a real Valkey: nothing to settle for a new store or the same
server, the whole settle when the server changed, what is left of it until it ends."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, script

SETTLE_MS = 30_000


def store(redis: Redis, keys: Keys, identity: str, settle: int = SETTLE_MS) -> Any:
    return script(redis, "store.lua")(keys=[keys.store], args=[identity, settle])


async def test_a_new_store_records_who_answers_and_has_nothing_to_settle(
    redis: Redis, keys: Keys
) -> None:
    assert await store(redis, keys, "run-a") == 0
    assert await redis.hgetall(keys.store) == {b"runId": b"run-a", b"settleUntil": b"0"}
    assert await store(redis, keys, "run-a") == 0


async def test_another_server_answering_starts_a_settle_then_what_is_left_of_it(
    redis: Redis, keys: Keys
) -> None:
    await store(redis, keys, "run-a")
    before = await now_ms(redis, keys.store)
    assert await store(redis, keys, "run-b") == SETTLE_MS
    after = await now_ms(redis, keys.store)
    until = int(await redis.hget(keys.store, "settleUntil") or 0)
    assert before + SETTLE_MS <= until <= after + SETTLE_MS
    left = await store(redis, keys, "run-b")
    assert 0 < left <= SETTLE_MS
    assert await redis.hget(keys.store, "runId") == b"run-b"


async def test_a_settle_that_ended_leaves_nothing_to_wait_for(redis: Redis, keys: Keys) -> None:
    past = await now_ms(redis, keys.store) - 1
    await redis.hset(keys.store, mapping={"runId": "run-b", "settleUntil": past})
    assert await store(redis, keys, "run-b") == 0
