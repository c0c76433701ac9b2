"""Stream readers: the seam between replay and live, for local and remote sources."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.log import Emitter, EventWriter
from lib.execution.stream import Readers, StreamReader
from tests.support.logcheck import check_log, check_view
from tests.support.sse import parse_frame

TOTAL = 400


@pytest.fixture
async def buffer(redis: Redis) -> AsyncIterator[EventBuffer]:
    yield EventBuffer(redis=redis, prefix=f"s{uuid.uuid4().hex[:6]}")


async def create(buffer: EventBuffer) -> str:
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner="me",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    return execution_id


async def read_all(reader: StreamReader) -> list[object]:
    data = b"".join([chunk async for chunk in reader.frames()])
    return [parse_frame(raw) for raw in data.split(b"\n\n") if raw]


async def emit_all(emitter: Emitter, total: int) -> None:
    emitter.emit("execution:started", {"input": None})
    for i in range(2, total):
        emitter.emit("block:chunk", {"blockId": "b", "text": str(i)})
        if i % 7 == 0:
            await asyncio.sleep(0)
    emitter.emit("execution:completed", {"output": {}, "durationMs": 1})


async def test_readers_attaching_during_a_local_execution_get_every_event_once(
    buffer: EventBuffer,
) -> None:
    execution_id = await create(buffer)
    async with Readers(buffer=buffer) as live:
        writer = EventWriter(buffer=buffer, execution_id=execution_id, fence="me")
        publisher = live.hub.attach_local(execution_id, last_id=0)
        writer.show_to(publisher)
        async with writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            readers: list[tuple[int, asyncio.Task[list[object]]]] = []
            producer = asyncio.create_task(emit_all(emitter, TOTAL))
            rng = random.Random(7)
            while not producer.done():
                cursor = rng.randint(0, emitter.last_id)
                reader = StreamReader(readers=live, execution_id=execution_id, cursor=cursor)
                readers.append((cursor, asyncio.create_task(read_all(reader))))
                await asyncio.sleep(0)
            await producer
        publisher.detach()
        results = [(cursor, await task) for cursor, task in readers]
    assert len(results) > 5
    for cursor, frames in results:
        envelopes = check_view(frames, after=cursor)
        assert envelopes[-1]["id"] == TOTAL
        if cursor == 0:
            check_log(envelopes)


async def test_readers_on_another_process_follow_the_stored_log_without_polling(
    buffer: EventBuffer,
) -> None:
    execution_id = await create(buffer)

    async def remote_writer() -> None:
        # Another process writes; this one only ever sees Redis.
        async with Readers(buffer=buffer) as other_readers:
            writer = EventWriter(buffer=buffer, execution_id=execution_id, fence="me")
            publisher = other_readers.hub.attach_local(execution_id, last_id=0)
            writer.show_to(publisher)
            async with writer:
                emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
                await emit_all(emitter, TOTAL)
            publisher.detach()

    async with Readers(buffer=buffer, tail_block_ms=1000) as live:
        producer = asyncio.create_task(remote_writer())
        readers = []
        rng = random.Random(11)
        while not producer.done():
            cursor = rng.randint(0, 50)
            reader = StreamReader(readers=live, execution_id=execution_id, cursor=cursor)
            readers.append((cursor, asyncio.create_task(read_all(reader))))
            await asyncio.sleep(0.001)
        await producer
        results = [(cursor, await asyncio.wait_for(task, 10)) for cursor, task in readers]
    for cursor, frames in results:
        envelopes = check_view(frames, after=cursor)
        assert envelopes[-1]["id"] == TOTAL


async def test_reader_closed_mid_stream_ends_and_a_reconnect_loses_nothing(
    buffer: EventBuffer,
) -> None:
    """What the connection's time cap does (app/sse.py closes the reader at it)."""
    execution_id = await create(buffer)
    async with Readers(buffer=buffer) as live:
        writer = EventWriter(buffer=buffer, execution_id=execution_id, fence="me")
        publisher = live.hub.attach_local(execution_id, last_id=0)
        writer.show_to(publisher)
        async with writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            emitter.emit("execution:started", {"input": None})
            capped = StreamReader(readers=live, execution_id=execution_id, cursor=0)
            cap = asyncio.get_running_loop().call_later(0.2, capped.close)
            first = await read_all(capped)
            cap.cancel()
            assert capped.finished is False
            emitter.emit("execution:completed", {"output": {}, "durationMs": 1})
        publisher.detach()
        rest = await read_all(
            StreamReader(readers=live, execution_id=execution_id, cursor=capped.last_sent)
        )
    check_log(check_view(first + rest))
