"""What keeps this process's executions owned: lease renewal and the cancel listener.

Each execution running here is a ``LocalRun``. Its lease is renewed every third of a
lease period (a refusal means another process fenced it out: the run stops at once),
and the time of the last check opens or closes the run's live gate. Cancels for runs
here arrive on this process's control stream, read with a blocking read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from lib.backoff import Backoff
from lib.errors import Conflict, FlowcastError
from lib.execution.control import Control

log = logging.getLogger(__name__)

CONTROL_BLOCK_MS = 5_000


@dataclass
class LocalRun:
    """An execution this process runs right now."""

    execution_id: str
    fence: str
    tenant: str
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None  # why its task was cancelled: cancel, shutdown, fenced
    ending: bool = False  # its last event (terminal or paused) is emitted, being stored
    checked_at: float = 0.0  # when its lease was last renewed, or tried in an outage
    pending: Callable[[], int] = lambda: 0  # events emitted and not stored yet
    retained: Callable[[], int] = lambda: 0  # bytes its ring retains, as modelled

    def stop(self, reason: str) -> None:
        # Once the last event is emitted, cancelling would only abandon storing it: the
        # execution would stay "running" in the buffer, with no lease, forever.
        if self.task is not None and self.stop_reason is None and not self.ending:
            self.stop_reason = reason
            self.task.cancel(reason)


class LeaseKeeper:
    """Renews the leases of the runs here and delivers cancels to them."""

    def __init__(
        self,
        *,
        control: Control,
        lease_seconds: float,
        node_id: str,
        runs: dict[str, LocalRun],
    ) -> None:
        self._control = control
        self._lease_seconds = lease_seconds
        self._node_id = node_id
        self._runs = runs

    async def renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._lease_seconds / 3)
            await asyncio.gather(*(self._renew(run) for run in list(self._runs.values())))

    async def _renew(self, run: LocalRun) -> None:
        started = time.monotonic()
        try:
            cancel_requested = await self._control.renew(run.execution_id, run.fence, run.tenant)
        except Conflict:
            run.stop("fenced")
            return
        except FlowcastError as exc:
            # Nobody can take over while the buffer is unreachable for everyone, so an
            # outage keeps the live gate open; only a stall of this process closes it.
            run.checked_at = started
            log.warning(
                "lease renewal failed",
                extra={"executionId": run.execution_id, "error": str(exc)},
            )
            return
        run.checked_at = started
        if cancel_requested:
            run.stop("cancel")

    async def cancel_loop(self) -> None:
        cursor: str | None = None
        backoff = Backoff(base=0.1, cap=5.0)
        while True:
            try:
                if cursor is None:
                    cursor = await self._control.control_cursor(self._node_id)
                cursor, cancels = await self._control.next_cancels(
                    self._node_id, after=cursor, block_ms=CONTROL_BLOCK_MS
                )
            except FlowcastError as exc:
                log.warning("control stream read failed", extra={"error": str(exc)})
                await backoff.wait()
                continue
            backoff.reset()
            for execution_id in cancels:
                run = self._runs.get(execution_id)
                if run is not None:
                    run.stop("cancel")
