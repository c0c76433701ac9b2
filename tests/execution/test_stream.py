"""Stream readers: the seam between replay and live, for local and remote sources."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.flush import EventWriter
from lib.execution.log import Emitter
from lib.execution.stream import Readers, StreamReader
from tests.support.api import until
from tests.support.logcheck import check_log, check_view
from tests.support.sse import parse_frame
from tests.support.timing import hold_for

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
            await hold_for(0.001, "readers join at the producer's pace")
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


class CountingBuffer(EventBuffer):
    """A reader process's buffer that counts the tail's reads (a seam, real Valkey)."""

    reads = 0

    async def after(self, execution_id: str, *, after: int, count: int = 1000) -> list[Event]:
        self.reads += 1
        return await super().after(execution_id, after=after, count=count)


async def test_a_reader_on_another_process_forwards_small_batches_without_reading_them(
    buffer: EventBuffer,
) -> None:
    """The notify message carries a small batch whole (append.lua): the remote tail
    reads the store once when it starts, then forwards what it hears."""
    execution_id = await create(buffer)
    remote = CountingBuffer(redis=buffer.redis, prefix=buffer.prefix)
    async with Readers(buffer=remote, tail_block_ms=60_000) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        frames = asyncio.create_task(read_all(reader))
        async with EventWriter(buffer=buffer, execution_id=execution_id, fence="me") as writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            emitter.emit("execution:started", {"input": None})

            def tail_up() -> bool:
                channel = live.hub.get(execution_id)
                return channel is not None and channel.tail_task is not None

            await until(tail_up, "the tail is up", every=0.005)
            started_reads = remote.reads
            for i in range(2, 40):
                emitter.emit("block:chunk", {"blockId": "b", "text": str(i)})
                await writer.drained()
            emitter.emit("execution:completed", {"output": {}, "durationMs": 1})
        envelopes = check_view(await asyncio.wait_for(frames, 10), after=0)
    assert [e["id"] for e in envelopes] == list(range(1, 41))
    # 39 batches stored after the tail started; at most the read of a batch that was
    # stored while the tail's first read was in flight.
    assert remote.reads - started_reads <= 1


async def test_a_published_batch_that_does_not_follow_is_not_forwarded_but_read(
    buffer: EventBuffer,
) -> None:
    """A notify message whose first id leaves a hole after the channel's last event is
    never shown as it is: the tail reads the store, which tells what is there."""
    execution_id = await create(buffer)
    async with Readers(buffer=buffer, tail_block_ms=60_000) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        frames = asyncio.create_task(read_all(reader))
        async with EventWriter(buffer=buffer, execution_id=execution_id, fence="me") as writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            emitter.emit("execution:started", {"input": None})
            await writer.drained()

            def tail_has_id_1() -> bool:
                channel = live.hub.get(execution_id)
                up = channel is not None and channel.tail_task is not None
                return up and channel is not None and channel.last_published >= 1

            await until(tail_has_id_1, "the tail has id 1", every=0.005)
            forged = b'{"id":3,"type":"block:chunk","data":{"text":"never stored"}}'
            message = b"\n".join([execution_id.encode(), b"3", b"block:chunk", forged])
            await buffer.redis.publish(buffer.keys.notify, message)
            emitter.emit("block:chunk", {"blockId": "b", "text": "2"})
            emitter.emit("execution:completed", {"output": {}, "durationMs": 1})
        envelopes = check_view(await asyncio.wait_for(frames, 10), after=0)
    assert [e["type"] for e in envelopes] == [
        "execution:started",
        "block:chunk",
        "execution:completed",
    ]
    assert envelopes[1]["data"]["text"] == "2"


class OutOfReach(EventBuffer):
    """A reader process's buffer whose tail reads fail while ``down``: the store out of
    reach from this process alone (a seam, real Valkey)."""

    down = False
    failures = 0
    asked = 0  # existence checks

    def _reach(self) -> None:
        if self.down:
            self.failures += 1
            raise BufferUnavailable("out of reach (test)")

    async def after(self, execution_id: str, *, after: int, count: int = 1000) -> list[Event]:
        self._reach()
        return await super().after(execution_id, after=after, count=count)

    async def exists(self, execution_id: str) -> bool:
        self.asked += 1
        self._reach()
        return await super().exists(execution_id)


async def test_a_tail_out_of_reach_of_the_store_for_a_lease_ends_its_streams(
    buffer: EventBuffer,
) -> None:
    """Found by the step 15 fault review (a stream on a replica cut off from Redis stays
    open on heartbeats): an outage shorter than the cut-off ends no stream; one that
    lasts ends it at a frame boundary, and a reconnect from its last id loses nothing."""
    execution_id = await create(buffer)
    remote = OutOfReach(redis=buffer.redis, prefix=buffer.prefix)
    async with Readers(buffer=remote, tail_block_ms=50, cutoff_seconds=0.5) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        frames = asyncio.create_task(read_all(reader))
        async with EventWriter(buffer=buffer, execution_id=execution_id, fence="me") as writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            emitter.emit("execution:started", {"input": None})
            await writer.drained()
            await until(lambda: reader.last_sent >= 1, "id 1 sent", every=0.005)
            remote.down = True
            await until(lambda: remote.failures >= 2, "the tail failed", every=0.005)
            await hold_for(0.1, "the outage's length, well short of the cut-off")
            remote.down = False
            emitter.emit("block:chunk", {"blockId": "b", "text": "2"})
            await writer.drained()
            await until(lambda: reader.last_sent >= 2, "id 2 sent", every=0.005)
            assert not frames.done()
            remote.down = True  # for good, this time
            ended = check_view(await asyncio.wait_for(frames, 10), after=0)
            emitter.emit("execution:completed", {"output": {}, "durationMs": 1})
        assert [e["id"] for e in ended] == [1, 2]
        assert reader.finished is False
        remote.down = False
        again = StreamReader(readers=live, execution_id=execution_id, cursor=2)
        rest = check_view(await asyncio.wait_for(read_all(again), 10), after=2)
    assert [e["type"] for e in rest] == ["execution:completed"]


async def test_a_run_here_that_lost_its_lease_and_the_store_ends_its_streams(
    buffer: EventBuffer,
) -> None:
    """Found by the step 15 fault review: a run here whose lease renewals fail shows
    nothing more, and its readers have no tail to learn what another process stores.
    While the store answers, its streams stay open; once it does not, they end."""
    execution_id = await create(buffer)
    remote = OutOfReach(redis=buffer.redis, prefix=buffer.prefix)
    held = True
    async with Readers(buffer=remote, cutoff_seconds=0.2) as live:
        writer = EventWriter(buffer=buffer, execution_id=execution_id, fence="me")
        publisher = live.hub.attach_local(execution_id, last_id=0, lease_held=lambda: held)
        writer.show_to(publisher)
        async with writer:
            emitter = Emitter(execution_id=execution_id, workflow_id="wf", writer=writer)
            emitter.emit("execution:started", {"input": None})
            reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
            frames = asyncio.create_task(read_all(reader))
            await until(lambda: reader.last_sent >= 1, "id 1 sent", every=0.005)
            held = False
            await until(lambda: remote.asked >= 2, "the store was asked", every=0.005)
            assert not frames.done(), "the store answered: the stream must stay open"
            remote.down = True
            ended = check_view(await asyncio.wait_for(frames, 10), after=0)
        publisher.detach()
    assert [e["id"] for e in ended] == [1]
    assert reader.finished is False


async def test_an_idle_tail_reads_two_fields_of_the_metadata_not_the_whole_hash(
    buffer: EventBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tail on another process, idle (a paused run, followed for minutes), looks at
    the execution every ``tail_block_ms``: whether it finished below what its readers
    saw, whether it is gone. It read the whole metadata hash for that (e37bdfa), which
    copies a pause of up to 16 KiB, once per idle period and per followed execution;
    it reads the status and the last id. Found by the fresh-eyes review of e37bdfa."""
    execution_id = await create(buffer)
    started = Event(
        id=1, type="execution:started", execution_id=execution_id, workflow_id="wf", data={}
    )
    await buffer.append(execution_id, [started], fence="me")
    # Each idle period is one read of the log (``after``), then a look at the execution.
    calls = {"meta": 0, "after": 0}
    for name in calls:
        real = getattr(buffer, name)

        async def counted(
            *args: object, name: str = name, real: object = real, **kw: object
        ) -> object:
            calls[name] += 1
            return await real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(buffer, name, counted)
    async with Readers(buffer=buffer, tail_block_ms=100) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        reading = asyncio.create_task(read_all(reader))
        await until(lambda: calls["after"] >= 2, "the tail idle", 10, every=0.01)
        before, reads = calls["meta"], calls["after"]
        await until(lambda: calls["after"] >= reads + 5, "five idle periods", 10, every=0.01)
        assert calls["meta"] == before, calls
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
