"""The per-process registry of live channels: who in this process reads which
execution's live events, and where those events come from.

Each execution with readers here (or run here) has one ``Channel``. Its events come
from one of two sources, and the registry itself reads nothing and starts nothing:

- local: this process runs the execution; its log (log.py) publishes each event the
  moment it may be shown, before it is stored, and tells the channel what is stored.
  The channel keeps the events shown and not stored yet, so a reader attaching now
  gets them from memory (they are not in Redis yet) without asking the writer.
- remote: another process runs it (or nobody does, while it is paused); the reader
  module's tail (stream.py) feeds the channel from the notify messages and the buffer.

A channel also keeps what a tail needs to know where it stands: the last id published
and the last known stored. The registry keeps the live lists' feed (``statuses``) too,
which the same notify subscription feeds (listing.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from lib.execution.events import Event
from lib.execution.listing import StatusFeed

# A reader this far behind the live tail is cut loose; it catches up from the buffer.
MAX_QUEUED_EVENTS = 50_000


class Subscription:
    """One reader's queue of live events."""

    __slots__ = ("_queue", "_wakeup", "channel", "closed", "moved", "overflowed")

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._queue: deque[Event] = deque()
        self._wakeup = asyncio.Event()
        self.overflowed = False
        self.closed = False
        # The channel's source changed (its local run let go): the reader looks again.
        self.moved = False

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

    def nudge(self) -> None:
        """Wake the reader with no event: the channel's source changed."""
        self.moved = True
        self._wakeup.set()

    def close(self) -> None:
        """Wake the reader for good: its stream ends at a frame boundary (the server is
        shutting down, or nothing more can be learnt here: see ``Channel.end_readers``)."""
        self.closed = True
        self._wakeup.set()

    async def wait(self) -> list[Event]:
        """Wait for live events and take all that are queued (none once closed or moved)."""
        while not self._queue and not self.overflowed and not self.closed and not self.moved:
            self._wakeup.clear()
            await self._wakeup.wait()
        self.moved = False
        batch = list(self._queue)
        self._queue.clear()
        return batch


class Channel:
    """The readers of one execution in this process and where their events come from."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        self.subscribers: set[Subscription] = set()
        self.publisher: LocalPublisher | None = None
        # Shown by the local run and not stored yet, oldest first (empty when remote).
        self.unstored: deque[Event] = deque()
        self.last_published = 0
        # The highest id known stored; below last_published only after this process
        # showed events it did not store (a tail then looks for the terminal event).
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

    def end_readers(self) -> None:
        """End every reader's stream at a frame boundary, the execution still going on:
        EventSource reconnects with Last-Event-ID, to a process that can tell it more."""
        for subscriber in list(self.subscribers):
            subscriber.close()

    def stop_tail(self) -> None:
        if self.tail_task is not None:
            self.tail_task.cancel()
            self.tail_task = None


class LocalPublisher:
    """The emitting side of a channel for an execution this process runs. What may be
    shown, and when, the log decides (its reservation and the owner's live gate)."""

    def __init__(
        self,
        hub: Hub,
        channel: Channel,
        stored_id: int,
        lease_held: Callable[[], bool] = lambda: True,
    ) -> None:
        self._hub = hub
        self._channel = channel
        self.execution_id = channel.execution_id
        self._stored = stored_id  # the last id its log stored, as it told
        # Whether the owner here knows its lease held (its live gate is open): while it
        # does not, this run shows nothing, and another process may be running it.
        self.lease_held = lease_held

    @property
    def stored_id(self) -> int:
        """The last id this run's log stored (the store holds nothing above it)."""
        return self._stored

    def publish(self, event: Event) -> None:
        """Deliver an event that may be shown to the readers attached here."""
        channel = self._channel
        if channel.publisher is self and event.id > channel.last_published:
            if event.id > self._stored:
                channel.unstored.append(event)
            channel.publish(event)

    def stored(self, last_id: int) -> None:
        """The log stored every event up to ``last_id``: memory no longer holds them."""
        channel = self._channel
        if channel.publisher is not self:
            return
        self._stored = max(self._stored, last_id)
        unstored = channel.unstored
        while unstored and unstored[0].id <= self._stored:
            unstored.popleft()

    def detach(self, *, stored_id: int | None = None) -> None:
        """This process stops running the execution (finished, paused or handed over);
        ``stored_id`` is the last id its writer stored (by default, all it published).
        Its readers are woken to follow the buffer from there."""
        channel = self._channel
        if channel.publisher is not self:
            return  # a later run of the same execution attached here since
        stored = channel.last_published if stored_id is None else stored_id
        channel.stored_last = max(channel.stored_last, stored)
        channel.publisher = None
        channel.unstored.clear()
        if not channel.subscribers:
            self._hub.forget(channel)
        for subscriber in channel.subscribers:
            subscriber.nudge()


class Hub:
    """This process's channels of live events, by execution, and its live lists' feed."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        self.statuses = StatusFeed()

    def __iter__(self) -> Iterator[Channel]:
        return iter(list(self._channels.values()))

    def get(self, execution_id: str) -> Channel | None:
        return self._channels.get(execution_id)

    def _channel(self, execution_id: str) -> Channel:
        channel = self._channels.get(execution_id)
        if channel is None:
            channel = self._channels[execution_id] = Channel(execution_id)
        return channel

    def forget(self, channel: Channel) -> None:
        """Drop a channel nobody reads or runs here any more."""
        if not channel.subscribers and not channel.local:
            channel.stop_tail()
            if self._channels.get(channel.execution_id) is channel:
                del self._channels[channel.execution_id]

    def attach_local(
        self,
        execution_id: str,
        *,
        last_id: int,
        stored_id: int = 0,
        lease_held: Callable[[], bool] = lambda: True,
    ) -> LocalPublisher:
        """Make this process the source of an execution's live events, from ``last_id``
        (the ids above it are its log's); ``stored_id`` is the last id the store holds,
        ``lease_held`` whether its owner here knows its lease held."""
        channel = self._channel(execution_id)
        channel.stop_tail()
        channel.finished = False
        channel.unstored.clear()
        channel.last_published = last_id
        channel.stored_last = 0
        channel.publisher = LocalPublisher(self, channel, stored_id, lease_held)
        return channel.publisher

    def unstored(self, execution_id: str) -> list[Event]:
        """Events shown here and not stored yet (empty unless this process runs it)."""
        channel = self._channels.get(execution_id)
        return list(channel.unstored) if channel is not None else []

    def subscribe(self, execution_id: str) -> tuple[Subscription, list[Event]]:
        """Attach a reader; returns its queue and the shown events not yet stored."""
        channel = self._channel(execution_id)
        subscription = Subscription(channel)
        channel.subscribers.add(subscription)
        return subscription, list(channel.unstored)

    def unsubscribe(self, subscription: Subscription) -> None:
        channel = subscription.channel
        channel.subscribers.discard(subscription)
        self.forget(channel)
