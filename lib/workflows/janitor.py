"""The janitor: finds the executions that nobody else will carry on or end.

Every process runs one. Each pass it reports what is due, and its owner (the runner)
acts: take over an execution whose owner stopped renewing its lease, or handed it off at
a shutdown, and recover it from its checkpoint (takeovers.py; it ends ``worker_lost``
once it crashed too often); end a pause whose approval deadline passed with
``execution:failed`` (``approval_timeout``); and, when another Redis server answers than
before, re-assert what the store may have forgotten. Each takeover or ending starts with
a fenced claim (take over, expire), so of all the janitors exactly one wins, and the old
owner can never append after it. Times are Redis's (see watchlists.py).

It looks often (every ``StoreIdentity.check_seconds``, a fraction of a second): which Redis
server answers (when another one does, this process re-asserts what it knows at once,
and ownership waits a short settle for every process to do so), and which approval
deadlines passed, so a deadline fires within about a second, also right after a restart
of Redis or of this process; only after Redis came back without writes it had
acknowledged (an older snapshot) do the deadlines it brought back wait about a lease,
for the owner of a pause resumed since to re-assert it even if it was stalled across
the settle (a pause stored again into a store that came back empty waits the same: its
deadline is listed a lease ahead, finals.py). Leases
are swept every half lease: a crashed owner's lease proves nothing until the store has
answered well for a whole lease (it may have been unable to renew). Hand-offs are
announced on a stream every process reads (leases.py), so one is taken over within
moments; and a process that starts takes over at once the executions of the earlier
processes of its node (``dead_nodes``: it proved them dead), so a lone server that
restarts picks up its own orphaned runs without waiting a lease.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from lib.errors import FlowcastError
from lib.execution.events import EXECUTION_CANCELLED, EXECUTION_FAILED
from lib.execution.log import ExecutionLog
from lib.execution.record import RecoveryReason, Takeover
from lib.execution.store import Store, StoreIdentity
from lib.execution.watchlists import WatchLists

log = logging.getLogger(__name__)


# The most deadlines a store found behind holds back (the ones due soonest).
HELD_DEADLINES = 10_000

# Emits the terminal event of an execution that was just claimed.
Ending = Callable[[ExecutionLog], None]


def cancelled(emitter: ExecutionLog) -> None:
    emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})


def worker_lost(emitter: ExecutionLog) -> None:
    error = {
        "code": RecoveryReason.WORKER_LOST.value,
        "message": "the process running the execution stopped",
    }
    emitter.emit(EXECUTION_FAILED, {"error": error})


def quarantined(deaths: int) -> Ending:
    """The ending of a run quarantined (blame.py): the processes running it died
    ``deaths`` times, the last time with it their one suspect beside other runs."""
    message = (
        f"quarantined: its owners died {deaths} times while running it (the last time it "
        "was the only suspect on its process, beside other runs, which were recovered); "
        "it is not run again"
    )

    def ending(emitter: ExecutionLog) -> None:
        error = {"code": RecoveryReason.QUARANTINED.value, "message": message}
        emitter.emit(EXECUTION_FAILED, {"error": error})

    return ending


def approval_timeout(emitter: ExecutionLog) -> None:
    error = {"code": "approval_timeout", "message": "nobody answered the approval in time"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


@dataclass(frozen=True)
class Due:
    """What one pass found, for the janitor's owner to act on in this order."""

    # Another Redis server answers than before: re-assert what this process knows
    # before anything is taken over (it may have forgotten how runs here ended).
    restarted: bool = False
    # (execution id, fence) of the runs of this node's earlier processes, dead: taken
    # over at once, lease or not (Takeover.DEAD).
    dead: tuple[tuple[str, str], ...] = ()
    # (execution id, fence) of the leases that ended, on Redis's clock (every half
    # lease; empty in the passes between).
    leases: tuple[tuple[str, str], ...] = ()
    # Which owners those leases may be taken from: until the store has answered well
    # for a lease, only the ones that handed off (a lease proves nothing when its owner
    # could not renew).
    takeover: Takeover = Takeover.HANDOFF
    # Paused executions whose approval deadline passed; for about a lease after the
    # store was found behind (it lost writes it had acknowledged), not the ones it held
    # then: a pause it brought back may have been resumed, and its owner, stalled, not
    # have re-asserted it yet. Pauses stored since expire as ever.
    deadlines: tuple[str, ...] = ()


