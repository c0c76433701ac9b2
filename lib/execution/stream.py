"""The reader: one client's events of one execution, from its cursor to the terminal
event, as SSE frames; replay, live tail and gap fill in this one place.

The path of one event, module by module, each hop handing it down and never back up:

    executor      emits it (``ExecutionLog.emit``): never waits
      │
    log.py        gives it its id, compacts a large value (in order), queues it; the
      │           log's flush (flush.py, private to it) writes the queue as one fenced
      │           batch to the buffer and, once the buffer reserved its id (stored,
      │           for the run's last event) while the owner's live gate is open,
      │           shows it to the channel here
      ├──────────► hub.py: the channel of this process keeps what is shown and not
      │           stored yet, and queues it for each reader here
    buffer.py     append.lua stores the batch atomically (ids, ring, status, fencing)
      │  + append.lua   and PUBLISHes it on the notify channel: the batch's events
      │           themselves when small (``INLINE_BYTES``), its execution id alone above
      │
    stream.py     here: its tails (tails.py, one subscription per process) hear the
      │           notify channel; a reader on another process gets the published
      │           events straight into its channel (hub.py), with no read back; a hole
      │           in the ids, a large batch or a lost connection makes the tail read.
      │           ``StreamReader`` replays after the client's cursor, then takes the
      │           channel's queue, drops ids it sent, fills a hole from the buffer or
      │           tells it as a ``replay:gap``, and turns each event into its frame
      │
    app/sse.py    writes the frames to the client (heartbeat, time cap, shutdown)

events.py is the vocabulary every hop shares (the event, its JSON, its frame), not a
hop. A reader attaches in an order that makes the seam exact: it subscribes to its
channel first, then replays from Redis, then takes the shown-but-unstored events the
channel held at subscribe time, then the live queue. Every event appears in at least
one of those; ids already sent are dropped, and a hole in the ids is filled from Redis
or reported as a ``replay:gap`` (``evicted`` by the ring, or ``dropped`` during an
outage). A client is never silently skipped past events.

The tails (tails.py, private to this module: one notify subscription per process, and
one tail per execution another process runs) feed the channels of the readers here;
``Readers`` is them, with the readers they serve.

A client's cursor is its own: it may be above every stored id (the client saw live
events that are not stored yet, or it is simply odd). Such a reader skips what it has
seen, follows the tail from what is stored, and still ends at the terminal event,
whatever its id: a terminal event stored below the cursor is sent all the same, so
that client too learns how the execution ended (SPEC §5). An execution that
disappears from the store ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable

import orjson

from lib.errors import BufferUnavailable, NotFound
from lib.execution.events import Event, sse_frame
from lib.execution.hub import Channel, Subscription
from lib.execution.record import ExecutionMeta, Page
from lib.execution.tails import Tails
from lib.metrics import Metrics

log = logging.getLogger(__name__)

REPLAY_PAGE = 1_000
GAP_EVENT = "replay:gap"
QUEUE_EVENT = "queue"
# How often a queued execution's stream looks at its place in line (SPEC §4 "Queued":
# a frame at most once a second, when it changed).
QUEUE_SECONDS = 1.0

# A queued execution's place in line: (tenant, execution id) -> ahead, None once it
# left the line (the queue's ``ahead``).
Place = Callable[[str, str], Awaitable[int | None]]


def queue_frame(ahead: int) -> bytes:
    """A queued execution's place in line, with no id (no event id is used)."""
    return sse_frame(None, QUEUE_EVENT, orjson.dumps({"state": "queued", "ahead": ahead}))


def gap_frame(after: int, resume_at: int, reason: str, metrics: Metrics | None = None) -> bytes:
    """The frame that tells a client events after ``after`` will not be sent."""
    if metrics is not None:
        metrics.replay_gaps.labels(reason).inc()
    body = orjson.dumps({"after": after, "resumeAt": resume_at, "reason": reason})
    return sse_frame(None, GAP_EVENT, body)


class Readers(Tails):
    """This process's readers: its tails (tails.py), and a reader for each client."""

    # Where a queued execution stands in line (the runner's queue), once there is one.
    place: Place | None = None

    def reader(self, execution_id: str, *, cursor: int) -> StreamReader:
        """A reader of ``execution_id`` from ``cursor`` on."""
        return StreamReader(readers=self, execution_id=execution_id, cursor=cursor)


