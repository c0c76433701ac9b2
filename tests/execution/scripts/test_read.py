"""read.lua's contract on a real Valkey: its one reply (events after a cursor, the
metadata, the dropped ranges), for an execution that exists and one that does not, and
its no-writes flag (it has no refusal of its own)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import script


def read(redis: Redis, keys: Keys, eid: str, *, after: int, limit: int) -> Any:
    return script(redis, "read.lua")(keys=keys.execution(eid)[:3], args=[after, limit])


async def stored(redis: Redis, keys: Keys, eid: str, count: int) -> None:
    for i in range(1, count + 1):
        await redis.xadd(keys.events(eid), {"t": "block:chunk", "e": f"e{i}"}, id=f"{i}-0")
    await redis.hset(keys.meta(eid), mapping={"status": "running", "lastId": count})


async def test_events_after_the_cursor_come_with_the_metadata_and_dropped_ranges(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await stored(redis, keys, eid, 5)
    await redis.zadd(keys.dropped(eid), {"7-9": 7, "2-3": 2})
    entries, meta, dropped = await read(redis, keys, eid, after=2, limit=2)
    assert entries == [
        [b"3-0", [b"t", b"block:chunk", b"e", b"e3"]],
        [b"4-0", [b"t", b"block:chunk", b"e", b"e4"]],
    ]
    assert dict(zip(meta[::2], meta[1::2], strict=True)) == {b"status": b"running", b"lastId": b"5"}
    assert dropped == [b"2-3", b"7-9"]


async def test_a_cursor_too_large_for_lua_to_print_is_still_a_stream_id(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await stored(redis, keys, eid, 1)
    entries, meta, _ = await read(redis, keys, eid, after=10**14, limit=10)
    assert entries == [] and meta != []
    entries, _, _ = await read(redis, keys, eid, after=0, limit=10)
    assert [entry[0] for entry in entries] == [b"1-0"]


async def test_an_execution_that_does_not_exist_reads_as_empty(
    redis: Redis, keys: Keys, eid: str
) -> None:
    assert await read(redis, keys, eid, after=0, limit=10) == [[], [], []]


async def test_it_reads_while_writes_are_paused(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    """The flags line survives the prelude (it must stay the script's first line)."""
    await stored(redis, keys, eid, 2)
    node = Redis.from_url(node_url(keys.meta(eid)))
    await node.execute_command("CLIENT", "PAUSE", 5_000, "WRITE")
    try:
        async with asyncio.timeout(3):
            entries, _, _ = await read(redis, keys, eid, after=0, limit=10)
    finally:
        await node.execute_command("CLIENT", "UNPAUSE")
        await node.aclose()
    assert len(entries) == 2
