"""In-process fan-out of live events to the stream readers attached to this process.

Each execution with readers here has one ``Channel``. Its events come from one of two
sources:

- local: this process runs the execution; the emitter publishes each event the moment
  it is emitted, before it is stored. A reader that attaches now also gets the events
  the writer has not stored yet, from memory (they are not in Redis yet).
- remote: another process runs it (or nobody does, while it is paused); one tail task
  per channel reads what was stored after its last event and publishes it, then waits
  to be woken. No polling and no Redis connection per tail: every batch stored
  publishes its execution id on the ``notify`` channel (append.lua), one pub/sub
  connection per process listens, and wakes the tail of that execution here. When
  that connection is lost and back, every tail reads again (a message sent meanwhile
  is lost, a stored event is not).

A reader may see an event twice at a seam (replay, memory, live); it drops every id it
has already sent. A reader that sees a hole in the ids fills it from Redis. A tail
starts from what is stored, never from a client's cursor, so no reader's cursor changes
what another gets; and a tail whose execution is gone from the store (it came back
empty and nobody recreated it) ends its readers' streams instead of waiting forever.
A tail that starts above the stored log (this process showed events it could not store
before another one took the execution over) still hands its readers the execution's
terminal event once it is stored, whatever its id: their streams end with it.

The same connection listens to the ``status`` channel too: each execution's status
changes, for the live lists of executions open in this process (``statuses``, see
listing.py), which are read again after a reconnect, like the tails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from lib.backoff import Backoff
from lib.errors import FlowcastError, NotFound
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.listing import StatusFeed
from lib.metrics import Metrics

log = logging.getLogger(__name__)

# A reader this far behind the live tail is cut loose; it catches up from the buffer.
MAX_QUEUED_EVENTS = 50_000
# How long tasks may take to stop when the process shuts down.
STOP_SECONDS = 2.0


class Subscription:
    """One reader's queue of live events."""

    __slots__ = ("_queue", "_wakeup", "channel", "closed", "overflowed")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._queue: deque[Event] = deque()
        self._wakeup = asyncio.Event()
        self.overflowed = False
        self.closed = False

    def push(self, event: Event) -> None:
        if self.overflowed:
            return
        if len(self._queue) >= MAX_QUEUED_EVENTS:
            # Dropping the queue is safe: the reader notices and re-reads from the buffer.
            self.overflowed = True
            self._queue.clear()
        else:
            self._queue.append(event)
        self._wakeup.set()

    def close(self) -> None:
        """Wake the reader for good (the server is shutting down)."""
        self.closed = True
        self._wakeup.set()

    async def wait(self) -> list[Event]:
        """Wait for live events and take all that are queued (none once closed)."""
        while not self._queue and not self.overflowed and not self.closed:
            self._wakeup.clear()
            await self._wakeup.wait()
        batch = list(self._queue)
        self._queue.clear()
        return batch


class Channel:
    """The readers of one execution in this process and where their events come from."""

    def __init__(self, hub: Hub, execution_id: str) -> None:
        self.hub = hub
        self.execution_id = execution_id
        self.subscribers: set[Subscription] = set()
        self.publisher: LocalPublisher | None = None
        self.unstored: Callable[[], list[Event]] = list
        self.last_published = 0
        # The highest id known stored; below last_published only after this process
        # showed events it did not store (see _terminal_below).
        self.stored_last = 0
        self.finished = False
        self.tail_task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()

    def publish(self, event: Event) -> None:
        if event.id <= self.last_published:
            return
        self.last_published = event.id
        if event.terminal:
            self.finished = True
        for subscriber in self.subscribers:
            subscriber.push(event)

    def publish_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.publish(event)

    def publish_end(self, terminal: Event) -> None:
        """Hand every reader the stored terminal event, though its id is at or below
        what was published here (they saw ids that were never stored)."""
        self.finished = True
        for subscriber in self.subscribers:
            subscriber.push(terminal)

    @property
    def local(self) -> bool:
        return self.publisher is not None

    def stop_tail(self) -> None:
        if self.tail_task is not None:
            self.tail_task.cancel()
            self.tail_task = None


