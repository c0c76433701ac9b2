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
    stream.py     here: ``Readers`` (one per process) hears the notify channel; a
      │           reader on another process gets the published events straight into
      │           its channel (hub.py), with no read back; a hole in the ids, a large
      │           batch or a lost connection makes its tail read the buffer instead.
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

The tails: for an execution another process runs (or nobody, while it is paused), one
tail task per channel reads what was stored after its last event, then waits to be
woken by the notify channel (one pub/sub connection per process, no polling). When
that connection is lost and back, every tail reads again (a message sent meanwhile is
lost, a stored event is not). A tail starts from what is stored, never from a client's
cursor, so no reader's cursor changes what another gets; a tail whose execution is
gone from the store (it came back empty and nobody recreated it) ends its readers'
streams instead of waiting forever; a tail that starts above the stored log (this
process showed events it could not store before another one took over) still hands
its readers the terminal event once it is stored, whatever its id.

A stream that can learn nothing more here ends, so that its client reconnects, maybe
to a process that can tell it more (SPEC §7: every open stream ends within about a
lease): a tail whose reads of the store have kept failing for a lease
(``cutoff_seconds``), and a run here whose owner has not held its lease for as long (its
live gate closed: it shows nothing more, and has no tail to read what another process
that took it over stores) when one read of the store fails too. It ends at a frame
boundary, as at the time cap, and EventSource reconnects with Last-Event-ID. An outage
for everyone shorter than a lease ends no stream, nor does a quiet one.

A client's cursor is its own: it may be above every stored id (the client saw live
events that are not stored yet, or it is simply odd). Such a reader skips what it has
seen, follows the tail from what is stored, and still ends at the terminal event,
whatever its id: a terminal event stored below the cursor is sent all the same, so
that client too learns how the execution ended (SPEC §5). An execution that
disappears from the store ends the stream.

The same pub/sub connection listens to the ``status`` channel too: each execution's
status changes, for the live lists open in this process (``hub.statuses``, listing.py),
which are read again after a reconnect, like the tails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable

import orjson

from lib.backoff import Backoff
from lib.errors import BufferUnavailable, FlowcastError, NotFound
from lib.execution.buffer import EventBuffer, ExecutionMeta, Page
from lib.execution.events import Event, sse_frame
from lib.execution.hub import Channel, Hub, LocalPublisher, Subscription
from lib.metrics import Metrics

log = logging.getLogger(__name__)

# How long tasks may take to stop when the process shuts down.
STOP_SECONDS = 2.0

REPLAY_PAGE = 1_000
GAP_EVENT = "replay:gap"


def gap_frame(after: int, resume_at: int, reason: str, metrics: Metrics | None = None) -> bytes:
    """The frame that tells a client events after ``after`` will not be sent."""
    if metrics is not None:
        metrics.replay_gaps.labels(reason).inc()
    body = orjson.dumps({"after": after, "resumeAt": resume_at, "reason": reason})
    return sse_frame(None, GAP_EVENT, body)


