"""Live lists on a real Valkey: the status messages the scripts publish, and a reader's
frames (the list, then only the changes to what its client shows)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.listing import ListFilter, ListReader, StatusFeed
from tests.support.api import until
from tests.support.sse import Frame, parse_frame

TENANT = "t_list"


@pytest.fixture
async def buffer(redis: Redis) -> AsyncIterator[EventBuffer]:
    yield EventBuffer(redis=redis, prefix=f"l{uuid.uuid4().hex[:6]}")


@pytest.fixture
async def statuses(redis: Redis, buffer: EventBuffer) -> AsyncIterator[PubSub]:
    pubsub = redis.pubsub()
    await pubsub.subscribe(buffer.keys.status)
    yield pubsub
    await pubsub.aclose()  # type: ignore[no-untyped-call]


async def next_message(pubsub: PubSub, within: float = 0.5) -> dict[str, Any] | None:
    """The next status message, or None if none comes ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (left := deadline - loop.time()) > 0:
        # None also for the subscription's own confirmation, which it skips.
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if message is not None:
            return dict(orjson.loads(message["data"]))
    return None


async def create(
    buffer: EventBuffer, *, workflow_id: str = "wf", created_ms: int = 1, at: str = ""
) -> str:
    execution_id = f"ex_{uuid.uuid4().hex}"
    created_at = at or f"2026-01-01T00:00:{created_ms:02d}.000Z"
    await buffer.create(
        execution_id,
        workflow_id=workflow_id,
        tenant=TENANT,
        owner="owner-1",
        created_at=created_at,
        created_ms=created_ms,
    )
    return execution_id


def event(execution_id: str, event_id: int, kind: str = "block:chunk") -> Event:
    return Event(
        id=event_id, type=kind, execution_id=execution_id, workflow_id="wf", data={"text": "x"}
    )


async def test_start_and_status_changes_publish_the_row_and_chunks_publish_nothing(
    buffer: EventBuffer, statuses: PubSub
) -> None:
    execution_id = await create(buffer)
    started = await next_message(statuses)
    assert started == {
        "id": execution_id,
        "tenant": TENANT,
        "workflowId": "wf",
        "status": "running",
        "createdAt": "2026-01-01T00:00:01.000Z",
        "updatedAt": "2026-01-01T00:00:01.000Z",
        "lastEventId": 0,
    }
    for event_id in (1, 2, 3):
        await buffer.append(execution_id, [event(execution_id, event_id)], fence="owner-1")
    assert await next_message(statuses) is None

    done = event(execution_id, 4, "execution:completed")
    meta = {"status": "completed", "updatedAt": "2026-01-01T00:00:09.000Z"}
    await buffer.append(execution_id, [done], fence="owner-1", meta=meta)
    finished = await next_message(statuses)
    assert finished is not None
    assert finished["status"] == "completed"
    assert finished["updatedAt"] == "2026-01-01T00:00:09.000Z"
    assert finished["lastEventId"] == 4
    assert await next_message(statuses) is None


class Client:
    """A reader's frames as its client sees them, read as they come."""

    def __init__(self, reader: ListReader) -> None:
        self.reader = reader
        self._frames = reader.frames()

    async def next(self) -> Frame:
        async with asyncio.timeout(5):
            raw = await anext(self._frames)
        (frame,) = [parse_frame(part) for part in raw.split(b"\n\n") if part]
        return frame

    async def close(self) -> None:
        self.reader.close()
        await self._frames.aclose()


async def open_client(buffer: EventBuffer, feed: StatusFeed, wanted: ListFilter) -> Client:
    reader = ListReader(buffer=buffer, feed=feed, tenant=TENANT, wanted=wanted)
    await reader.open()
    return Client(reader)


def change(
    execution_id: str, status: str, created_ms: int, workflow_id: str = "wf", last_id: int = 9
) -> bytes:
    return orjson.dumps(
        {
            "id": execution_id,
            "tenant": TENANT,
            "workflowId": workflow_id,
            "status": status,
            "createdAt": f"2026-01-01T00:00:{created_ms:02d}.000Z",
            "updatedAt": "2026-01-01T00:01:00.000Z",
            "lastEventId": last_id,
        }
    )


