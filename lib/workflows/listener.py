"""The control listener: cancels for the runs here, the hand-offs of every process, and
the queue's wake-ups.

One blocking read on this process's control stream, the ``handoffs`` stream and the
queue's wake-up stream (control.py). A cancel stops the run it names at once (its
owner would also learn of it with its next renewal); a hand-off is reported to the
listener's owner (the runner), which takes the execution over; a wake-up calls
``on_queued`` (the dispatcher).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from lib.backoff import Backoff
from lib.errors import FlowcastError
from lib.execution.control import ControlStreams
from lib.execution.record import StopReason
from lib.workflows.leases import LocalRuns

log = logging.getLogger(__name__)

CONTROL_BLOCK_MS = 5_000


class ControlListener:
    """Reads the control streams of the process ``node_id`` until stopped."""

    def __init__(
        self,
        *,
        control: ControlStreams,
        node_id: str,
        runs: LocalRuns,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self._control = control
        self.on_queued = on_queued
        self._node_id = node_id
        self._runs = runs
        self._stopping = False

    async def handoffs(self) -> AsyncIterator[tuple[str, str]]:
        """(execution id, fence) of each hand-off as it arrives; cancels for the runs
        here are delivered on the way. Ends once ``stop`` was called."""
        cursors: dict[str, str] | None = None
        backoff = Backoff(base=0.1, cap=5.0)
        while not self._stopping:
            try:
                if cursors is None:
                    cursors = await self._control.cursors(self._node_id)
                cancels, handed, queued = await self._control.read(
                    cursors, block_ms=CONTROL_BLOCK_MS
                )
            except FlowcastError as exc:
                log.warning("control stream read failed", extra={"error": str(exc)})
                await backoff.wait()
                continue
            backoff.reset()
            for execution_id in cancels:
                run = self._runs.get(execution_id)
                if run is not None:
                    run.stop(StopReason.CANCEL)
            if queued and self.on_queued is not None:
                self.on_queued()
            for handed_off in handed:
                yield handed_off

    async def stop(self) -> None:
        """End the reading: a message to this node ends its blocking read (a cancelled
        read may not end at once: the client retries it)."""
        self._stopping = True
        await self._control.wake(self._node_id)