class LocalPublisher:
    """The emitting side of a channel for an execution this process runs. What may be
    shown, and when, the writer decides (its reservation and the owner's live gate)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.execution_id = channel.execution_id

    def publish(self, event: Event) -> None:
        """Deliver an emitted event to the readers attached here."""
        if self._channel.publisher is self:
            self._channel.publish(event)

    def detach(self, *, stored_id: int | None = None) -> None:
        """This process stops running the execution (finished, paused or handed over);
        ``stored_id`` is the last id its writer stored (by default, all it published)."""
        channel = self._channel
        if channel.publisher is not self:
            return  # a later run of the same execution attached here since
        stored = channel.last_published if stored_id is None else stored_id
        channel.stored_last = max(channel.stored_last, stored)
        channel.publisher = None
        channel.unstored = list
        channel.hub._release(channel)


class Hub:
    """Owns the channels of this process and their tail tasks."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        tail_block_ms: int = 5_000,
        gone_seconds: float = 15.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.buffer = buffer
        self.metrics = metrics
        self.tail_block_ms = tail_block_ms
        # How long an execution must stay missing before its tails give up on it: an
        # owner recreates what the store lost within a third of a lease.
        self.gone_seconds = gone_seconds
        self._channels: dict[str, Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.statuses = StatusFeed()

    async def __aenter__(self) -> Hub:
        listener = asyncio.create_task(self._listen(), name="hub:notify")
        self._tasks.add(listener)
        listener.add_done_callback(self._tasks.discard)
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

    def _channel(self, execution_id: str) -> Channel:
        channel = self._channels.get(execution_id)
        if channel is None:
            channel = self._channels[execution_id] = Channel(self, execution_id)
        return channel

    def _release(self, channel: Channel) -> None:
        if not channel.subscribers and not channel.local:
            channel.stop_tail()
            self._channels.pop(channel.execution_id, None)
        elif channel.subscribers and not channel.local:
            self.ensure_tail(channel.execution_id, after=channel.stored_last)

    def attach_local(
        self,
        execution_id: str,
        *,
        last_id: int,
        unstored: Callable[[], list[Event]],
    ) -> LocalPublisher:
        """Make this process the source of an execution's live events.

        ``unstored`` gives the emitted events the writer has not stored yet.
        """
        channel = self._channel(execution_id)
        channel.stop_tail()
        channel.finished = False
        channel.unstored = unstored
        channel.last_published = last_id
        channel.stored_last = 0
        channel.publisher = LocalPublisher(channel)
        return channel.publisher

    def unstored(self, execution_id: str) -> list[Event]:
        """Events emitted here and not stored yet (empty unless this process runs it)."""
        channel = self._channels.get(execution_id)
        return channel.unstored() if channel is not None else []

    def subscribe(self, execution_id: str) -> tuple[Subscription, list[Event]]:
        """Attach a reader; returns its queue and the emitted events not yet stored."""
        channel = self._channel(execution_id)
        subscription = Subscription(channel)
        channel.subscribers.add(subscription)
        return subscription, channel.unstored()

    def unsubscribe(self, subscription: Subscription) -> None:
        channel = subscription.channel
        channel.subscribers.discard(subscription)
        if not channel.subscribers:
            self._release(channel)

    def ensure_tail(self, execution_id: str, *, after: int) -> None:
        """Follow the stored events after ``after`` unless this process runs the execution.

        Called by a reader once its replay reached ``after``, a stored id (never a
        client's own cursor): every event past it will then arrive through the channel,
        so no event falls between replay and live.
        """
        channel = self._channels.get(execution_id)
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
                        self.statuses.publish(message["data"])
                        continue
                    channel = self._channels.get(_text(message["data"]))
                    if channel is not None:
                        channel.wake.set()
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
        for channel in self._channels.values():
            channel.wake.set()
        self.statuses.invalidate_all()

    async def _tail(self, channel: Channel) -> None:
        backoff = Backoff(base=0.05, cap=5.0)
        missing_since: float | None = None
        while channel.subscribers and not channel.local:
            try:
                # Cleared before reading: a wake-up during the read means "read again".
                channel.wake.clear()
                events = await self.buffer.after(channel.execution_id, after=channel.last_published)
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
            for subscriber in list(channel.subscribers):
                subscriber.close()
        return missing_since


def _text(data: bytes | str) -> str:
    return data.decode() if isinstance(data, bytes) else data
