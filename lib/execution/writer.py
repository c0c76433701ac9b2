"""The flush path: an execution's events go to the buffer in order, in batches.

Emitting never waits for Redis. ``put`` queues the event; one flush task per execution
writes whatever is queued as one atomic batch. When Redis is idle the batch is a single
event written at once; under load the events that arrive while a write is in flight
form the next batch, so the write rate adapts without a timer.

While the buffer is unreachable the batch in flight is retried as it is, with jittered
exponential backoff, and new events wait behind it. Past ``max_pending`` the oldest
waiting events are dropped; the next batch that reaches Redis records their id range
atomically with itself, so replay reports it as a ``dropped`` gap and the terminal
event still lands after everything before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import orjson

from lib.backoff import Backoff
from lib.errors import BufferUnavailable, WriteRefused
from lib.execution.buffer import EventBuffer
from lib.execution.events import (
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    STATUS_AFTER,
    Event,
    utc_timestamp,
)
from lib.metrics import Metrics

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
            meta["pauseBlock"] = str(event.data.get("blockId", ""))
    return meta


class EventWriter:
    """Writes one execution's events to the buffer, in order, retrying with backoff."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        execution_id: str,
        fence: str,
        stored_id: int = 0,
        max_pending: int = 10_000,
        metrics: Metrics | None = None,
        retry_base_seconds: float = 0.05,
        retry_max_seconds: float = 5.0,
    ) -> None:
        self._buffer = buffer
        self._execution_id = execution_id
        self._fence = fence
        self._max_pending = max_pending
        self._metrics = metrics
        self._retry_base = retry_base_seconds
        self._retry_max = retry_max_seconds
        self._in_flight: list[Event] = []
        self._waiting: deque[Event] = deque()
        # The highest id dropped so far. Drops only ever take the oldest waiting events,
        # so any ids between the stored id and the next batch are dropped ones.
        self._last_dropped = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.stored_id = stored_id
        self.dropped_events = 0
        self.failures = 0
        self.refused: WriteRefused | None = None

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
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def put(self, event: Event) -> None:
        """Queue one event for storing; never blocks. Drops the oldest waiting past the cap."""
        if self.refused is not None:
            return
        self._waiting.append(event)
        self._idle.clear()
        self._wakeup.set()
        while len(self._waiting) + len(self._in_flight) > self._max_pending:
            if len(self._waiting) <= 1:
                break  # the newest event (maybe the terminal one) is never dropped
            self._drop(self._waiting.popleft())

    def _drop(self, event: Event) -> None:
        self._last_dropped = event.id
        self.dropped_events += 1
        if self._metrics is not None:
            self._metrics.events_dropped.inc()

    def unstored(self) -> list[Event]:
        """Events queued but not yet stored, oldest first."""
        return [*self._in_flight, *self._waiting]

    @property
    def pending(self) -> int:
        return len(self._in_flight) + len(self._waiting)

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
        backoff = Backoff(base=self._retry_base, cap=self._retry_max)
        while True:
            if not self._in_flight:
                if not self._waiting:
                    self._idle.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._in_flight = self._next_batch()
            batch = self._in_flight
            # Recomputed on every try: events may be dropped while a batch is in flight
            # (even one that itself records an earlier drop), and each range is recorded
            # by the batch that follows it.
            after_drop = self._last_dropped > self.stored_id and batch[0].id > self.stored_id + 1
            try:
                await self._buffer.append(
                    self._execution_id,
                    batch,
                    fence=self._fence,
                    meta=batch_meta(batch),
                    after_drop=after_drop,
                )
            except WriteRefused as exc:
                if (
                    exc.reason == "order"
                    and exc.last_id is not None
                    and exc.last_id >= batch[-1].id
                ):
                    # An earlier try of this batch was applied but its reply was lost.
                    backoff.reset()
                    self._stored(batch)
                    continue
                self._refuse(exc)
                return
            except BufferUnavailable as exc:
                self.failures += 1
                if self._metrics is not None:
                    self._metrics.buffer_write_failures.inc()
                log.warning(
                    "buffer write failed; will retry",
                    extra={
                        "executionId": self._execution_id,
                        "pending": self.pending,
                        "retryInSeconds": round(backoff.delay, 3),
                        "error": str(exc),
                    },
                )
                await backoff.wait()
                continue
            backoff.reset()
            if after_drop:
                log.warning(
                    "events dropped while the buffer was unreachable",
                    extra={
                        "executionId": self._execution_id,
                        "fromId": self.stored_id + 1,
                        "toId": batch[0].id - 1,
                    },
                )
            self._stored(batch)

    def _stored(self, batch: list[Event]) -> None:
        self._in_flight = []
        self.stored_id = batch[-1].id
        if self._metrics is not None:
            self._metrics.events_written.inc(len(batch))
            self._metrics.bytes_written.inc(sum(len(event.json) for event in batch))

    def _refuse(self, exc: WriteRefused) -> None:
        # Another owner took over (or the execution is gone): writing more would be wrong.
        log.error(
            "buffer refused the writer; its events stay live-only",
            extra={
                "executionId": self._execution_id,
                "reason": exc.reason,
                "pending": self.pending,
            },
        )
        self.refused = exc
        self._in_flight = []
        self._waiting.clear()
        self._idle.set()
