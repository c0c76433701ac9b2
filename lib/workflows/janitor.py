"""The janitor: carries on or ends the executions that nobody else will.

Every process runs one. It takes over an execution whose owner stopped renewing its
lease, or handed it off at a shutdown, and recovers it from its checkpoint (the runner
ends it ``worker_lost`` once it crashed too often); and it ends a pause whose approval
deadline passed with ``execution:failed`` (``approval_timeout``). Each starts with a
fenced claim (take over, expire), so of all the janitors exactly one wins, and the old
owner can never append after it. Times are Redis's (see ownership.py).

Hand-offs are announced on a stream every process reads (leases.py), so one is taken
over within moments; a process that starts takes over the ones handed off while none was running
at its first sweep, and the crashed ones once it has watched the store for a lease.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from lib.errors import FlowcastError
from lib.execution.events import EXECUTION_CANCELLED, EXECUTION_FAILED
from lib.execution.log import ExecutionLog
from lib.execution.ownership import Ownership

log = logging.getLogger(__name__)


# Emits the terminal event of an execution that was just claimed.
Ending = Callable[[ExecutionLog], None]
# Claims an execution by a transition (expire) and writes an ending. None when it did;
# else why the claim was refused ("notdue", "execution_completed", "not_found", …).
Finish = Callable[[str, str, str, Ending], Awaitable[str | None]]
# Takes over an execution from the owner named (only if it handed off, when the flag
# says so) and recovers it; None when it did, else why the claim was refused.
Recover = Callable[[str, str, bool], Awaitable[str | None]]


def cancelled(emitter: ExecutionLog) -> None:
    emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})


def worker_lost(emitter: ExecutionLog) -> None:
    error = {"code": "worker_lost", "message": "the process running the execution stopped"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


def approval_timeout(emitter: ExecutionLog) -> None:
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
        recover: Recover,
        accepting: Callable[[], bool] = lambda: True,
        restarted: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._ownership = ownership
        self._lease_seconds = lease_seconds
        self._is_local = is_local
        self._finish = finish
        self._recover = recover
        self._accepting = accepting
        # Told when another Redis server answers than before (a restart, a failover).
        self._restarted = restarted
        self._store_id: str | None = None

    async def run(self) -> None:
        """Sweep at once, then every half lease (jittered), until cancelled."""
        healthy_since = time.monotonic()
        first = True
        while True:
            if not first:
                await asyncio.sleep(self._lease_seconds / 2 * random.uniform(0.8, 1.2))
            first = False
            if not self._accepting():
                continue  # shutting down: this process takes nothing over any more
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

        Nothing is taken from an owner until the store has answered well for a lease:
        not a lease (its owner could not renew), nor a pause's deadline (an owner that
        resumed it may still have to re-assert its resume into a store that forgot
        it). Executions their owner handed off are taken at once.
        """
        trusted = time.monotonic() - healthy_since >= self._lease_seconds
        asked = time.monotonic()
        due = await self._ownership.due_leases()
        if time.monotonic() - asked > self._lease_seconds / 3:
            # A stalled store: owners could not renew either, so their leases
            # prove nothing until a lease has passed with the store answering.
            return False
        for execution_id, fence in due:
            await self.take_over(execution_id, fence, handoff_only=not trusted)
        if not trusted:
            return True
        for execution_id in await self._ownership.due_deadlines():
            code = await self._finish(execution_id, "expire", "", approval_timeout)
            if code != "notdue":
                await self._ownership.forget_deadline(execution_id)
        return True

    async def take_over(self, execution_id: str, fence: str, *, handoff_only: bool) -> None:
        """Take over an execution from ``fence`` and recover it, if it is due."""
        if self._is_local(execution_id) or not self._accepting():
            return
        code = await self._recover(execution_id, fence, handoff_only)
        if code not in ("lease", "settling"):
            # Recovered now by a new owner (whose own entry watches it from here on),
            # or settled already: this entry names nothing left to do.
            await self._ownership.forget_lease(execution_id, fence)
