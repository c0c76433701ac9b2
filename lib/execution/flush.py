"""The log's private flush: how one execution's events go from its log (log.py) to the
buffer, in order and in batches, and to the live readers here as soon as they may be
shown. Only log.py uses it.

The flush (``EventWriter``): an execution's events go to the buffer in order, in
batches, and to the live readers here as soon as they may be shown. Emitting never waits
for Redis. ``put`` queues the event; one flush task per execution writes whatever is
queued as one atomic batch. When Redis is idle the batch is a single event written at
once; under load the events that arrive while a write is in flight form the next batch,
so the write rate adapts without a timer.

What is shown live: an event whose id the buffer has reserved for this owner, while the
owner's ``LiveGate`` is open (its lease was renewed lately, and no renewal failed
since). A process that takes over numbers its events above every reserved id, so no
event a client saw here can ever be stored as another one. Each append reserves every
id emitted when it was sent, plus, in a burst (64 or more events arrived during the
previous append), as many again; so an event at a calm moment is shown once the append
that carries it is acknowledged (a crash then leaves no hole in the ids), and a burst
is shown as it is emitted, up to the block reserved (a crash in it is reported as a
dropped range). A new execution's first event (``execution:started``) is shown as it
is emitted too: start.lua reserved its id with the creation (``reserved``), so the
first frame waits for no append; a crash before it is stored leaves id 1 a dropped
gap, never another event's id. Past the reserved block events wait in memory, unshown, until an
append reserves them: while the buffer is unreachable from here, whether it is down
for everyone or only this process lost it (and another one may be taking over), no
event is shown that Redis has not reserved. The final event of a run
(``execution:paused`` or a terminal one) is shown only once stored: the store decides
whether a cancel accepted before it wins ("CANCEL"), and then the final event becomes
``execution:cancelled`` under the same id, never shown. ``shown_id`` is the highest id
shown: a hand-off records it, so the next owner numbers from there and the ids only
reserved are handed back instead of being reported as lost.

While the buffer is unreachable the batch in flight is retried as it is, with jittered
exponential backoff, and new events wait behind it. Past ``max_pending`` the oldest
waiting events are dropped; the next batch that reaches Redis records their id range
atomically with itself, so replay reports it as a ``dropped`` gap and the terminal
event still lands after everything before it. A store that comes back behind
(restarted from an older snapshot, a lagging replica promoted) or empty is told so by
the next batch: the writer records the ids it lost as dropped, recreates the metadata
if needed, writes the run's checkpoint back as it had stored it (with the batch,
atomically), and carries on above every id it handed out. No id is ever given to two
events.

The writer's state says what its next append must do: one ``WriterState``, changed
only through the table ``TRANSITIONS`` (outage.py, with the ``LiveGate``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

import orjson

from lib.backend import translating
from lib.backoff import Backoff
from lib.errors import BufferUnavailable, CancelWins, WriteGone, WriteOutOfOrder, WriteRefused
from lib.execution.buffer import EventBuffer
from lib.execution.ceiling import Ceiling
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    FINAL_TYPES,
    STATUS_AFTER,
    TERMINAL_TYPES,
    Event,
    utc_timestamp,
)
from lib.execution.hub import LocalPublisher
from lib.execution.outage import TRANSITIONS, LiveGate, Transition, WriterState
from lib.metrics import Metrics
from lib.tasks import stop
from lib.webhooks.outbox import hint
from lib.webhooks.spec import decoded

log = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1_000
MAX_BATCH_BYTES = 4 * 1024 * 1024
# Events piling up during one append that make a burst, shown ahead of the store.
BURST_EVENTS = 64
# Larger outcomes are not copied into the metadata: it names the event that holds them,
# so an execution's footprint stays its ring's budget plus a small constant.
META_INLINE_BYTES = 16 * 1024

Publish = Callable[[Event], None]


def batch_meta(batch: list[Event]) -> dict[str, str]:
    """Metadata fields that storing this batch changes, written in the same script.

    A batch that ends the execution dates it by its terminal event, so the lists'
    duration (``createdAt`` to ``updatedAt``) is the one every view shows (SPEC §9).
    """
    meta: dict[str, str] = {"updatedAt": utc_timestamp()}
    for event in batch:
        status = STATUS_AFTER.get(event.type)
        if status is None:
            continue
        meta["status"] = status
        if event.type in TERMINAL_TYPES:
            meta["updatedAt"] = event.ts
        if event.type == EXECUTION_RESUMED and rejected(event.data.get("input")):
            meta["decision"] = "rejected"
        if event.type == EXECUTION_COMPLETED:
            _outcome(meta, "output", event.data.get("output"), event.id)
        elif event.type == EXECUTION_FAILED:
            _outcome(meta, "error", event.data.get("error"), event.id)
        elif event.type == EXECUTION_PAUSED:
            _outcome(meta, "pause", event.data, event.id)
            meta["pauseBlock"] = str(event.data.get("blockId", ""))
        elif event.type == EXECUTION_RECOVERED:
            meta["recoveries"] = str(event.data.get("recovery", 0))
    return meta


def rejected(answer: object) -> bool:
    """An approval's answer that says no: ``approved: false`` (SPEC §2's approval schema)."""
    return isinstance(answer, dict) and answer.get("approved") is False


def _outcome(meta: dict[str, str], field: str, value: object, event_id: int) -> None:
    encoded = orjson.dumps(value)
    if len(encoded) <= META_INLINE_BYTES:
        meta[field] = encoded.decode()
    else:
        meta[field] = orjson.dumps({"$event": event_id}).decode()


class EventWriter:
    """Writes one execution's events to the buffer, in order, retrying with backoff."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        execution_id: str,
        fence: str,
        epoch: int = 1,
        stored_id: int = 0,
        base_id: int | None = None,
        reserved: int = 0,
        publish: Publish | None = None,
        gate: LiveGate | None = None,
        ceiling: Ceiling | None = None,
        on_cancel: Callable[[], None] | None = None,
        on_lost: Callable[[], Awaitable[None]] | None = None,
        identity: Mapping[str, str] | None = None,
        max_pending: int = 10_000,
        metrics: Metrics | None = None,
        retry_base_seconds: float = 0.05,
        retry_max_seconds: float = 5.0,
    ) -> None:
        """Longer than most: one commented declaration per part of the writer's state."""
        self._buffer = buffer
        self._execution_id = execution_id
        self._fence = fence
        self._epoch = epoch
        self._publish = publish
        self._tell_stored: Callable[[int], None] | None = None
        self._gate = gate or LiveGate.always_open()
        self._gate.when_open(self._show)
        # The durable ceiling (ceiling.py): an unstored event is shown only under it too.
        self._ceiling = ceiling
        if ceiling is not None:
            ceiling.on_raised = self._show
        self._on_cancel = on_cancel
        # Called when the store lost writes of this run, before they are written back: the
        # owner watches its lease again first (a recreated execution is never running with
        # nobody watching) and saves what lives outside its keys (its workflow version).
        self._on_lost = on_lost
        # Fields to recreate the metadata with if the store comes back empty, written
        # again whenever it lost writes (recovery counts among them).
        self._identity = dict(identity or {})
        # An execution with webhooks: the events to leave a hint for before storing them
        # (lib/webhooks/outbox.py): the ones its webhooks want, and every final one (a
        # cancel that wins replaces a final event under its id).
        hooks = decoded(self._identity.get("webhooks"))
        self._hinted_types = (
            frozenset(FINAL_TYPES.union(*(hook.events for hook in hooks))) if hooks else None
        )
        self._hinted_id = 0
        self._max_pending = max_pending
        self._metrics = metrics
        self._retry_base = retry_base_seconds
        self._retry_max = retry_max_seconds
        self._in_flight: list[Event] = []
        self._waiting: deque[Event] = deque()
        self._unshown: deque[Event] = deque()
        self._dropped_unshown: set[int] = set()
        base = stored_id if base_id is None else max(base_id, stored_id)
        # The highest id dropped so far (or never stored by this owner: a new owner's
        # first batch records the ids between the stored last id and its base). Drops
        # only ever take the oldest waiting events, so any ids between the stored id and
        # the next batch are dropped ones.
        self._last_dropped = base if base > stored_id else 0
        self._emitted = base
        self._shown = base
        # The highest id Redis reserved for this owner: events up to it are shown as
        # they are emitted (a new execution's first one: start.lua reserved it).
        self.reserved = max(base, reserved)
        # How far past what it emitted an append reserves: as many events as arrived
        # while the last one was in flight. Idle, it is 0 (a takeover leaves no hole);
        # in a burst, events are shown as they are emitted, up to the next reservation.
        self._ahead = 0
        self.state = WriterState.IN_STEP
        # What a write-back writes: the checkpoint as stored so far (and the run
        # state's other fields, see remember).
        self._mirror: dict[str, bytes] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._progress = asyncio.Event()  # set whenever an append went through or it stopped
        self._task: asyncio.Task[None] | None = None
        self.stored_id = stored_id
        self.dropped_events = 0
        self.failures = 0
        self.refused: WriteRefused | None = None
        self.final_stored: Event | None = None

    async def __aenter__(self) -> EventWriter:
        self._task = asyncio.create_task(self._run(), name=f"flush:{self._execution_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.drained()
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop writing now; whatever is still queued is abandoned."""
        if self._task is not None:
            await stop(self._task)
            self._task = None
        if self._ceiling is not None:
            await self._ceiling.close()

    def put(self, event: Event) -> None:
        """Queue one event for storing; never blocks. Drops the oldest waiting past the cap."""
        if self.state is WriterState.REFUSED:
            return
        self._emitted = event.id
        self._waiting.append(event)
        self._unshown.append(event)
        self._idle.clear()
        while len(self._waiting) + len(self._in_flight) > self._max_pending:
            if len(self._waiting) <= 1:
                break  # the newest event (maybe the terminal one) is never dropped
            self._drop(self._waiting.popleft())
        # Shown (if it may be) before the flush is woken: a reader here writes its frame
        # before the append is built and sent.
        self._show()
        self._wakeup.set()

    def show_to(self, publisher: LocalPublisher) -> None:
        """Show events live to this run's channel (hub.py), and tell it what is stored
        (it keeps what was shown and is not stored yet, for readers attaching)."""
        self._publish = publisher.publish
        self._tell_stored = publisher.stored

    def request_repair(self) -> None:
        """The store may have lost this execution: check it now, even if idle (the
        append tells, and the writer recreates or writes back what is missing)."""
        if self._move(Transition.CHECK) is not WriterState.REFUSED:
            self._idle.clear()
            self._wakeup.set()

    def _move(self, transition: Transition) -> WriterState:
        """Take ``transition`` (outage.TRANSITIONS); the new state."""
        self.state = TRANSITIONS[self.state, transition]
        return self.state

    @property
    def writing_back(self) -> bool:
        return self.state in (WriterState.WRITING_BACK, WriterState.RECREATING)

    @property
    def shown_id(self) -> int:
        """The highest id shown live by this writer (its base when it showed none)."""
        return self._shown

    def _drop(self, event: Event) -> None:
        self._last_dropped = event.id
        self.dropped_events += 1
        if event.id > self._shown:
            self._dropped_unshown.add(event.id)
        if self._metrics is not None:
            self._metrics.events_dropped.inc()

    def _show(self) -> None:
        """Publish, in order, the events that may be shown now (see the module doc)."""
        unshown = self._unshown
        if not unshown:
            return
        gate_open = self._gate.open
        while unshown:
            event = unshown[0]
            if event.id in self._dropped_unshown:
                # Dropped before it could be shown: it never will be (a gap instead).
                self._dropped_unshown.discard(event.id)
                unshown.popleft()
                continue
            # A stored event is the store's truth: shown whatever the gate says, or a
            # reader here would wait for it forever once the run lets go (the gate
            # closed for an outage and never reopened). One not stored yet is shown only
            # under an id reserved for this owner, while the gate is open, and never
            # when it is the run's final event.
            if event.id > self.stored_id and (
                not gate_open
                or event.type in FINAL_TYPES
                or event.id > self.reserved
                or (self._ceiling is not None and event.id > self._ceiling.value)
            ):
                return
            unshown.popleft()
            self._shown = event.id
            if self._publish is not None:
                self._publish(event)

    @property
    def pending(self) -> int:
        return len(self._in_flight) + len(self._waiting)

    async def stored_through(self, event_id: int) -> None:
        """Wait until every event up to ``event_id`` is stored (or the writer stopped)."""
        while self.stored_id < event_id and self.state is not WriterState.REFUSED:
            self._progress.clear()
            await self._progress.wait()

    async def drained(self) -> None:
        """Wait until every queued event is stored (or dropped, or refused)."""
        await self._idle.wait()

    def _next_batch(self) -> list[Event]:
        batch: list[Event] = []
        size = 0
        while self._waiting and len(batch) < MAX_BATCH_EVENTS:
            size += len(self._waiting[0].json)
            if batch and size > MAX_BATCH_BYTES:
                break
            batch.append(self._waiting.popleft())
        return batch

    async def _run(self) -> None:
        """The writer's one loop (longer than most: each reply handled by its append)."""
        backoff = Backoff(base=self._retry_base, cap=self._retry_max)
        while True:
            if not self._in_flight:
                if not self._waiting and self.state is WriterState.IN_STEP:
                    self._idle.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._in_flight = self._next_batch()
            batch = self._in_flight
            first = batch[0].id if batch else self.stored_id + 1
            # Recomputed on every try: events may be dropped while a batch is in flight
            # (even one that itself records an earlier drop), and each range is recorded
            # by the batch that follows it.
            after_drop = self._last_dropped > self.stored_id and first > self.stored_id + 1
            meta = batch_meta(batch)
            if self.writing_back:
                meta = {**self._identity, **meta}
            try:
                await self._hint(batch)
                result = await self._buffer.append(
                    self._execution_id,
                    batch,
                    fence=self._fence,
                    epoch=self._epoch,
                    first=first,
                    meta=meta,
                    after_drop=after_drop,
                    reserve=self._emitted + self._ahead,
                    recreate=self.state is WriterState.RECREATING,
                    checkpoint=self._mirror if self.writing_back else None,
                    identity=self._identity,
                )
            except WriteRefused as exc:
                if self._refused_but_handled(exc, batch, first):
                    backoff.reset()
                    if self.writing_back and self._on_lost is not None:
                        try:
                            await self._on_lost()
                        except BufferUnavailable as lost:
                            self._failed(lost, backoff)
                            await backoff.wait()
                    continue
                self._refuse(exc)
                return
            except BufferUnavailable as exc:
                self._failed(exc, backoff)
                await backoff.wait()
                continue
            backoff.reset()
            if after_drop:
                log.warning(
                    "events recorded as dropped",
                    extra={
                        "executionId": self._execution_id,
                        "fromId": self.stored_id + 1,
                        "toId": first - 1,
                    },
                )
            self._move(Transition.SETTLE)
            waiting = len(self._waiting)
            self._ahead = min(waiting, self._max_pending) if waiting >= BURST_EVENTS else 0
            self.reserved = max(self.reserved, result.reserved)
            if self._ceiling is not None:
                # After an append: a start's first frame shares no moment with its write.
                self._ceiling.want(max(self.reserved, self.stored_id, batch[-1].id if batch else 0))
            self._stored(batch, first)
            if result.cancel_requested and self._on_cancel is not None:
                self._on_cancel()
            # The readers woken by what was just shown write their frames before the
            # next batch is built and sent: a first frame does not wait for a second
            # append's work (under load the next batch only grows meanwhile).
            await asyncio.sleep(0)

    async def _hint(self, batch: list[Event]) -> None:
        """Leave the outbox a hint of the events of ``batch`` a webhook may be owed,
        before the batch is stored: if this process dies right after storing it, the
        hint is still there (BufferUnavailable when it cannot be written: retried)."""
        if self._hinted_types is None:
            return
        wanted = [
            event.id
            for event in batch
            if event.type in self._hinted_types and event.id > self._hinted_id
        ]
        if not wanted:
            return
        with translating("leave a webhook hint"):
            await hint(self._buffer.redis, self._buffer.prefix, self._execution_id, wanted)
        self._hinted_id = max(wanted)

    def _refused_but_handled(self, exc: WriteRefused, batch: list[Event], first: int) -> bool:
        """Act on a refusal that the writer can answer; False when it must stop."""
        if isinstance(exc, CancelWins) and batch:
            # A cancel was accepted before the final event was stored: it wins, under
            # the final event's id (that event was never shown to anyone).
            final = batch[-1]
            cancelled = Event(
                id=final.id,
                type=EXECUTION_CANCELLED,
                execution_id=final.execution_id,
                workflow_id=final.workflow_id,
                data={"reason": "cancelled"},
            )
            batch[-1] = cancelled
            if self._unshown and self._unshown[-1] is final:
                self._unshown[-1] = cancelled
            log.info("a cancel won over the run's last event", extra=self._extra())
            return True
        if isinstance(exc, WriteGone):
            # The store came back empty: recreate the metadata under this owner and
            # record every id before this batch as dropped.
            log.warning("the buffer lost the execution; recreating it", extra=self._extra())
            self._lose_down_to(0, first, Transition.LOST_EXECUTION)
            return True
        if isinstance(exc, WriteOutOfOrder) and exc.last_id is not None:
            last = exc.last_id
            if batch and last >= batch[-1].id:
                self._stored(batch, first)  # an earlier try was applied; its reply was lost
                return True
            if not batch and last >= first - 1:
                self._move(Transition.SETTLE)  # the store has all this writer stored
                return True
            if last < first - 1:
                # The store is behind what this writer stored: it lost writes.
                log.warning(
                    "the buffer lost events; recording them as dropped",
                    extra={**self._extra(), "storedLastId": last, "nextId": first},
                )
                self._lose_down_to(last, first, Transition.LOST_WRITES)
                return True
        return False

    def _lose_down_to(self, last: int, first: int, transition: Transition) -> None:
        """The store has this run only up to ``last``: write the rest back."""
        self._move(transition)
        self.stored_id = min(self.stored_id, last)
        self._last_dropped = max(self._last_dropped, first - 1)

    def _failed(self, exc: BufferUnavailable, backoff: Backoff) -> None:
        self.failures += 1
        if self._metrics is not None:
            self._metrics.buffer_write_failures.inc()
        log.warning(
            "buffer write failed; will retry",
            extra={
                **self._extra(),
                "pending": self.pending,
                "retryInSeconds": round(backoff.delay, 3),
                "error": str(exc),
            },
        )

    def remember(self, fields: Mapping[str, bytes]) -> None:
        """Run state fields saved outside the events (the workflow version, the input),
        written back with the checkpoint if the store loses them."""
        self._mirror.update(fields)

    def _stored(self, batch: list[Event], first: int) -> None:
        for event in batch:
            self._mirror.update(event.checkpoint)
        self._in_flight = []
        self.stored_id = batch[-1].id if batch else first - 1
        if batch and batch[-1].type in FINAL_TYPES:
            self.final_stored = batch[-1]
        if self._metrics is not None and batch:
            self._metrics.events_written.inc(len(batch))
            self._metrics.bytes_written.inc(sum(len(event.json) for event in batch))
        if self._tell_stored is not None:
            self._tell_stored(self.stored_id)
        self._show()
        self._progress.set()

    def _extra(self) -> dict[str, object]:
        return {"executionId": self._execution_id}

    def _refuse(self, exc: WriteRefused) -> None:
        # Another owner took over: writing more would be wrong.
        log.error(
            "buffer refused the writer; its events stay unstored",
            extra={
                "executionId": self._execution_id,
                "reason": exc.reason,
                "pending": self.pending,
            },
        )
        self.refused = exc
        self._move(Transition.REFUSE)
        self._in_flight = []
        self._waiting.clear()
        self._unshown.clear()
        self._idle.set()
        self._progress.set()
