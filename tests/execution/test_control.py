"""A process's control stream (lib/execution/control.py) on a real Valkey: it does not
outlive its process for good, and a live reader never misses a cancel for it.

Node ids are new with every process, so a stream kept for good is one key for every
process ever started (SPEC §14: nothing grows with the workers ever started). Found by
the queue storm (stress/queue_storm.py): each worker stopped with SIGTERM left its
control stream, holding the ``wake`` of its own shutdown, with no expiry."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.control import CONTROL_SECONDS, ControlStreams
from tests.support.api import until


def control_streams(redis: Redis) -> ControlStreams:
    return ControlStreams(buffer=EventBuffer(redis=redis, prefix=f"ct{uuid.uuid4().hex[:6]}"))


@pytest.mark.timeout(30)
async def test_a_stopped_or_dead_process_leaves_no_control_stream_for_good(redis: Redis) -> None:
    control = control_streams(redis)
    await control.wake("node-stopped")  # what a shutdown writes last
    await control.send_cancel("node-dead", "ex_a")  # a cancel sent to a process that died
    for node in ("node-stopped", "node-dead"):
        ttl = await redis.ttl(control.keys.control(node))
        assert 0 < ttl <= CONTROL_SECONDS, (node, ttl)


@pytest.mark.timeout(30)
async def test_a_live_reader_reads_on_across_the_end_of_its_control_stream(redis: Redis) -> None:
    control = control_streams(redis)
    await control.send_cancel("node-live", "ex_before")
    cursors = await control.cursors("node-live")
    last_ms = int(cursors[control.keys.control("node-live")].split("-")[0])

    async def later() -> bool:
        seconds, micros = await redis.time()
        return seconds * 1000 + micros // 1000 > last_ms

    # The stream ends (its expiry, CONTROL_SECONDS after its last message: on Redis's
    # clock, later than that message) while its process reads on from its cursor.
    await until(later, "Redis's clock past the last message", 5)
    assert await redis.delete(control.keys.control("node-live")) == 1
    await control.send_cancel("node-live", "ex_after")
    cancels, handed, queued = await control.read(cursors, block_ms=1000)
    assert (cancels, handed, queued) == (["ex_after"], [], False)
