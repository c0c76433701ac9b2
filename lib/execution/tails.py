"""The reader's tails (stream.py's private part): how the readers of this process learn
what another process stores, through one notify subscription per process and one tail
per execution.

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

The same pub/sub connection listens to the ``status`` channel too: each execution's
status changes, for the live lists open in this process (``hub.statuses``, listing.py),
which are read again after a reconnect, like the tails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Self

from lib.backoff import Backoff
from lib.errors import FlowcastError, NotFound
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.hub import Channel, Hub, LocalPublisher
from lib.metrics import Metrics

log = logging.getLogger(__name__)

# How long tasks may take to stop when the process shuts down.
STOP_SECONDS = 2.0


class Tails:
    """This process's tails: the notify subscription, and one tail per execution
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
        wakes: Mapping[str, asyncio.Event] | None = None,
    ) -> None:
        self.buffer = buffer
        # Other channels heard on the same subscription: each sets its event on every
        # message, and on every (re)subscription, when a message may have been missed
        # (the webhook deliverer's wake, lib/webhooks/deliver.py).
        self.wakes = dict(wakes or {})
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

    async def __aenter__(self) -> Self:
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
        wakes: dict[str | bytes, asyncio.Event] = {}
        for name, event in self.wakes.items():
            wakes[name] = wakes[name.encode()] = event
        while not self._closed:
            pubsub = self.buffer.tail_redis.pubsub()
            try:
                await pubsub.subscribe(keys.notify, keys.status, *self.wakes)
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
                    if (wake := wakes.get(message["channel"])) is not None:
                        wake.set()
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
        for wake in self.wakes.values():
            wake.set()

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
                        async with asyncio.timeout(self.tail_block_ms / 1000):
                            await channel.wake.wait()
                        continue
                    except TimeoutError:
                        pass
                    missing_since = await self._check_idle(channel, missing_since)
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
            return False  # gone from the store: _check_idle ends its readers
        if meta.last_id > channel.last_published:
            return False  # stored meanwhile: the next read takes it
        if not meta.finished:
            channel.stored_last = max(channel.stored_last, meta.last_id)
            return False
        found = await self.buffer.after(channel.execution_id, after=meta.last_id - 1, count=1)
        if not found or not found[0].terminal:
            return False  # its terminal event is gone with the rest: see _check_idle
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

    async def _check_idle(self, channel: Channel, missing_since: float | None) -> float | None:
        """After an idle read: end the readers of an execution the store no longer has,
        or hand them the terminal event of one whose log ended below what they saw (the
        store lost what this process stored, so ``stored_last`` says nothing of it: a
        store that came back empty, the pause re-asserted there and ended by another
        process)."""
        ending = await self.buffer.ending(channel.execution_id)
        if ending is None:
            return self._gone(channel, missing_since)
        finished, last_id = ending
        if finished and last_id < channel.last_published:
            await self._terminal_below(channel)
        return None

    def _gone(self, channel: Channel, missing_since: float | None) -> float | None:
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
