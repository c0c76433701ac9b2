"""Stores filled fast: executions written through the buffer as a run writes them (the
start's listing, then a final event with the status it sets), without running
anything, so a test can have thousands of them in seconds."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

from lib.execution.buffer import EventBuffer
from lib.execution.events import Event, utc_timestamp

FINAL_TYPES = {
    "completed": "execution:completed",
    "failed": "execution:failed",
    "cancelled": "execution:cancelled",
    "paused": "execution:paused",
}
OWNER = "owner-1"
AT_ONCE = 16  # runs written at once: within a client's connection pool


async def stored_run(
    buffer: EventBuffer,
    tenant: str,
    workflow_id: str,
    *,
    status: str = "running",
    created_ms: int | None = None,
) -> str:
    """One execution created as a start creates it, then moved to ``status`` by a
    final event (``running``: none); its id."""
    execution_id = f"ex_{uuid.uuid4().hex}"
    created_ms = created_ms if created_ms is not None else int(time.time() * 1000)
    moment = datetime.fromtimestamp(created_ms / 1000, UTC)
    await buffer.create(
        execution_id,
        workflow_id=workflow_id,
        tenant=tenant,
        owner=OWNER,
        created_at=utc_timestamp(moment),
        created_ms=created_ms,
    )
    if status != "running":
        await finish(buffer, execution_id, workflow_id, status)
    return execution_id


async def finish(buffer: EventBuffer, execution_id: str, workflow_id: str, status: str) -> None:
    """Store the event that moves an execution to ``status``, as its owner would."""
    final = Event(
        id=1,
        type=FINAL_TYPES[status],
        execution_id=execution_id,
        workflow_id=workflow_id,
        data={"blockId": "gate"} if status == "paused" else {},
    )
    await buffer.append(execution_id, [final], fence=OWNER, meta={"status": status})


async def stored_runs(
    buffer: EventBuffer, tenant: str, workflow_id: str, count: int, *, status: str
) -> list[str]:
    """``count`` executions of ``workflow_id`` in ``status``, ``AT_ONCE`` at a time."""
    made: list[str] = []
    for start in range(0, count, AT_ONCE):
        made += await asyncio.gather(
            *(
                stored_run(buffer, tenant, workflow_id, status=status)
                for _ in range(min(AT_ONCE, count - start))
            )
        )
    return made


async def calls(buffer: EventBuffer, command: str) -> int:
    """How many times the buffer's Redis server ran ``command`` so far (INFO
    commandstats): what a read cost, counted by the server itself."""
    stats = await buffer.redis.info("commandstats")
    entry = stats.get(f"cmdstat_{command.lower()}")
    return int(entry["calls"]) if entry else 0
