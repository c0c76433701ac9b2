"""Runs executions in this process: creates them, drives the executor, ends them.

The runner owns the execution tasks. Each task emits ``execution:started``, lets the
executor emit the block events, then emits exactly one terminal event, and only returns
once the writer has stored everything (the terminal event last).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lib.execution.buffer import EventBuffer
from lib.execution.emitter import Emitter
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_STARTED,
    utc_timestamp,
)
from lib.execution.hub import Hub, LocalPublisher
from lib.execution.offload import Compactor, OffloadPolicy
from lib.execution.values import ValueStore
from lib.execution.writer import EventWriter
from lib.workflows.executor import BlockFailed, Executor
from lib.workflows.model import Workflow

log = logging.getLogger(__name__)


def new_execution_id() -> str:
    """An unguessable execution id (144 random bits)."""
    return "ex_" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class Started:
    execution_id: str
    status: str


class Runner:
    """Starts executions and owns their tasks until they have written their last event."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        hub: Hub,
        executor: Executor,
        values: ValueStore,
        offload: OffloadPolicy | None = None,
        max_pending_events: int = 10_000,
        node_id: str | None = None,
    ) -> None:
        self._buffer = buffer
        self._hub = hub
        self._executor = executor
        self._values = values
        self._offload = offload or OffloadPolicy()
        self._max_pending = max_pending_events
        self._node_id = node_id or secrets.token_hex(4)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    async def __aenter__(self) -> Runner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel("shutdown")
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def start(
        self, workflow: Workflow, *, input: Any, tenant: str, inline_files: bool = False
    ) -> Started:
        """Create an execution and start running it here; returns once it is replayable.

        ``inline_files`` keeps file values' content inline up to their own cap, exempt
        from the pressure threshold (SPEC §5).
        """
        execution_id = new_execution_id()
        fence = f"{self._node_id}:{secrets.token_hex(8)}"
        now = datetime.now(UTC)
        await self._buffer.create(
            execution_id,
            workflow_id=workflow.id,
            tenant=tenant,
            owner=fence,
            created_at=utc_timestamp(now),
            created_ms=int(now.timestamp() * 1000),
            extra={"inlineFiles": "1" if inline_files else "0"},
        )
        writer = EventWriter(
            buffer=self._buffer,
            execution_id=execution_id,
            fence=fence,
            max_pending=self._max_pending,
        )
        # Attached before the task runs, so a reader arriving now already finds it local.
        publisher = self._hub.attach_local(execution_id, last_id=0, unstored=writer.unstored)
        emitter = Emitter(
            execution_id=execution_id,
            workflow_id=workflow.id,
            publisher=publisher,
            writer=writer,
            compactor=Compactor(
                store=self._values,
                execution_id=execution_id,
                policy=self._offload,
                inline_files=inline_files,
            ),
        )
        task = asyncio.create_task(
            self._run(workflow, input, writer, emitter, publisher),
            name=f"execution:{execution_id}",
        )
        self._tasks[execution_id] = task
        task.add_done_callback(lambda _task: self._tasks.pop(execution_id, None))
        return Started(execution_id, "running")

    async def _run(
        self,
        workflow: Workflow,
        input: Any,
        writer: EventWriter,
        emitter: Emitter,
        publisher: LocalPublisher,
    ) -> None:
        # Exits in order: the emitter finishes compacting, then the writer stores the
        # last event, then live readers here switch to following the buffer.
        try:
            async with writer, emitter:
                await self._execute(emitter, workflow, input)
        finally:
            publisher.detach()

    async def _execute(self, emitter: Emitter, workflow: Workflow, input: Any) -> None:
        started = time.monotonic()
        emitter.emit(EXECUTION_STARTED, {"input": input})
        extra = {"executionId": emitter.execution_id, "workflowId": workflow.id}
        try:
            output = await self._executor.run(
                workflow, execution_id=emitter.execution_id, input=input, emit=emitter.emit
            )
        except BlockFailed as exc:
            log.info("execution failed", extra={**extra, "blockId": exc.block_id})
            error = {"code": exc.code, "message": exc.message, "blockId": exc.block_id}
            emitter.emit(EXECUTION_FAILED, {"error": error})
        except asyncio.CancelledError:
            reason = "shutdown" if self._closing else "cancelled"
            if self._closing:
                error = {"code": "shutdown", "message": "the server shut down during the execution"}
                emitter.emit(EXECUTION_FAILED, {"error": error})
            else:
                emitter.emit(EXECUTION_CANCELLED, {"reason": reason})
            raise
        except Exception as exc:
            log.exception("execution crashed", extra=extra)
            error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
            emitter.emit(EXECUTION_FAILED, {"error": error})
        else:
            duration_ms = round((time.monotonic() - started) * 1000)
            emitter.emit(EXECUTION_COMPLETED, {"output": output, "durationMs": duration_ms})
            log.info("execution completed", extra={**extra, "durationMs": duration_ms})
