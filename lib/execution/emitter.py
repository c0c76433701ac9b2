"""The emitter: encodes each event, gives it its id, compacts large values, hands it on.

Emitting is synchronous and never waits. An event is encoded before it gets its id, so
a value no event could carry (SPEC §2 "Block outputs are JSON") is made carriable first
and can never leave a hole in the ids. An event whose envelope is small enough that no
value inside can need offloading goes straight to the writer (which shows it live).
Any other event, and every event behind it, waits in order for one compaction task,
which offloads its large values and then hands it on; so live and stored copies are the
same bytes and order is kept without blocking the workflow.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from lib.execution.events import Checkpoint, Event, carriable
from lib.execution.offload import Compactor
from lib.execution.writer import EventWriter
from lib.metrics import Metrics

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
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

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
        self.last_id = event.id
        if self._metrics is not None and type.startswith("execution:"):
            # started, paused, resumed, completed, failed, cancelled
            self._metrics.executions.labels(type.partition(":")[2]).inc()
        compactor = self._compactor
        if self._backlog or (compactor is not None and not compactor.fits(len(event.json))):
            self._backlog.append(event)
            self._idle.clear()
            self._wakeup.set()
        else:
            self._deliver(event)

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
            try:
                data = await self._compactor.compact(event.data)
            except Exception:
                # A bug in compaction must not lose the event: send it as it is.
                log.exception("compaction failed", extra={"executionId": self.execution_id})
                data = event.data
            self._backlog.popleft()
            self._deliver(
                Event(
                    id=event.id,
                    type=event.type,
                    execution_id=event.execution_id,
                    workflow_id=event.workflow_id,
                    data=data,
                    ts=event.ts,
                    checkpoint=event.checkpoint,
                )
            )
