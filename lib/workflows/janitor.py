"""The janitor: ends the executions that nobody else will end.

Every process runs one. It ends an execution whose owner stopped renewing its lease
with ``execution:failed`` (``worker_lost``; it becomes ``execution:cancelled`` if a
cancel was accepted before), and a pause whose approval deadline passed with
``execution:failed`` (``approval_timeout``). Each ending starts with a fenced claim
(take over, expire), so of all the janitors exactly one writes it, and the old owner
can never append after it. Times are Redis's (see ownership.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from lib.errors import FlowcastError
from lib.execution.emitter import Emitter
from lib.execution.events import EXECUTION_CANCELLED, EXECUTION_FAILED
from lib.execution.ownership import Ownership

log = logging.getLogger(__name__)

# Emits the terminal event of an execution that was just claimed.
Ending = Callable[[Emitter], None]
# Claims an execution by a transition (takeover or expire; for a takeover, from the
# owner named) and writes an ending. None when it did; else why the claim was refused
# ("lease", "notdue", "moved", "execution_completed", "not_found", …).
Finish = Callable[[str, str, str, Ending], Awaitable[str | None]]


def cancelled(emitter: Emitter) -> None:
    emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})


def worker_lost(emitter: Emitter) -> None:
    error = {"code": "worker_lost", "message": "the process running the execution stopped"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


def approval_timeout(emitter: Emitter) -> None:
    error = {"code": "approval_timeout", "message": "nobody answered the approval in time"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


class Janitor:
    """Watches the expired leases and the due approval deadlines."""

    def __init__(
        self,
        *,
        ownership: Ownership,
        lease_seconds: float,
        is_local: Callable[[str], bool],
        finish: Finish,
        restarted: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._ownership = ownership
        self._lease_seconds = lease_seconds
        self._is_local = is_local
        self._finish = finish
        # Told when another Redis server answers than before (a restart, a failover).
        self._restarted = restarted
        self._store_id: str | None = None

    async def run(self) -> None:
        """Sweep every half lease (jittered) until cancelled."""
        healthy_since = time.monotonic()
        while True:
            await asyncio.sleep(self._lease_seconds / 2 * random.uniform(0.8, 1.2))
            try:
                asked = time.monotonic()
                store = await self._ownership.store()
                if time.monotonic() - asked > self._lease_seconds / 3:
                    # A stalled store (DEBUG SLEEP, a paused server): owners could
                    # neither renew nor re-assert meanwhile; give them a lease.
                    healthy_since = time.monotonic()
                if store.identity != self._store_id:
                    # Another server answers (or this is the first look, while the store
                    # settles after such a change): owners re-assert what it may have
                    # lost...
                    first_look = self._store_id is None
                    self._store_id = store.identity
                    if self._restarted is not None and (
                        not first_look or store.settling_seconds > 0
                    ):
                        await self._restarted()
                if store.settling_seconds > 0:
                    # ...before anyone may end an execution it holds (see ownership.py).
                    healthy_since = time.monotonic()
                    continue
                if not await self.sweep(healthy_since):
                    healthy_since = time.monotonic()
            except FlowcastError as exc:
                # After an outage every owner needs a full lease to renew before anyone
                # may call its lease expired.
                healthy_since = time.monotonic()
                log.warning("janitor pass failed", extra={"error": str(exc)})

    async def sweep(self, healthy_since: float) -> bool:
        """One pass; False when the store answered too slowly to trust its leases.

        Nothing is ended until the store has answered well for a lease: not a lease
        (its owner could not renew), nor a pause's deadline (an owner that resumed it
        may still have to re-assert its resume into a store that forgot it).
        """
        if time.monotonic() - healthy_since < self._lease_seconds:
            return True
        asked = time.monotonic()
        due = await self._ownership.due_leases()
        if time.monotonic() - asked > self._lease_seconds / 3:
            # A stalled store: owners could not renew either, so their leases
            # prove nothing until a lease has passed with the store answering.
            return False
        for execution_id, fence in due:
            if self._is_local(execution_id):
                continue
            code = await self._finish(execution_id, "takeover", fence, worker_lost)
            if code != "lease":
                # Ended now by a new owner (whose own entry watches it from here
                # on), or settled already: this entry names nothing left to do.
                await self._ownership.forget_lease(execution_id, fence)
        for execution_id in await self._ownership.due_deadlines():
            code = await self._finish(execution_id, "expire", "", approval_timeout)
            if code != "notdue":
                await self._ownership.forget_deadline(execution_id)
        return True