class Janitor:
    """Watches the expired leases, the due approval deadlines and the store's identity."""

    def __init__(
        self,
        *,
        store: StoreIdentity,
        watch: WatchLists,
        lease_seconds: float,
        dead_nodes: tuple[str, ...] = (),
    ) -> None:
        self._store = store
        self._watch = watch
        self._lease_seconds = lease_seconds
        self._store_id: str | None = None
        self._healthy_since = time.monotonic()
        self._next_sweep = 0.0  # the leases are swept at the first look, then every half lease
        # Earlier processes of this node, dead: looked for until none of their runs is left.
        self._dead_nodes = dead_nodes
        # The store was found behind (store.py): the deadlines it held then, which wait
        # until ``behind_seconds`` is over; None while it is not behind.
        self._held: frozenset[str] | None = None

    def distrust(self) -> None:
        """The store failed (or acting on a pass did): every owner needs a full lease
        to renew before anyone may call its lease expired."""
        self._healthy_since = time.monotonic()

    async def passes(self) -> AsyncIterator[Due]:
        """What is due, at once, then every ``check_seconds``, until cancelled.

        A pass that fails is logged and counts as an outage (``distrust``); so should
        the owner's acting on one that fails.
        """
        first = True
        while True:
            if not first:
                await asyncio.sleep(self._store.check_seconds)
            first = False
            try:
                due = await self._look()
            except FlowcastError as exc:
                self.distrust()
                log.warning("janitor pass failed", extra={"error": str(exc)})
                continue
            if due is not None:
                yield due

    async def _look(self) -> Due | None:
        """One pass; None when there is nothing to act on.

        A deadline needs no lease of trust: the store decides, atomically, whether the
        pause is still there to expire (after an outage it forgot nothing; after it
        changed servers, the settle just passed) -- unless the store came back behind,
        without writes it had acknowledged: then a pause it brought back may have been
        resumed since, and the deadlines it held then wait about a lease
        (``behind_seconds`` of store.py), as leases do after any change. Leases need a
        lease of trust (see ``distrust``).
        """
        asked = time.monotonic()
        store = await self._store.check()
        if time.monotonic() - asked > self._lease_seconds / 3:
            # A stalled store (DEBUG SLEEP, a paused server): owners could neither
            # renew nor re-assert meanwhile; give them a lease.
            self.distrust()
        restarted = False
        if store.identity != self._store_id:
            # Another server answers (or this is the first look, while the store settles
            # after such a change): owners re-assert what it may have lost...
            first_look = self._store_id is None
            self._store_id = store.identity
            restarted = not first_look or store.settling_seconds > 0
            if not first_look:
                log.warning(
                    "the event store answers from another server now (restarted or failed "
                    "over); ownership waits about a second while every process tells it "
                    "what it holds",
                    extra={"settleSeconds": store.settling_seconds},
                )
        await self._hold_restored(store)
        if store.settling_seconds > 0:
            # ...before anyone may end an execution it holds (see store.py).
            self.distrust()
            return Due(restarted=True) if restarted else None
        dead: list[tuple[str, str]] = []
        if self._dead_nodes:
            dead = await self._watch.leases_of(self._dead_nodes)
            if not dead:
                self._dead_nodes = ()  # all taken over (or settled): done with them
        leases: list[tuple[str, str]] = []
        trusted = time.monotonic() - self._healthy_since >= self._lease_seconds
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + (
                self._lease_seconds / 2 * random.uniform(0.8, 1.2)
            )
            asked = time.monotonic()
            leases = await self._watch.due_leases()
            if time.monotonic() - asked > self._lease_seconds / 3:
                # A stalled store: owners could not renew either, so their leases prove
                # nothing until a lease has passed with the store answering.
                self.distrust()
                leases, trusted = [], False
        deadlines = await self._due_deadlines()
        if not (restarted or dead or leases or deadlines):
            return None
        how = Takeover.EXPIRED if trusted else Takeover.HANDOFF
        return Due(restarted, tuple(dead), tuple(leases), how, tuple(deadlines))

    async def _hold_restored(self, store: Store) -> None:
        """When the store is first seen behind, note the deadlines it holds then (those
        that may fall due before the wait ends): a pause it brought back may have been
        resumed, its owner not yet back to say so. Forgotten once the wait is over."""
        if store.behind_seconds <= 0:
            self._held = None
            return
        if self._held is not None:
            return
        ahead_ms = int(store.behind_seconds * 1000)
        self._held = frozenset(
            await self._watch.due_deadlines(limit=HELD_DEADLINES, ahead_ms=ahead_ms)
        )
        log.warning(
            "the event store came back without writes it had acknowledged (an older "
            "snapshot, or a lagging replica); the approval deadlines it brought back wait "
            "about a lease, for the owners of resumed pauses to tell it",
            extra={"waitSeconds": store.behind_seconds, "held": len(self._held)},
        )

    async def _due_deadlines(self) -> list[str]:
        """The pauses to expire now: those whose deadline passed, but for the ones held
        since the store was found behind (``_hold_restored``). A pause stored since is
        not restored state: its deadline fires as ever."""
        if self._held is None:
            return await self._watch.due_deadlines()
        due = await self._watch.due_deadlines(limit=100 + len(self._held))
        return [execution_id for execution_id in due if execution_id not in self._held]