class StreamReader:
    """One client's view of one execution's events, from a cursor to the terminal event."""

    def __init__(self, *, readers: Readers, execution_id: str, cursor: int) -> None:
        self._readers = readers
        self._buffer = readers.buffer
        self._hub = readers.hub
        self._metrics = readers.metrics
        self._execution_id = execution_id
        self.last_sent = cursor
        self._stored_last = 0  # the last stored id, as the newest read saw it
        self.finished = False
        self.closed = False
        self._subscription: Subscription | None = None
        self._attached: tuple[Subscription, list[Event], Page] | None = None
        # A queued execution's tenant (its line), and the place last told; None once
        # it started (or was never queued).
        self._line: str | None = None
        self._ahead: int | None = None
        self._told = b""  # a queue frame to send before the next events

    async def open(self) -> ExecutionMeta:
        """Attach and read the first page now, in that order (so nothing falls between
        them), and return the execution's metadata; the frames start from there. One
        read instead of a metadata read and then the replay's first page.

        NotFound when the execution does not exist. A reader opened and never iterated
        must be let go with :meth:`detach`."""
        subscription, unstored = self._hub.subscribe(self._execution_id)
        try:
            page = await self._buffer.read(
                self._execution_id, after=self.last_sent, limit=REPLAY_PAGE
            )
        except BaseException:
            self._hub.unsubscribe(subscription)
            raise
        self._attached = (subscription, unstored, page)
        if page.meta.status == "queued" and self._readers.place is not None:
            self._line = page.meta.tenant
        return page.meta

    def detach(self) -> None:
        """Let go of what :meth:`open` attached, if the frames never took it over."""
        attached, self._attached = self._attached, None
        if attached is not None:
            self._hub.unsubscribe(attached[0])

    def close(self) -> None:
        """End the stream at the next frame boundary (the server is shutting down, or
        the client left)."""
        self.closed = True
        if self._subscription is not None:
            self._subscription.close()

    async def frames(self) -> AsyncGenerator[bytes]:
        """SSE frames until the terminal event, or until closed (the client left, the
        server stops, the connection's time cap in ``app/sse.py``)."""
        while not self.finished and not self.closed:
            page: Page | None = None
            if self._attached is not None:
                (subscription, unstored, page), self._attached = self._attached, None
            else:
                subscription, unstored = self._hub.subscribe(self._execution_id)
            self._subscription = subscription
            if self._line is not None:
                chunk = await self._place_in_line()
                if chunk:
                    yield chunk
            replay = self._replay(unstored, page, self._stored_here(subscription.channel))
            # Held for the stream's life otherwise: a suspended frame keeps its locals.
            del unstored, page
            try:
                async for chunk in replay:
                    yield chunk
                if self.finished:
                    return
                # From what is stored: a cursor above it must not move the shared tail.
                after = min(self.last_sent, self._stored_last)
                async for chunk in self._live(subscription, after):
                    yield chunk
                if not subscription.overflowed:
                    return
                # Too slow for the live queue: attach again and catch up from the buffer.
            except NotFound:
                return  # the store lost the execution and nobody recreated it
            except BufferUnavailable as exc:
                # End at a frame boundary: the client reconnects with Last-Event-ID.
                log.warning(
                    "stream ended: the buffer failed",
                    extra={"executionId": self._execution_id, "error": str(exc)},
                )
                return
            finally:
                self._hub.unsubscribe(subscription)

    def _stored_here(self, channel: Channel) -> int | None:
        """The last stored id when this process runs the execution and the store holds
        nothing after the cursor (a stream that starts with its execution): the replay
        then needs no read, what follows is in memory or comes live. None otherwise."""
        publisher = channel.publisher
        if publisher is None or channel.finished or publisher.stored_id > self.last_sent:
            return None
        return publisher.stored_id

    async def _replay(
        self, unstored: list[Event], first: Page | None, stored_here: int | None = None
    ) -> AsyncIterator[bytes]:
        if first is None and stored_here is not None:
            self._stored_last = stored_here
            chunk = await self._accept_live(unstored)
            if chunk:
                yield chunk
            return
        while not self.finished:
            page, first = first, None
            if page is None:
                page = await self._buffer.read(
                    self._execution_id, after=self.last_sent, limit=REPLAY_PAGE
                )
            self._stored_last = page.meta.last_id
            chunk = self._accept(page.events, page)
            if chunk:
                yield chunk
            if page.meta.finished and self.last_sent >= page.meta.last_id:
                if self.last_sent > page.meta.last_id:
                    chunk = await self._terminal_below(page.meta.last_id)
                    if chunk:
                        yield chunk
                self.finished = True  # the cursor is at or past the terminal event
            if len(page.events) < REPLAY_PAGE or self.closed:
                break
        if not self.finished and unstored:
            chunk = await self._accept_live(unstored)
            if chunk:
                yield chunk

    async def _live(self, subscription: Subscription, after: int) -> AsyncIterator[bytes]:
        while not self.finished and not subscription.overflowed and not self.closed:
            # Again on every wake: when the run here lets go, the channel follows the
            # buffer from what it stored (its readers are woken for that).
            channel = subscription.channel
            self._readers.ensure_tail(self._execution_id, after=max(after, channel.stored_last))
            batch = await self._wait(subscription)
            if batch is None:
                return
            told, self._told = self._told, b""
            if told:
                yield told
            chunk = await self._accept_live(batch)
            if chunk:
                yield chunk

    async def _wait(self, subscription: Subscription) -> list[Event] | None:
        # The time cap is one timer per connection (app/sse.py closes us), not one per wait.
        if self._line is not None:
            return await self._wait_in_line(subscription)
        batch = await subscription.wait()
        # Closed: the server shuts down, or the tail found the execution gone.
        return None if (self.closed or subscription.closed) and not batch else batch

    async def _wait_in_line(self, subscription: Subscription) -> list[Event] | None:
        """Wait for the first events of a queued execution, looking at its place in line
        each second: a change is a frame (``_told``, sent by ``_live`` before the next
        events), given out with an empty batch."""
        while self._line is not None:
            try:
                async with asyncio.timeout(QUEUE_SECONDS):
                    batch = await subscription.wait()
            except TimeoutError:
                self._told = await self._place_in_line()
                if self._told:
                    return []
                continue
            return None if (self.closed or subscription.closed) and not batch else batch
        return await self._wait(subscription)

    async def _place_in_line(self) -> bytes:
        """A ``queue`` frame when the place in line changed; none once it left the line."""
        place = self._readers.place
        if self._line is None or place is None:
            return b""
        try:
            ahead = await place(self._line, self._execution_id)
        except BufferUnavailable:
            return b""  # told again next second
        if ahead is None:
            self._line = None  # taken (its first events follow) or cancelled
            return b""
        if ahead == self._ahead:
            return b""
        self._ahead = ahead
        return queue_frame(ahead)

    async def _accept_live(self, events: Iterable[Event]) -> bytes:
        """Frames for live events, filling any hole in the ids from the buffer first."""
        parts: list[bytes] = []
        latency = self._metrics.stream_latency if self._metrics is not None else None
        now = time.monotonic()
        for event in events:
            if self.finished:
                break
            if event.id <= self.last_sent:
                if event.terminal:
                    if event.id < self.last_sent:
                        parts.append(event.frame)  # ended below what this client saw
                    self.finished = True
                continue
            if event.id > self.last_sent + 1:
                await self._fill(event.id, parts)
            parts.append(event.frame)
            self.last_sent = event.id
            if latency is not None and event.created:
                latency.observe(now - event.created)
            if event.terminal:
                self.finished = True
        return b"".join(parts)

    async def _terminal_below(self, last_id: int) -> bytes:
        """The frame of the stored terminal event ``last_id``, for a cursor above it."""
        found = await self._buffer.after(self._execution_id, after=last_id - 1, count=1)
        if found and found[0].terminal:
            return found[0].frame
        return b""

    async def _fill(self, before: int, parts: list[bytes]) -> None:
        """Send the events between the last one sent and ``before``: stored ones from the
        buffer, then those this process emitted and has not stored yet, from memory."""
        pending = [e for e in self._hub.unstored(self._execution_id) if e.id < before]
        stored_before = pending[0].id if pending else before
        page: Page | None = None
        while self.last_sent + 1 < stored_before:
            page = await self._buffer.read(
                self._execution_id, after=self.last_sent, limit=REPLAY_PAGE
            )
            wanted = [event for event in page.events if event.id < stored_before]
            parts.append(self._accept(wanted, page))
            if len(wanted) < len(page.events) or len(page.events) < REPLAY_PAGE:
                break
        if pending:
            if self.last_sent + 1 < pending[0].id:
                reason = page.gap_reason(self.last_sent, pending[0].id) if page else "dropped"
                parts.append(gap_frame(self.last_sent, pending[0].id, reason, self._metrics))
                self.last_sent = pending[0].id - 1
            for event in pending:
                if event.id > self.last_sent:
                    parts.append(event.frame)
                    self.last_sent = event.id
        if self.last_sent + 1 < before:
            reason = page.gap_reason(self.last_sent, before) if page else "dropped"
            parts.append(gap_frame(self.last_sent, before, reason, self._metrics))

    def _accept(self, events: list[Event], page: Page) -> bytes:
        """Frames for stored events in id order, with a gap frame before any hole."""
        parts: list[bytes] = []
        for event in events:
            if event.id <= self.last_sent:
                if event.terminal:
                    self.finished = True
                    break
                continue
            if event.id > self.last_sent + 1:
                reason = page.gap_reason(self.last_sent, event.id)
                parts.append(gap_frame(self.last_sent, event.id, reason, self._metrics))
            parts.append(event.frame)
            self.last_sent = event.id
            if event.terminal:
                self.finished = True
                break
        return b"".join(parts)
