"""What keeps this process's executions owned: the runs here and their lease renewal.

Each execution running here is a ``LocalRun``. Its lease is renewed every third of a
lease period (a refusal means another process fenced it out: the run stops at once; a
store that lost the execution gets it recreated by the run's writer). Each renewal that
succeeds renews the run's live gate; one that fails closes it at once (SPEC §5): from
here a store down for everyone and a store lost by this process alone look the same,
and in the second case another process may be about to take over. Cancels for runs
here arrive with every renewal, and on this process's control stream (listener.py).
Every tick also keeps this process's record (how many runs, its suspect: blame.py) in
step, for whoever takes its runs over should it die.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lib.errors import Fenced, FlowcastError, RecordLost
from lib.execution.blame import Suspicion
from lib.execution.outage import LiveGate
from lib.execution.ownership import Ownership
from lib.execution.record import StopReason

log = logging.getLogger(__name__)

RENEW_TICK_SECONDS = 0.1


@dataclass
class LocalRun:
    """An execution this process runs right now, under one ownership (fence, epoch)."""

    execution_id: str
    fence: str
    epoch: int
    tenant: str
    gate: LiveGate  # open while its lease is known held: events may be shown live
    task: asyncio.Task[None] | None = None  # the run: first event to last, then let go
    work: asyncio.Task[Any] | None = None  # the part a stop cancels: blocks, pause save
    stop_reason: StopReason | None = None  # why its work was cancelled
    checked_at: float = 0.0  # when its lease renewal was last tried
    pending: Callable[[], int] = lambda: 0  # events emitted and not stored yet
    stored: Callable[[], int] = lambda: 0  # the last id its writer stored
    retained: Callable[[], int] = lambda: 0  # bytes its ring retains, as modelled
    repair: Callable[[], None] = lambda: None  # recreate what the store lost
    identity: dict[str, str] = field(default_factory=dict)  # fields to recreate it with
    # Writes back a record kept outside the execution's keys that names it (the
    # Idempotency-Key's that started it), when the store lost writes of this run.
    write_back: Callable[[], Awaitable[None]] | None = None
    saved_pause: Any = None  # what its pause saved (finals.SavedPause), once saved
    keeper: Any = None  # keeps its outputs as the checkpoint does (checkpoint.Keeper)
    workflow: Any = None  # the workflow it runs, once known (model.Workflow)
    draining: asyncio.Event = field(default_factory=asyncio.Event)  # start no more blocks
    handoff: bool = False  # its work stopped for another process to go on with it

    def drain(self) -> None:
        """Start no more blocks: once the running ones finish, the run is handed off."""
        self.draining.set()

    def stop(self, reason: StopReason) -> None:
        """Cancel the run's work; the run itself still writes its last event.

        Only the work is cancelled, never the run's task: a run told to stop before
        its work began, or while it stores its last event, still ends properly.
        """
        if self.stop_reason is None:
            self.stop_reason = reason
        if self.work is not None and not self.work.done():
            self.work.cancel(reason)


class LocalRuns(dict[str, LocalRun]):
    """The executions running here, by id, and whether this process still takes on
    new ones (it stops when it shuts down)."""

    accepting: bool = True


class LeaseKeeper:
    """Renews the leases of the runs here (and stops those fenced or cancelled)."""

    def __init__(
        self,
        *,
        ownership: Ownership,
        lease_seconds: float,
        runs: LocalRuns,
        suspicion: Suspicion | None = None,
    ) -> None:
        self._ownership = ownership
        self._lease_seconds = lease_seconds
        self._runs = runs
        self._suspicion = suspicion

    async def renew_loop(self) -> None:
        """Renew each run's lease a third of a lease after its last check.

        Spread over the period, not all at once: a thousand runs renewed together held
        every Redis connection for a few hundred milliseconds each period, and every
        event of every run waited behind them (the stream latency p99).
        """
        period = self._lease_seconds / 3
        tick = min(RENEW_TICK_SECONDS, period)
        while True:
            await asyncio.sleep(tick)
            due = time.monotonic() - period
            runs = [
                run
                for run in self._runs.values()
                if run.checked_at <= due and run.stop_reason is not StopReason.FENCED  # no lease
            ]
            if runs:
                await asyncio.gather(*(self._renew(run) for run in runs))
            await self._publish()

    async def _publish(self) -> None:
        """Keep this process's record (what it runs, its suspect) in step, for the
        takers of its runs should it die (blame.py)."""
        if self._suspicion is None:
            return
        try:
            await self._suspicion.publish()
        except FlowcastError as exc:
            log.warning("could not record what this process runs", extra={"error": str(exc)})

    async def renew_now(self) -> None:
        """Renew every run's lease at once: another Redis server answers, and it must
        learn who owns what (renew.lua lets an owner it forgot back in) within its
        settle."""
        runs = [run for run in self._runs.values() if run.stop_reason is not StopReason.FENCED]
        if runs:
            await asyncio.gather(*(self._renew(run) for run in runs))

    async def _renew(self, run: LocalRun) -> None:
        started = time.monotonic()
        try:
            cancel_requested = await self._ownership.renew(
                run.execution_id, run.fence, run.epoch, run.tenant, run.stored()
            )
        except Fenced:
            run.gate.close()
            run.stop(StopReason.FENCED)
            return
        except RecordLost:
            log.warning(
                "the buffer lost a running execution, or some of its events",
                extra={"executionId": run.execution_id},
            )
            # Nobody else can own what the store does not have: the lease holds.
            run.checked_at = started
            run.gate.renewed(started)
            run.repair()
            return
        except FlowcastError as exc:
            # Nothing is shown live until a renewal succeeds: tried again sooner than a
            # renewal is due (a quarter of the period), so live events resume soon
            # after the store is back, without a hot loop while it is away.
            run.checked_at = started - self._lease_seconds / 4
            run.gate.close()
            log.warning(
                "lease renewal failed",
                extra={"executionId": run.execution_id, "error": str(exc)},
            )
            return
        run.checked_at = started
        run.gate.renewed(started)
        if cancel_requested:
            run.stop(StopReason.CANCEL)