class Readers:
    """This process's readers: the notify subscription, and one tail per execution
    followed from the buffer (see the module doc)."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub | None = None,
        tail_block_ms: int = 5_000,
        gone_seconds: float = 15.0,
        cutoff_seconds: float = 15.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.buffer = buffer
        self.hub = hub or Hub()
        self.metrics = metrics
        self.tail_block_ms = tail_block_ms
        # How long an execution must stay missing before its tails give up on it: an
        # owner recreates what the store lost within a third of a lease.
        self.gone_seconds = gone_seconds
        # How long a stream may go without any way to learn more (the store out of reach
        # from here, and no lease held here) before it ends, so that its client
        # reconnects, maybe to a process that can reach the store (SPEC §7): a lease.
        self.cutoff_seconds = cutoff_seconds
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __aenter__(self) -> Readers:
        for work, name in (
            (self._listen(), "readers:notify"),
            (self._watch_owners(), "readers:owners"),
        ):
            task = asyncio.create_task(work, name=name)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a task stuck in a client library that ignores the cancel must
            # not keep the process from exiting.
            _done, stuck = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            if stuck:
                log.warning("tail tasks did not stop", extra={"count": len(stuck)})

    def reader(self, execution_id: str, *, cursor: int) -> StreamReader:
        """A reader of ``execution_id`` from ``cursor`` on."""
        return StreamReader(readers=self, execution_id=execution_id, cursor=cursor)

    def ensure_tail(self, execution_id: str, *, after: int) -> None:
        """Follow the stored events after ``after`` unless this process runs the execution.

        Called by a reader once its replay reached ``after``, a stored id (never a
        client's own cursor): every event past it will then arrive through the channel,
        so no event falls between replay and live.
        """
        channel = self.hub.get(execution_id)
        if (
            channel is None
            or channel.local
            or channel.finished
            or channel.tail_task is not None
            or self._closed
        ):
            return
        channel.last_published = max(channel.last_published, after)
        channel.stored_last = max(channel.stored_last, after)
        task = asyncio.create_task(self._tail(channel), name=f"tail:{execution_id}")
        channel.tail_task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _heard(self, data: bytes | str) -> None:
        """One notify message: an execution id alone (read the buffer), or a small
        batch's events themselves (append.lua), forwarded here without a read."""
        raw = data if isinstance(data, bytes) else data.encode()
        execution_id, newline, rest = raw.partition(b"\n")
        channel = self.hub.get(execution_id.decode())
        if channel is None or channel.local:
            return
        if not newline or channel.tail_task is None:
            channel.wake.set()
            return
        events = _inline_events(rest)
        if not events or events[0].id != channel.last_published + 1:
            # Not what follows the channel's last event (a hole, a batch after a drop,
            # or already read): the tail reads the buffer, which has it all.
            if events and events[-1].id > channel.last_published:
                channel.wake.set()
            return
        channel.stored_last = max(channel.stored_last, events[-1].id)
        channel.publish_all(events)
        if channel.finished:
            channel.wake.set()  # the tail sees its channel finished and ends

    async def _listen(self) -> None:
        """Wake the tail of every execution whose events were just stored, and hand
        status changes to the live lists.

        Every (re)connection of the subscription wakes every tail (and has every live
        list read again), also one the client library makes by itself inside a read: a
        message published while it was away is lost, a stored event is not. A
        subscription that has been silent for a while is asked for a PONG; one that
        does not answer in time (a connection dropped without a word, behind a NAT or a
        proxy) is replaced.
        """
        backoff = Backoff(base=0.05, cap=5.0)
        quiet = self.tail_block_ms / 1000
        loop = asyncio.get_running_loop()
        keys = self.buffer.keys
        # However the client hands the channel's name over (bytes unless it decodes).
        status = {keys.status, keys.status.encode()}
        while not self._closed:
            pubsub = self.buffer.tail_redis.pubsub()
            try:
                await pubsub.subscribe(keys.notify, keys.status)
                connection = getattr(pubsub, "connection", None)
                if connection is not None:
                    connection.register_connect_callback(self._reconnected)
                # Subscribed: whatever was stored before a message could arrive is
                # read now.
                self._wake_all()
                backoff.reset()
                heard = loop.time()
                asked: float | None = None
                while not self._closed:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=min(quiet, 1.0)
                    )
                    now = loop.time()
                    if message is None:
                        if asked is not None and now - asked > quiet:
                            raise TimeoutError(f"no PONG within {quiet:.1f} s")
                        if asked is None and now - heard > quiet:
                            asked = now
                            await pubsub.ping()
                        continue
                    heard, asked = now, None
                    if message["type"] != "message":
                        continue
                    if message["channel"] in status:
                        self.hub.statuses.publish(message["data"])
                        continue
                    self._heard(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("notify listener lost; reconnecting", extra={"error": str(exc)})
                await backoff.wait()
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call]

    def _reconnected(self, _connection: object) -> None:
        # A bound method: the client keeps connect callbacks by weak reference.
        self._wake_all()

    def _wake_all(self) -> None:
        for channel in self.hub:
            channel.wake.set()
        self.hub.statuses.invalidate_all()

    async def _tail(self, channel: Channel) -> None:
        backoff = Backoff(base=0.05, cap=5.0)
        missing_since: float | None = None
        # When the reads that keep failing began: a read begun a lease after that which
        # fails too means the store has been out of reach from here for a lease.
        failing_since: float | None = None
        while channel.subscribers and not channel.local and not channel.finished:
            attempt = time.monotonic()
            try:
                # Cleared before reading: a wake-up during the read means "read again".
                channel.wake.clear()
                events = await self.buffer.after(channel.execution_id, after=channel.last_published)
                failing_since = None
                if not events and channel.last_published > channel.stored_last:
                    if await self._terminal_below(channel):
                        break
                if not events:
                    try:
                        await asyncio.wait_for(channel.wake.wait(), self.tail_block_ms / 1000)
                        continue
                    except TimeoutError:
                        pass
                    missing_since = await self._check_gone(channel, missing_since)
                    if channel.finished:
                        break
                    continue
                missing_since = None
            except Exception as exc:
                # A buffer outage is expected and retried; anything else is a bug, logged
                # with its traceback, and retried too so readers are not left hanging.
                extra = {"executionId": channel.execution_id, "error": str(exc)}
                if isinstance(exc, FlowcastError):
                    log.warning("tail read failed; retrying", extra=extra)
                else:
                    log.exception("tail read failed; retrying", extra=extra)
                failing_since = attempt if failing_since is None else failing_since
                if attempt - failing_since >= self.cutoff_seconds:
                    self._cut_off(channel, "the buffer has been out of reach for a lease")
                    break
                await backoff.wait()
                continue
            backoff.reset()
            if events:
                channel.stored_last = events[-1].id
            channel.publish_all(events)
            if events and events[-1].terminal:
                break
        if channel.tail_task is asyncio.current_task():
            channel.tail_task = None

    async def _terminal_below(self, channel: Channel) -> bool:
        """The tail is above the stored log: True, with its readers handed the terminal
        event, when the log ended below what they saw."""
        try:
            meta = await self.buffer.meta(channel.execution_id)
        except NotFound:
            return False  # gone from the store: _check_gone ends its readers
        if meta.last_id > channel.last_published:
            return False  # stored meanwhile: the next read takes it
        if not meta.finished:
            channel.stored_last = max(channel.stored_last, meta.last_id)
            return False
        found = await self.buffer.after(channel.execution_id, after=meta.last_id - 1, count=1)
        if not found or not found[0].terminal:
            return False  # its terminal event is gone with the rest: see _check_gone
        log.warning(
            "the execution ended below ids shown here; handing its readers its end",
            extra={
                "executionId": channel.execution_id,
                "terminalId": meta.last_id,
                "shownId": channel.last_published,
            },
        )
        channel.publish_end(found[0])
        return True

    async def _check_gone(self, channel: Channel, missing_since: float | None) -> float | None:
        """After an idle read: end the readers of an execution the store no longer has."""
        if await self.buffer.exists(channel.execution_id):
            return None
        now = time.monotonic()
        if missing_since is None:
            return now
        if now - missing_since >= self.gone_seconds:
            log.warning(
                "execution gone from the buffer; ending its streams",
                extra={"executionId": channel.execution_id},
            )
            channel.finished = True
            channel.end_readers()
        return missing_since

    @staticmethod
    def _cut_off(channel: Channel, why: str) -> None:
        """End the streams of ``channel``, which nothing here can tell more: each client
        reconnects with its Last-Event-ID, maybe to a process that reaches the store."""
        log.warning(
            "ending streams that can learn nothing more here",
            extra={
                "executionId": channel.execution_id,
                "streams": len(channel.subscribers),
                "why": why,
            },
        )
        channel.end_readers()

    async def _watch_owners(self) -> None:
        """End the streams of the runs here whose owner lost its lease and cannot reach
        the store: such a run shows nothing more (its gate stays closed), and has no
        tail to read what another process, which may have taken it over, stores.

        A run whose gate has been closed for a lease is asked about by one read of the
        store: it fails when the store is still out of reach from here (an outage for
        everyone shorter than a lease never gets this far); it succeeds when the store
        is back, and then the owner renews its lease or, fenced out, lets go and its
        readers follow the buffer.
        """
        period = max(0.05, self.cutoff_seconds / 4)
        closed_since: dict[LocalPublisher, float] = {}
        while not self._closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            closed_since = {
                publisher: closed_since.get(publisher, now)
                for channel in self.hub
                if (publisher := channel.publisher) is not None
                and channel.subscribers
                and not channel.finished
                and not publisher.lease_held()
            }
            due = [
                publisher
                for publisher, since in closed_since.items()
                if now - since >= self.cutoff_seconds
            ]
            try:
                if due:
                    await asyncio.gather(*(self._ask_store(publisher) for publisher in due))
            except Exception:  # a bug: logged, and the watch goes on for the other runs
                log.exception("watching the owners here failed")

    async def _ask_store(self, publisher: LocalPublisher) -> None:
        try:
            await self.buffer.exists(publisher.execution_id)
        except FlowcastError as exc:
            channel = self.hub.get(publisher.execution_id)
            if channel is not None and channel.publisher is publisher:
                why = f"the lease here was lost and the buffer is out of reach: {exc}"
                self._cut_off(channel, why)


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
            chunk = await self._accept_live(batch)
            if chunk:
                yield chunk

    async def _wait(self, subscription: Subscription) -> list[Event] | None:
        # The time cap is one timer per connection (app/sse.py closes us), not one per wait.
        batch = await subscription.wait()
        # Closed: the server shuts down, or the tail found the execution gone.
        return None if (self.closed or subscription.closed) and not batch else batch

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


def _inline_events(rest: bytes) -> list[Event]:
    """The events of a notify message after its execution id: the first id, then each
    event's type and envelope, one per line (JSON envelopes hold no raw newline)."""
    first, _, pairs = rest.partition(b"\n")
    parts = pairs.split(b"\n")
    base = int(first)
    return [
        Event.stored(id=base + i, type=parts[2 * i].decode(), raw=parts[2 * i + 1])
        for i in range(len(parts) // 2)
    ]
