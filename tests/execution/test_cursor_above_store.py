"""A reader whose cursor is above the stored log still gets the terminal event.

Found by the step 15 fault review (F1): a client of an owner that lost Redis had seen
ids the store never kept; the run then ended below them elsewhere, and the client got
no terminal event (its tail waited above the log; a reconnect got 204). SPEC §5: a
client whose cursor is above the last stored id still gets the execution's terminal
event. These run against a real Valkey; the "other owner" is a plain append.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.stream import Readers, StreamReader
from tests.support.api import until
from tests.support.logcheck import check_view
from tests.support.sse import Frame, parse_frame

FENCE = "owner-1"


@pytest.fixture
async def buffer(redis: Redis) -> AsyncIterator[EventBuffer]:
    yield EventBuffer(redis=redis, prefix=f"c{uuid.uuid4().hex[:6]}")


async def create(buffer: EventBuffer) -> str:
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner=FENCE,
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    return execution_id


def event(execution_id: str, event_id: int, kind: str = "block:chunk") -> Event:
    data: dict[str, object] = {"blockId": "b", "text": f"t{event_id}"}
    if kind == "execution:started":
        data = {"input": None}
    elif kind == "execution:cancelled":
        data = {"reason": "cancelled"}
    return Event(id=event_id, type=kind, execution_id=execution_id, workflow_id="wf", data=data)


async def store_a_short_cancelled_log(buffer: EventBuffer, execution_id: str) -> Event:
    """Ids 1-3 then the terminal event 4: the run ended below ids shown elsewhere."""
    events = [event(execution_id, 1, "execution:started"), event(execution_id, 2)]
    events += [event(execution_id, 3), event(execution_id, 4, "execution:cancelled")]
    await buffer.append(execution_id, events, fence=FENCE, meta={"status": "cancelled"})
    return events[-1]


async def read_frames(reader: StreamReader) -> list[Frame]:
    data = b"".join([chunk async for chunk in reader.frames()])
    return [parse_frame(raw) for raw in data.split(b"\n\n") if raw]


async def test_a_cursor_above_a_finished_log_gets_its_terminal_event(
    buffer: EventBuffer,
) -> None:
    execution_id = await create(buffer)
    terminal = await store_a_short_cancelled_log(buffer, execution_id)
    async with Readers(buffer=buffer) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=9)
        await reader.open()
        frames = await asyncio.wait_for(read_frames(reader), 10)
    assert [(frame.id, frame.event) for frame in frames] == [("4", "execution:cancelled")]
    assert frames[0].json == orjson.loads(terminal.json)


async def test_readers_of_a_publisher_that_showed_unstored_ids_get_the_end_stored_below(
    buffer: EventBuffer,
) -> None:
    """The publisher here showed ids 1-10 and stored none; the log ends at 4. Once it
    detaches, its readers' tail hands them the terminal event 4 and their streams end."""
    execution_id = await create(buffer)
    async with Readers(buffer=buffer) as live:
        publisher = live.hub.attach_local(execution_id, last_id=0)
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        await reader.open()  # attached before anything is published
        reading = asyncio.create_task(read_frames(reader))
        shown = [event(execution_id, 1, "execution:started")]
        shown += [event(execution_id, i) for i in range(2, 11)]
        for each in shown:
            publisher.publish(each)
        await until(lambda: reader.last_sent >= 10, "id 10 sent", 10, every=0.01)
        await store_a_short_cancelled_log(buffer, execution_id)
        publisher.detach(stored_id=0)
        frames = await asyncio.wait_for(reading, 10)
    assert [int(frame.id or 0) for frame in frames] == [*range(1, 11), 4]
    assert frames[-1].event == "execution:cancelled"
    assert check_view(frames[:-1]) == [orjson.loads(each.json) for each in shown]


async def test_readers_above_a_log_the_store_lost_and_ended_below_get_that_end(
    buffer: EventBuffer,
) -> None:
    """Found by the fault storm (step 17 session): the publisher here showed ids 1-10
    and its writer stored them all, then the store lost them (it came back empty) and
    another process ended the run at 4. The tail here believes 10 stored, so nothing
    told it its readers were above the log: their streams stayed open for good. An idle
    tail looks at the stored log now and hands them the end stored below."""
    execution_id = await create(buffer)
    async with Readers(buffer=buffer, tail_block_ms=200) as live:
        publisher = live.hub.attach_local(execution_id, last_id=0)
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
        await reader.open()
        reading = asyncio.create_task(read_frames(reader))
        shown = [event(execution_id, 1, "execution:started")]
        shown += [event(execution_id, i) for i in range(2, 11)]
        for each in shown:
            publisher.publish(each)
        await until(lambda: reader.last_sent >= 10, "id 10 sent", 10, every=0.01)
        await store_a_short_cancelled_log(buffer, execution_id)
        publisher.detach(stored_id=10)  # what its writer had stored, before the loss
        frames = await asyncio.wait_for(reading, 10)
    assert [int(frame.id or 0) for frame in frames] == [*range(1, 11), 4]
    assert frames[-1].event == "execution:cancelled"
