"""The janitor: carries on or ends the executions that nobody else will.

Every process runs one. It takes over an execution whose owner stopped renewing its
lease, or handed it off at a shutdown, and recovers it from its checkpoint (the runner
ends it ``worker_lost`` once it crashed too often); and it ends a pause whose approval
deadline passed with ``execution:failed`` (``approval_timeout``). Each starts with a
fenced claim (take over, expire), so of all the janitors exactly one wins, and the old
owner can never append after it. Times are Redis's (see ownership.py).

It looks often (every ``Ownership.check_seconds``, a fraction of a second): which Redis
server answers (when another one does, this process re-asserts what it knows at once,
and ownership waits a short settle for every process to do so), and which approval
deadlines passed, so a deadline fires within about a second, also right after a restart
of Redis or of this process. Leases are swept every half lease: a crashed owner's lease
proves nothing until the store has answered well for a whole lease (it may have been
unable to renew). Hand-offs are announced on a stream every process reads (leases.py),
so one is taken over within moments; and a process that starts takes over at once the
executions of the earlier processes of its node (``dead_nodes``: it proved them dead),
so a lone server that restarts picks up its own orphaned runs without waiting a lease.
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
from lib.execution.ownership import Ownership, Takeover

log = logging.getLogger(__name__)


# Emits the terminal event of an execution that was just claimed.
Ending = Callable[[ExecutionLog], None]
# Claims an execution by a transition (expire) and writes an ending. None when it did;
# else why the claim was refused ("notdue", "execution_completed", "not_found", …).
Finish = Callable[[str, str, str, Ending], Awaitable[str | None]]
# Takes over an execution from the owner named (which owner it may replace: see
# Takeover) and recovers it; None when it did, else why the claim was refused.
Recover = Callable[[str, str, Takeover], Awaitable[str | None]]


def cancelled(emitter: ExecutionLog) -> None:
    emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})


def worker_lost(emitter: ExecutionLog) -> None:
    error = {"code": "worker_lost", "message": "the process running the execution stopped"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


def approval_timeout(emitter: ExecutionLog) -> None:
    error = {"code": "approval_timeout", "message": "nobody answered the approval in time"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


class Janitor:
    """Watches the expired leases, the due approval deadlines and the store's identity."""

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
        dead_nodes: tuple[str, ...] = (),
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
        # Earlier processes of this node, dead: their runs are taken over at first.
        self._dead_nodes = dead_nodes

    async def run(self) -> None:
        """Look at once, then every ``check_seconds``, until cancelled."""
        healthy_since = time.monotonic()
        next_sweep = 0.0  # the leases are swept at the first look, then every half lease
        first = True
        while True:
            if not first:
                await asyncio.sleep(self._ownership.check_seconds)
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
                    if not first_look:
                        log.warning(
                            "the event store answers from another server now (restarted "
                            "or failed over); ownership waits about a second while every "
                            "process tells it what it holds",
                            extra={"settleSeconds": store.settling_seconds},
                        )
                    if self._restarted is not None and (
                        not first_look or store.settling_seconds > 0
                    ):
                        await self._restarted()
                if store.settling_seconds > 0:
                    # ...before anyone may end an execution it holds (see ownership.py).
                    healthy_since = time.monotonic()
                    continue
                # A deadline needs no lease of trust: the store decides, atomically,
                # whether the pause is still there to expire (after an outage it forgot
                # nothing; after it changed servers, the settle just passed).
                await self.expire_deadlines()
                if self._dead_nodes:
                    await self.take_over_dead()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + (
                        self._lease_seconds / 2 * random.uniform(0.8, 1.2)
                    )
                    if not await self.sweep(healthy_since):
                        healthy_since = time.monotonic()
            except FlowcastError as exc:
                # After an outage every owner needs a full lease to renew before anyone
                # may call its lease expired.
                healthy_since = time.monotonic()
                log.warning("janitor pass failed", extra={"error": str(exc)})

    async def sweep(self, healthy_since: float) -> bool:
        """One pass over the leases; False when the store answered too slowly to trust
        them.

        Nothing is taken from an owner until the store has answered well for a lease
        (its owner may have been unable to renew). Executions their owner handed off
        are taken at once.
        """
        trusted = time.monotonic() - healthy_since >= self._lease_seconds
        asked = time.monotonic()
        due = await self._ownership.due_leases()
        if time.monotonic() - asked > self._lease_seconds / 3:
            # A stalled store: owners could not renew either, so their leases
            # prove nothing until a lease has passed with the store answering.
            return False
        how = Takeover.EXPIRED if trusted else Takeover.HANDOFF
        for execution_id, fence in due:
            await self.take_over(execution_id, fence, how=how)
        return True

    async def expire_deadlines(self) -> None:
        """End the pauses whose approval deadline passed (the claim says which)."""
        for execution_id in await self._ownership.due_deadlines():
            code = await self._finish(execution_id, "expire", "", approval_timeout)
            if code != "notdue":
                await self._ownership.forget_deadline(execution_id)

    async def take_over_dead(self) -> None:
        """Take over every run of the earlier processes of this node, lease or not; once
        all are taken (or settled), this process is done with them."""
        found = await self._ownership.leases_of(self._dead_nodes)
        left = 0
        for execution_id, fence in found:
            if await self.take_over(execution_id, fence, how=Takeover.DEAD) == "settling":
                left += 1
        if found:
            extra = {"count": len(found) - left, "nodes": list(self._dead_nodes)}
            log.info("took over the runs of this node's earlier processes", extra=extra)
        if not left:
            self._dead_nodes = ()

    async def take_over(self, execution_id: str, fence: str, *, how: Takeover) -> str | None:
        """Take over an execution from ``fence`` and recover it, if it is due; None when
        it did, else why not."""
        if self._is_local(execution_id) or not self._accepting():
            return "local"
        code = await self._recover(execution_id, fence, how)
        if code not in ("lease", "settling"):
            # Recovered now by a new owner (whose own entry watches it from here on),
            # or settled already: this entry names nothing left to do.
            await self._ownership.forget_lease(execution_id, fence)
        return code