async def test_a_reader_sends_the_list_then_only_what_changes_its_clients_view(
    buffer: EventBuffer,
) -> None:
    older, newer = await create(buffer, created_ms=1), await create(buffer, created_ms=2)
    feed = StatusFeed()
    client = await open_client(buffer, feed, ListFilter(limit=2, status="running"))
    try:
        first = await client.next()
        assert first.event == "executions"
        assert [row["id"] for row in first.json["executions"]] == [newer, older]
        assert first.id is None

        # Another tenant's change, another status for a row not shown, and a change
        # to an execution older than every row of the full list: nothing to send.
        feed.publish(change(older, "running", 1).replace(TENANT.encode(), b"t_other"))
        feed.publish(change("ex_unseen", "completed", 3))
        feed.publish(change("ex_ancient", "running", 0))
        # A newer one pushes the oldest row out, as the client's limit does.
        feed.publish(change("ex_new", "running", 5))
        frame = await client.next()
        assert (frame.event, frame.json["id"]) == ("execution", "ex_new")
        assert frame.json["status"] == "running"

        feed.publish(change(older, "completed", 1))  # not shown any more: nothing
        # Shown with its last id 0: a change no newer (it arrived while the list was
        # read) is not sent; a newer one leaves the filter.
        feed.publish(change(newer, "completed", 2, last_id=0))
        feed.publish(change(newer, "paused", 2))
        frame = await client.next()
        assert frame.event == "execution:unlisted"
        assert frame.json == {"id": newer, "status": "paused"}

        # The pub/sub connection came back: the list is read again, as stored.
        feed.invalidate_all()
        again = await client.next()
        assert again.event == "executions"
        assert [row["id"] for row in again.json["executions"]] == [newer, older]
    finally:
        await client.close()
    assert len(feed) == 0


async def test_the_workflow_filter_holds_for_the_list_and_the_changes(
    buffer: EventBuffer,
) -> None:
    mine = await create(buffer, workflow_id="mine", created_ms=1)
    await create(buffer, workflow_id="theirs", created_ms=2)
    feed = StatusFeed()
    client = await open_client(buffer, feed, ListFilter(workflow_id="mine"))
    try:
        assert [row["id"] for row in (await client.next()).json["executions"]] == [mine]
        feed.publish(change("ex_theirs", "running", 3, workflow_id="theirs"))
        feed.publish(change(mine, "completed", 1, workflow_id="mine"))
        frame = await client.next()
        assert (frame.event, frame.json["id"], frame.json["status"]) == (
            "execution",
            mine,
            "completed",
        )
    finally:
        await client.close()


async def test_one_tenant_reads_one_list_at_a_time_and_never_holds_every_read_slot() -> None:
    # A tenant with many lists open (each read can scan thousands of executions) waits
    # for its own reads; another tenant's read goes in beside it.
    feed = StatusFeed(list_reads=2)
    release = asyncio.Event()
    inside: list[str] = []

    async def read(tenant: str) -> None:
        async with feed.reading(tenant):
            inside.append(tenant)
            await release.wait()

    busy = [asyncio.create_task(read("noisy")) for _ in range(5)]
    other = asyncio.create_task(read("quiet"))
    await until(lambda: "quiet" in inside, "the quiet tenant reads", 5, every=0.01)
    assert inside.count("noisy") == 1  # the other four wait for it, holding no slot
    release.set()
    async with asyncio.timeout(5):
        await asyncio.gather(*busy, other)
    assert inside.count("noisy") == 5
    assert feed._tenant_reads == {}  # nothing kept for tenants that stopped reading


class BetweenPages(Redis):
    """A client on which ``between`` runs right after the first page of a tenant's index
    is read, before the reader asks for the next: starts (or listings taken back) that
    land while a list is read. The seam where the fault goes in; everything else is the
    real Valkey."""

    between: Callable[[], Awaitable[None]] | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        if str(args[0]).upper().startswith(("ZREVRANGE", "ZRANGE")) and self.between:
            between, self.between = self.between, None
            await between()
        return reply


@pytest.mark.parametrize("change_between", ["new starts", "listings taken back"])
async def test_a_list_read_while_the_index_changes_names_each_execution_once(
    valkey_url: str, buffer: EventBuffer, change_between: str
) -> None:
    # The list was read in pages by offset: 5 starts between two pages shifted the
    # index down, the next page named 5 executions again, and a live list's client
    # kept a stale copy of each ("running" beside "completed"); 5 listings taken back
    # shifted it up, and the list skipped 5 executions a reload shows.
    """Found by the step 15 runs beside a busy loop (issue 23 point 6): the flake of
    test_a_live_list_ends_up_as_a_reload_shows_it_after_a_burst_with_lost_messages."""
    listed = 150 if change_between == "new starts" else 250  # one page is 200
    ids = [await create(buffer, created_ms=ms) for ms in range(1, listed + 1)]
    newest_first = ids[::-1]
    client = BetweenPages.from_url(valkey_url)
    try:
        reading = EventBuffer(redis=client, prefix=buffer.keys.prefix)

        async def grow() -> None:
            for ms in range(1_000, 1_005):
                await create(buffer, created_ms=ms)

        async def shrink() -> None:
            await buffer.redis.zrem(buffer.keys.index(TENANT), *newest_first[:5])

        client.between = grow if change_between == "new starts" else shrink
        rows = await reading.recent_metas(TENANT, limit=400)
    finally:
        await client.aclose()
    names = [meta.id for meta in rows]
    assert client.between is None  # the change went in between two pages
    assert len(names) == len(set(names)), "an execution named twice"
    stayed = newest_first if change_between == "new starts" else newest_first[5:]
    assert [name for name in names if name in set(stayed)] == stayed
