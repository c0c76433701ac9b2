"""An execution's event log, as the process that owns it writes it: one seam, and the
first hop of an event's path (drawn whole in stream.py's docstring).

The owner sees only ``emit`` (and ``keep``, to compact a value the way its event will
carry it). Behind it, in this module and in one direction:

    emit ─► Emitter: the next id; compacted by the Compactor when large (in order)
         ─► EventWriter, the log's private flush: batched, fenced append to the buffer
            (buffer.py, append.lua, which also publishes the batch to other processes)
         ─► shown live once its id is reserved (or stored, for the last event), while
            the owner's live gate is open (its lease renewed, none failed since)
         ─► this run's channel (hub.py) ─► the readers here (stream.py) ─► SSE frames

Constructing the log makes this process the execution's live source (readers arriving
from then on find it here); leaving its ``async with`` stores everything emitted, the
last event last, then lets the channel go (its readers follow the buffer).

The emitter (``Emitter``) encodes each event, gives it its id, compacts large values and
hands it on. Emitting is synchronous and never waits. An event is encoded before it gets
its id, so a value no event could carry (SPEC §2 "Block outputs are JSON") is made
carriable first and can never leave a hole in the ids. An event whose envelope is small
enough that no value inside can need offloading goes straight to the writer (which shows
it live). Any other event, and every event behind it, waits in order for one compaction
task, which offloads its large values and then hands it on; so live and stored copies
are the same bytes and order is kept without blocking the workflow.

The flush (``EventWriter``, in flush.py, with what it does about an unreachable or
forgetful store in outage.py: the ``LiveGate`` it shows events behind and its state
table) is the log's private part: nothing but this module writes through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from lib.errors import WriteRefused
from lib.execution.buffer import EventBuffer
from lib.execution.ceiling import Ceiling
from lib.execution.events import (
    Checkpoint,
    Event,
    carriable,
)
from lib.execution.flush import EventWriter
from lib.execution.hub import Hub
from lib.execution.offload import Compactor, OffloadPolicy
from lib.execution.outage import LiveGate
from lib.execution.values import ValueStore
from lib.metrics import Metrics
from lib.slices import PIECE, weight
from lib.tasks import stop

log = logging.getLogger(__name__)


class Emitter:
    """Assigns ids 1, 2, 3, … in emit order and delivers events in that order."""

    def __init__(
        self,
        *,
        execution_id: str,
        workflow_id: str,
        writer: EventWriter,
        compactor: Compactor | None = None,
        metrics: Metrics | None = None,
        last_id: int = 0,
    ) -> None:
        self.execution_id = execution_id
        self.workflow_id = workflow_id
        self._writer = writer
        self._compactor = compactor
        self._metrics = metrics
        self._backlog: deque[Event] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.last_id = last_id

    async def __aenter__(self) -> Emitter:
        if self._compactor is not None:
            self._task = asyncio.create_task(self._compact_backlog(), name="compact")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._idle.wait()
        finally:
            await stop(self._task)

    def emit(self, type: str, data: dict[str, Any], checkpoint: Checkpoint = ()) -> None:
        """Emit one event now; readers attached here may see it before it is stored.

        ``checkpoint`` fields go to the run state in the same write as the event.
        """
        event = Event(
            id=self.last_id + 1,
            type=type,
            execution_id=self.execution_id,
            workflow_id=self.workflow_id,
            data=data,
            checkpoint=checkpoint,
        )
        compactor = self._compactor
        # Large data is not encoded here, whole, on the event loop (a 10 MB input held
        # it 80-150 ms; step 16, row 1): compaction encodes it in slices.
        if compactor is not None and weight(data) > PIECE:
            self._queue(event)
            return
        try:
            event.json  # noqa: B018 - encoded now, before the id is taken
        except (TypeError, ValueError):
            event = Event(
                id=event.id,
                type=type,
                execution_id=self.execution_id,
                workflow_id=self.workflow_id,
                data=carriable(data),
                ts=event.ts,
                checkpoint=checkpoint,
            )
        if self._backlog or (compactor is not None and not compactor.fits(len(event.json))):
            self._queue(event)
        else:
            self._count(event)
            self._deliver(event)

    def _queue(self, event: Event) -> None:
        """Hold ``event`` for compaction (after those held already, in order)."""
        self._count(event)
        self._backlog.append(event)
        self._idle.clear()
        self._wakeup.set()

    def _count(self, event: Event) -> None:
        self.last_id = event.id
        if self._metrics is not None and event.type.startswith("execution:"):
            # started, paused, resumed, completed, failed, cancelled
            self._metrics.executions.labels(event.type.partition(":")[2]).inc()

    def _deliver(self, event: Event) -> None:
        if self._compactor is not None:
            self._compactor.stored(len(event.json))
        self._writer.put(event)

    async def _compact_backlog(self) -> None:
        assert self._compactor is not None
        while True:
            if not self._backlog:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            event = self._backlog[0]
            compacted = Event(
                id=event.id,
                type=event.type,
                execution_id=event.execution_id,
                workflow_id=event.workflow_id,
                data=await self._compacted(event.data),
                ts=event.ts,
                checkpoint=event.checkpoint,
            )
            await compacted.encode()  # in slices: what stays inline may still be large
            self._backlog.popleft()
            self._deliver(compacted)

    async def _compacted(self, data: dict[str, Any]) -> dict[str, Any]:
        assert self._compactor is not None
        try:
            try:
                return await self._compactor.compact(data)
            except (TypeError, ValueError):
                # Large data comes here unencoded: what orjson refuses is made carriable
                # here, as ``emit`` does for the rest.
                return await self._compactor.compact(carriable(data))
        except Exception:
            # A bug in compaction must not lose the event: send it as it is.
            log.exception("compaction failed", extra={"executionId": self.execution_id})
            carried: dict[str, Any] = carriable(data)
            return carried


class ExecutionLog:
    """Emits one owner's events of one execution, in order, stored and shown live."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub,
        values: ValueStore,
        policy: OffloadPolicy,
        execution_id: str,
        identity: Mapping[str, str],
        fence: str,
        epoch: int,
        stored_id: int,
        base_id: int,
        reserved: int = 0,
        retained_bytes: int = 0,
        checkpoint_bytes: int = 0,
        gate: LiveGate,
        on_cancel: Callable[[], None],
        on_lost: Callable[[], Awaitable[None]],
        max_pending: int = 10_000,
        metrics: Metrics | None = None,
    ) -> None:
        """The log's parts built from what the claim gave: the writer (with its durable
        ceiling), the compactor and the channel. Longer than most: it only hands each
        part its share of the claim, one argument a line."""
        self.execution_id = execution_id
        self.workflow_id = identity["workflowId"]
        self._writer = EventWriter(
            ceiling=Ceiling(
                values=values,
                execution_id=execution_id,
                fence=fence,
                epoch=epoch,
                base=max(stored_id, base_id, reserved),
            ),
            buffer=buffer,
            execution_id=execution_id,
            fence=fence,
            epoch=epoch,
            stored_id=stored_id,
            base_id=base_id,
            reserved=reserved,
            gate=gate,
            on_cancel=on_cancel,
            on_lost=on_lost,
            identity={k: v for k, v in identity.items() if v},
            max_pending=max_pending,
            metrics=metrics,
        )
        self._compactor = Compactor(
            store=values,
            execution_id=execution_id,
            policy=policy,
            inline_files=bool(identity.get("inlineFiles")),
            metrics=metrics,
        )
        self._compactor.stored(retained_bytes)
        self._compactor.ring.hold(checkpoint_bytes)
        self._emitter = Emitter(
            execution_id=execution_id,
            workflow_id=self.workflow_id,
            writer=self._writer,
            compactor=self._compactor,
            metrics=metrics,
            last_id=base_id,
        )
        self._publisher = hub.attach_local(
            execution_id, last_id=base_id, stored_id=stored_id, lease_held=lambda: gate.open
        )
        self._writer.show_to(self._publisher)

    async def __aenter__(self) -> ExecutionLog:
        await self._writer.__aenter__()
        await self._emitter.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # In order: the emitter finishes compacting, then the writer stores the last
        # event, then live readers here switch to following the buffer.
        try:
            try:
                await self._emitter.__aexit__(*exc_info)
            finally:
                await self._writer.__aexit__(*exc_info)
        finally:
            self._publisher.detach(stored_id=self._writer.stored_id)

    def emit(self, type: str, data: dict[str, Any], checkpoint: Checkpoint = ()) -> None:
        """Emit one event now (never waits); ``checkpoint`` fields are stored with it."""
        self._emitter.emit(type, data, checkpoint)

    async def keep(self, value: Any) -> tuple[Any, bytes]:
        """``value`` compacted as an event carries it, and its JSON, counted as held by
        the checkpoint (against the byte budget)."""
        kept = (await self._compactor.compact({"value": value}))["value"]
        encoded = orjson.dumps(kept)
        self._compactor.ring.hold(len(encoded))
        return kept, encoded

    async def stored_through(self, event_id: int) -> None:
        """Wait until every event up to ``event_id`` is stored (or the writer stopped)."""
        await self._writer.stored_through(event_id)

    async def first_stored(self, first_id: int, seconds: float) -> None:
        """Wait until the run's first event (``first_id``) is stored, at most ``seconds``:
        a 202 names an execution whose first event is stored, even if this process dies
        right as it answers (a streamed start shows it at once instead, from its
        reserved id). Bounded: an outage delays the answer that long at most, never
        fails it; past it, said in the log (a death from then on leaves a reported gap)."""
        try:
            async with asyncio.timeout(seconds):
                await self.stored_through(first_id)
        except TimeoutError:
            log.warning(
                "answering a start whose first event is not stored yet",
                extra={"executionId": self.execution_id, "waited": seconds},
            )

    def remember(self, fields: Mapping[str, bytes]) -> None:
        """Run state fields saved outside the events, to write back with the
        checkpoint if the store loses them."""
        self._writer.remember(fields)

    def repair(self) -> None:
        """The store lost the execution: recreate it now, even if idle."""
        self._writer.request_repair()

    @property
    def pending(self) -> int:
        """Events emitted and not stored yet."""
        return self._writer.pending

    @property
    def shown_id(self) -> int:
        """The highest id shown live (a hand-off records it for the next owner)."""
        return self._writer.shown_id

    @property
    def stored_id(self) -> int:
        """The last id stored by this log's writer."""
        return self._writer.stored_id

    @property
    def retained_bytes(self) -> int:
        """Bytes the ring retains, as the compactor models it."""
        return self._compactor.ring.retained_bytes

    @property
    def final_stored(self) -> Event | None:
        """The run's last event (paused or terminal), once stored."""
        return self._writer.final_stored

    @property
    def refused(self) -> WriteRefused | None:
        """Why the buffer refused this writer for good (another owner), if it did."""
        return self._writer.refused
