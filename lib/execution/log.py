"""An execution's event log, as the process that owns it writes it: one seam.

The owner sees only ``emit`` (and ``keep``, to compact a value the way its event will
carry it). Behind it, the path of one event is a short straight line:

    emit ─► Emitter: the next id; compacted by the Compactor when large (in order)
         ─► EventWriter: batched, fenced append to the buffer (append.lua)
         ─► shown live once its id is reserved (or stored, for the last event),
            while the owner's live gate is open (its lease renewed, none failed since)
         ─► LocalPublisher ─► the hub's readers here ─► each client's SSE frame

Readers on other processes follow the buffer. Constructing the log makes this process
the execution's live source (readers arriving from then on find it here); leaving its
``async with`` stores everything emitted, the last event last, then hands the readers
here over to the buffer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from lib.errors import WriteRefused
from lib.execution.buffer import EventBuffer
from lib.execution.emitter import Emitter
from lib.execution.events import Checkpoint, Event
from lib.execution.hub import Hub
from lib.execution.offload import Compactor, OffloadPolicy
from lib.execution.values import ValueStore
from lib.execution.writer import EventWriter, LiveGate
from lib.metrics import Metrics


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
        retained_bytes: int = 0,
        checkpoint_bytes: int = 0,
        gate: LiveGate,
        on_cancel: Callable[[], None],
        on_lost: Callable[[], Awaitable[None]],
        max_pending: int = 10_000,
        metrics: Metrics | None = None,
    ) -> None:
        self.execution_id = execution_id
        self.workflow_id = identity["workflowId"]
        self._writer = EventWriter(
            buffer=buffer,
            execution_id=execution_id,
            fence=fence,
            epoch=epoch,
            stored_id=stored_id,
            base_id=base_id,
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
            execution_id, last_id=base_id, unstored=self._writer.unstored
        )
        self._writer.show_to(self._publisher.publish)

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
