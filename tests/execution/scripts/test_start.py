"""start.lua's contract on a real Valkey: the metadata and run state it creates, its
reply, and the list row it publishes (it has no refusal of its own)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import inbox, now_ms, publish_refused, script

TOKEN = "node-a:1111"
IDENTITY = {"workflowId": "wf", "tenant": "acme", "createdAt": "c0", "updatedAt": "u0"}


def start(
    redis: Redis,
    keys: Keys,
    eid: str,
    *,
    lease_ms: int = 15_000,
    ttl: int = 3_600,
    state: dict[str, str] | None = None,
    meta: dict[str, str] | None = None,
    reserved: int = 0,
) -> Any:
    pairs = [item for pair in (state or {}).items() for item in pair]
    fields = [item for pair in (IDENTITY if meta is None else meta).items() for item in pair]
    args = [TOKEN, lease_ms, ttl, eid, keys.status, reserved, len(pairs) // 2, *pairs, *fields]
    return script(redis, "start.lua")(keys=[keys.meta(eid), keys.state(eid)], args=args)


async def test_an_execution_starts_running_at_epoch_1_with_its_lease_on_redis_clock(
    redis: Redis, keys: Keys, eid: str
) -> None:
    before = await now_ms(redis, keys.meta(eid))
    until = await start(redis, keys, eid, lease_ms=15_000, meta={**IDENTITY, "mode": "x"})
    after = await now_ms(redis, keys.meta(eid))
    assert before + 15_000 <= until <= after + 15_000
    meta = await redis.hgetall(keys.meta(eid))
    assert meta == {
        b"owner": TOKEN.encode(), b"epoch": b"1", b"leaseUntil": str(until).encode(),
        b"status": b"running", b"lastId": b"0", b"firstId": b"0", b"bytes": b"0",
        b"count": b"0", b"reserved": b"0", b"workflowId": b"wf", b"tenant": b"acme",
        b"createdAt": b"c0", b"updatedAt": b"u0", b"mode": b"x",
        b"writtenAt": str(until - 15_000).encode(),
    }  # fmt: skip
    assert 3_500 < await redis.ttl(keys.meta(eid)) <= 3_600


async def test_the_ids_reserved_from_the_start_are_the_owners(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """Its first event is shown as it is emitted: its id is reserved with the creation
    (step 15, the event path's latency), and a takeover numbers above it."""
    await start(redis, keys, eid, reserved=1)
    assert await redis.hmget(keys.meta(eid), "reserved", "lastId") == [b"1", b"0"]


async def test_the_run_state_is_written_with_the_metadata_when_given(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await start(redis, keys, eid, ttl=3_600, state={"version": "v1", "input": "{}"})
    assert await redis.hgetall(keys.state(eid)) == {b"version": b"v1", b"input": b"{}"}
    assert 3_500 < await redis.ttl(keys.state(eid)) <= 3_600
    assert await redis.hget(keys.meta(eid), "tenant") == b"acme"


async def test_no_run_state_is_written_without_fields(redis: Redis, keys: Keys, eid: str) -> None:
    await start(redis, keys, eid)
    assert await redis.exists(keys.state(eid)) == 0


async def test_the_new_row_is_published_on_the_status_channel(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    async with inbox(node_url(keys.meta(eid)), keys.status, keys.notify) as box:
        await start(redis, keys, eid)
        ((channel, row),) = await box.received()
    assert channel == keys.status
    assert json.loads(row) == {
        "id": eid, "tenant": "acme", "workflowId": "wf", "status": "running",
        "createdAt": "c0", "updatedAt": "u0", "lastEventId": 0,
    }  # fmt: skip


async def test_no_row_is_published_without_a_tenant(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    async with inbox(node_url(keys.meta(eid)), keys.status) as box:
        await start(redis, keys, eid, meta={"workflowId": "wf"})
        assert await box.received() == []
    assert await redis.hget(keys.meta(eid), "status") == b"running"


async def test_a_refused_publish_still_creates_the_execution(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    async with publish_refused(node_url(keys.meta(eid))) as user:
        until = await start(user, keys, eid)
    assert await redis.hget(keys.meta(eid), "leaseUntil") == str(until).encode()
