"""The sweeper: values of executions whose buffer keys expired are deleted too.

Redis expires an execution's keys ``retention_seconds`` after it finished; the value
store has no such clock, so this task periodically lists the executions that have values
and deletes those whose metadata is gone. (On S3 a lifecycle rule on the prefix does
the same job without the sweeper; see the README.)
"""

from __future__ import annotations

import asyncio
import logging

from lib.errors import FlowcastError
from lib.execution.buffer import EventBuffer
from lib.execution.values import ValueStore
from lib.tasks import stop

log = logging.getLogger(__name__)


class Sweeper:
    """Deletes orphaned values every ``interval_seconds`` while it runs."""

    def __init__(self, *, store: ValueStore, buffer: EventBuffer, interval_seconds: float) -> None:
        self._store = store
        self._buffer = buffer
        self._interval = interval_seconds
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Sweeper:
        self._task = asyncio.create_task(self._loop(), name="value-sweeper")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await stop(self._task)

    async def sweep(self) -> list[str]:
        """One pass; returns the executions whose values were deleted."""
        deleted = []
        for execution_id in await self._store.executions():
            if await self._buffer.exists(execution_id):
                continue
            await self._store.delete_execution(execution_id)
            deleted.append(execution_id)
        if deleted:
            log.info("expired values deleted", extra={"executions": len(deleted)})
        return deleted

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sweep()
            except FlowcastError as exc:
                log.warning("value sweep failed; will try again", extra={"error": str(exc)})
