"""The flush path: an execution's events go to the buffer in order, in batches.

Emitting never waits for Redis. ``put`` queues the event; one flush task per execution
writes whatever is queued as one atomic batch. When Redis is idle the batch is a single
event written at once; under load the events that arrive while a write is in flight
form the next batch, so the write rate adapts without a timer.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.events import (
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    STATUS_AFTER,
    Event,
    utc_timestamp,
)

log = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1_000
MAX_BATCH_BYTES = 4 * 1024 * 1024


def batch_meta(batch: list[Event]) -> dict[str, str]:
    """Metadata fields that storing this batch changes, written in the same script."""
    meta: dict[str, str] = {"updatedAt": utc_timestamp()}
    for event in batch:
        status = STATUS_AFTER.get(event.type)
        if status is None:
            continue
        meta["status"] = status
        if event.type == EXECUTION_COMPLETED:
            meta["output"] = orjson.dumps(event.data.get("output")).decode()
        elif event.type == EXECUTION_FAILED:
            meta["error"] = orjson.dumps(event.data.get("error")).decode()
        elif event.type == EXECUTION_PAUSED:
            meta["pause"] = orjson.dumps(event.data).decode()
    return meta


class EventWriter:
    """Writes one execution's events to the buffer, in order, retrying with backoff."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        execution_id: str,
        fence: str,
        on_stored: Callable[[int], Any] = lambda _id: None,
        retry_base_seconds: float = 0.05,
        retry_max_seconds: float = 5.0,
    ) -> None:
        self._buffer = buffer
        self._execution_id = execution_id
        self._fence = fence
        self._on_stored = on_stored
        self._retry_base = retry_base_seconds
        self._retry_max = retry_max_seconds
        self._pending: deque[Event] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.stored_id = 0

    async def __aenter__(self) -> EventWriter:
        self._task = asyncio.create_task(self._run(), name=f"flush:{self._execution_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.drained()
        finally:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    def put(self, event: Event) -> None:
        """Queue one event for storing; never blocks."""
        self._pending.append(event)
        self._idle.clear()
        self._wakeup.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def drained(self) -> None:
        """Wait until every queued event is stored."""
        await self._idle.wait()

    def _take_batch(self) -> list[Event]:
        batch: list[Event] = []
        size = 0
        for event in self._pending:
            size += len(event.json)
            if batch and (len(batch) >= MAX_BATCH_EVENTS or size > MAX_BATCH_BYTES):
                break
            batch.append(event)
        return batch

    async def _run(self) -> None:
        delay = self._retry_base
        while True:
            if not self._pending:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            try:
                await self._buffer.append(
                    self._execution_id, batch, fence=self._fence, meta=batch_meta(batch)
                )
            except BufferUnavailable as exc:
                log.warning(
                    "buffer write failed; will retry",
                    extra={
                        "executionId": self._execution_id,
                        "pending": len(self._pending),
                        "error": str(exc),
                    },
                )
                # Full jitter keeps many writers from retrying in step after an outage.
                await asyncio.sleep(random.uniform(delay / 2, delay))
                delay = min(delay * 2, self._retry_max)
                continue
            delay = self._retry_base
            for _ in batch:
                self._pending.popleft()
            self.stored_id = batch[-1].id
            self._on_stored(self.stored_id)
