"""The loops a process runs beside its executions, and how it stops them.

The lease keeper renews the runs here, the control listener takes over hand-offs as
they are announced (and carries cancels and queue wake-ups), the janitor's passes
report what is due (expired leases, dead processes, expired approvals, a store that
changed servers) for the takeovers to act on, and the dispatcher takes queued work.
A shutdown drains the runs within the grace, hands the rest off, then stops the loops:
the listener and the dispatcher are told to stop first, the rest are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from lib.errors import FlowcastError
from lib.execution.record import StopReason, Takeover
from lib.workflows.dispatch import Dispatcher
from lib.workflows.janitor import Due, Janitor
from lib.workflows.leases import LeaseKeeper
from lib.workflows.listener import ControlListener
from lib.workflows.parts import Parts
from lib.workflows.takeovers import Takeovers

log = logging.getLogger(__name__)

# How long the tending tasks may take to stop once told (or cancelled) at shutdown.
STOP_SECONDS = 2.0


class Tending:
    """Starts this process's loops, and drains and stops them at shutdown."""

    def __init__(
        self,
        parts: Parts,
        *,
        keeper: LeaseKeeper,
        listener: ControlListener,
        janitor: Janitor,
        takeovers: Takeovers,
        dispatcher: Dispatcher,
        shutdown_grace_seconds: float,
    ) -> None:
        self._ownership = parts.transitions.ownership
        self._finals = parts.finals
        self._runs = parts.runs
        self._keeper = keeper
        self._listener = listener
        self._janitor = janitor
        self._takeovers = takeovers
        self.dispatcher = dispatcher
        self._grace = shutdown_grace_seconds
        self._loops: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._keeper.renew_loop(), name="lease-renewal"),
            asyncio.create_task(self._listen(), name="control-listener"),
            asyncio.create_task(self._tend(), name="janitor"),
            asyncio.create_task(self.dispatcher.run(), name="dispatcher"),
        ]
        self.dispatcher.nudge()  # work may have waited for a worker already

    async def stop(self) -> None:
        """Drain the runs here (the process takes nothing new by now), hand off the
        rest, then stop the loops."""
        await self._drain()
        await self._stop_listening()
        await self._stop_dispatching()
        await self._cancel([*self._tasks(), *self._loops])

    async def _drain(self) -> None:
        """Let the running blocks finish within the grace, then hand every run off."""
        running = self._tasks()
        for local in list(self._runs.values()):
            local.drain()
        if running:
            log.info("draining executions", extra={"count": len(running), "grace": self._grace})
            await asyncio.wait(running, timeout=self._grace)
        for local in list(self._runs.values()):
            local.stop(StopReason.HANDOFF)
        if remaining := self._tasks():
            await asyncio.wait(remaining, timeout=10)

    async def _stop_listening(self) -> None:
        # The control loop ends on a wake-up message: a blocking read, once cancelled,
        # may be retried by the client and hold the shutdown up.
        control = next(task for task in self._loops if task.get_name() == "control-listener")
        with contextlib.suppress(FlowcastError, TimeoutError):
            async with asyncio.timeout(STOP_SECONDS):
                await self._listener.stop()
            await asyncio.wait([control], timeout=STOP_SECONDS)

    async def _stop_dispatching(self) -> None:
        # Told to stop, the dispatcher ends at its next turn rather than being cancelled
        # in the middle of a Redis call (the cancel that follows is for one that hangs).
        self.dispatcher.stop()
        dispatching = [task for task in self._loops if task.get_name() == "dispatcher"]
        await asyncio.wait(dispatching, timeout=STOP_SECONDS)

    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        # Bounded: a task stuck in a client library that ignores the cancel must not
        # keep the process from exiting (its lease then expires, as on a crash).
        _done, stuck = await asyncio.wait(tasks, timeout=STOP_SECONDS)
        if stuck:
            names = sorted(task.get_name() for task in stuck)
            where = [
                f"{frame.f_code.co_filename}:{frame.f_lineno}"
                for task in stuck
                for frame in task.get_stack()
            ]
            log.warning("tasks did not stop", extra={"tasks": names, "where": where})

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [local.task for local in self._runs.values() if local.task is not None]

    async def _tend(self) -> None:
        """Act on what each janitor pass finds due, in order: re-assert into a store
        that changed servers, take over the expired leases, end the expired pauses."""
        async for due in self._janitor.passes():
            if not self._runs.accepting:
                continue  # shutting down: this process takes nothing over any more
            try:
                await self._ownership.take_back_owed()
                self.dispatcher.nudge()
                if due.restarted:
                    await self._reassert()
                await self._recover(due)
                for execution_id in due.deadlines:
                    await self._takeovers.expire(execution_id)
            except FlowcastError as exc:
                # As a failed pass: owners need a lease to renew before anyone may
                # call their lease expired.
                self._janitor.distrust()
                log.warning("janitor pass failed", extra={"error": str(exc)})

    async def _recover(self, due: Due) -> None:
        """Take over what is due, into this process's free slots only (an API replica,
        with none, leaves it all to the workers). A recovery continues a run its tenant
        counted already (it replaces the dead owner's entry) and goes before any start:
        while some wait for a slot here, the dispatcher takes nothing from the queue, so
        the next slot that frees is theirs at the next pass (another process with a free
        slot may take them first). A run that would only end (a cancel was accepted
        for it) is taken over without a slot."""
        found = [(eid, fence, Takeover.DEAD) for eid, fence in due.dead]
        found += [(eid, fence, due.takeover) for eid, fence in due.leases]
        if not found or self.dispatcher.slots == 0:
            # Between sweeps the leases are not looked at: a wait noted stands (it
            # lapses by itself once no sweep finds them due: ``recoveries_wait``).
            return
        waiting = False
        for execution_id, fence, how in found:
            with self.dispatcher.slot(recovery=True) as here:
                if here or await self._takeovers.only_ends(execution_id):
                    # A run a cancel was accepted for only ends (no block runs again):
                    # it needs no slot, and must not wait for one (its 202 said it
                    # happens; the fresh-eyes review of 60a78ad saw it wait for the
                    # longest run here to end).
                    await self._takeovers.take_over(execution_id, fence, how=how)
                else:
                    waiting = True
        self.dispatcher.recoveries_wait(waiting)

    async def _listen(self) -> None:
        """Take over each execution handed off by another process, as it is announced
        (the janitors would find its lease due anyway, should this fail)."""
        async for execution_id, fence in self._listener.handoffs():
            try:
                with self.dispatcher.slot(recovery=True) as here:
                    if not here:
                        # No slot here (or none at all: an API replica): a process with
                        # one takes it over, or this one at a janitor pass (it is due).
                        continue
                    await self._takeovers.take_over(execution_id, fence, how=Takeover.HANDOFF)
            except FlowcastError as exc:
                log.warning(
                    "taking over a hand-off failed",
                    extra={"executionId": execution_id, "error": str(exc)},
                )

    async def _reassert(self) -> None:
        """Another Redis server answers: tell it at once what it may have forgotten (the
        runs here, by renewing their leases; how the latest runs here ended), within
        the short settle every process waits for."""
        await self._keeper.renew_now()
        await self._finals.reassert()
        # The lines and the records may disagree now (they live in other hash slots):
        # a queued execution no line holds is put back in line.
        if self.dispatcher.slots > 0:
            await self.dispatcher.reconcile()
