"""The worker side of the queue: this process takes queued executions while it has
free slots, and runs each as its new owner (SPEC §14).

A take is woken (``nudge``) whenever a slot may be free or work may wait: a start here
was queued, a run here ended, another process announced queued work (the control
listener reads the queue's wake stream), and every half lease without any of those (the
safety net for a missed announcement, or a cap freed by a lease that ran out). Each
take is fair across tenants (queue.py); then the claim decides (claim.lua "take"): an
execution claimed by another, or cancelled meanwhile, is dropped. Each of those rounds
also gives back what a dead taker took and never claimed (``reclaim``), in every
process, with slots or not: nothing else is sure to come round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from redis.asyncio.cluster import RedisCluster

from lib.backend import Batch, translated
from lib.backoff import Backoff
from lib.errors import DeliveryRevoked, FlowcastError, NotFound, WrongStatus
from lib.execution.indexes import created_ms
from lib.execution.ownership import Claim
from lib.execution.queue import CONTINUATION_OFFSET_MS, Backlog, Queue, Taken
from lib.execution.record import ExecutionMeta, Mode, Status
from lib.metrics import Metrics
from lib.workflows.bodies import NOT_STARTED, workflow_lost
from lib.workflows.executor import RunState
from lib.workflows.launcher import identity_of
from lib.workflows.leases import LocalRuns
from lib.workflows.model import Workflow
from lib.workflows.parts import Parts

log = logging.getLogger(__name__)

# Runs an execution this process claimed from the queue: (its record, the claim, its
# workflow, its input, its checkpoint, its run state as stored, how long it waited in ms).
Start = Callable[[ExecutionMeta, Claim, Workflow, Any, RunState, dict[str, bytes], int], None]


# How long a worker reads again the record of a start it took just as it was queued.
RECORD_WAIT_SECONDS = 1.0
# How many leases after it was queued a start whose record never came leaves its line.
ORPHAN_LEASES = 10


class Dispatcher:
    """Takes queued work for this process's free slots (``slots``; 0: none)."""

    def __init__(
        self,
        parts: Parts,
        *,
        slots: int,
        start: Start,
        recall: Callable[[str, ExecutionMeta], Awaitable[int]] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        transitions = parts.transitions
        self._parts = parts
        self._queue: Queue = transitions.queue
        self._ownership = transitions.ownership
        self._watch = transitions.watch
        self._admission = transitions.admission
        self._control = transitions.control
        self._buffer = parts.buffer
        self._states = parts.states
        self._runs: LocalRuns = parts.runs
        self.slots = slots
        self._start = start
        # What a claim must know of what a store back behind forgot (takeovers.py
        # ``recalled``): the id to number above.
        self._recall = recall
        self._metrics = metrics
        self._nudged = asyncio.Event()
        # Set by every announcement of queued work (``heard``): a start taken before its
        # record existed is read again as soon as its own announcement comes, which its
        # process sends once the record is written (``_record_of``).
        self._announced = asyncio.Event()
        self._stopping = False
        # Slots held by starts and takes on their way to launching (``slot``).
        self._holding = 0
        # The rounds that come without a nudge, and those that reclaim.
        self._every = max(0.05, self._queue.lease_ms / 2000)
        self._next_reclaim = 0.0
        # A run ended here while this process takes nothing: the others are told.
        self._tell = False
        # Runs due for a takeover found no free slot here (tending.py): the next slot
        # that frees is theirs, not the queue's, until this time (monotonic) unless a
        # janitor pass finds them waiting again (``recoveries_wait``).
        self._recoveries_until = 0.0

    def free(self) -> int:
        """Slots free here now (what runs here, taken or not from the queue, fills them,
        and so does each start or take on its way to launching)."""
        return max(0, self.slots - len(self._runs) - self._holding)

    @contextlib.contextmanager
    def slot(self, *, recovery: bool = False) -> Iterator[bool]:
        """Hold a free slot, if there is one (True), while a start or a take is on its
        way to launching here: concurrent starts each saw the same free slot before any
        had launched, and ran past ``slots``. The launch fills it once made. While
        recoveries wait for a slot here, only a ``recovery`` gets one: a start or a
        resume sent here goes in line instead (it took the slot that freed before the
        next janitor pass, and the recovery waited again, as long as they kept coming:
        the fresh-eyes review of 60a78ad)."""
        if not (self._runs.accepting and self.free() > 0) or (
            self._recoveries_waiting() and not recovery
        ):
            yield False
            return
        self._holding += 1
        try:
            yield True
        finally:
            self._holding -= 1

    def recoveries_wait(self, waiting: bool) -> None:
        """Whether runs due for a takeover wait for a slot here (a janitor pass that
        found some due says): meanwhile nothing is taken from the queue. A wait lapses
        by itself a lease later: a pass that finds nothing due says nothing (another
        process took them over, or their owner came back), and the queue must not wait
        for a pass that never comes (the fresh-eyes review of 60a78ad: a worker took
        nothing from the queue any more). Every sweep that finds them due still
        (every half lease) holds it again before it lapses."""
        self._recoveries_until = time.monotonic() + self._queue.lease_ms / 1000 if waiting else 0.0

    def _recoveries_waiting(self) -> bool:
        return time.monotonic() < self._recoveries_until

    def stop(self) -> None:
        """End ``run`` at its next turn (a shutdown, once the runs here let go): it need
        not be cancelled in the middle of a Redis call."""
        self._stopping = True
        self._nudged.set()

    def nudge(self) -> None:
        """Look at the queue again soon (a slot may be free, or work may wait)."""
        if self.slots > 0:
            self._nudged.set()

    def heard(self) -> None:
        """Another process announced queued work (the control listener read the queue's
        wake stream): look at the queue, and read again a record being waited for."""
        self._announced.set()
        self.nudge()

    def freed(self) -> None:
        """A run here ended: its tenant may run one more, anywhere. This process looks
        (``nudge``); one that takes nothing now (no slots, or draining) tells the others
        instead, or a backlog held by its cap would wait for their next round."""
        if self.slots > 0 and self._runs.accepting:
            self._nudged.set()
        else:
            self._tell = True
            self._nudged.set()

    async def ahead(self, tenant: str, execution_id: str) -> int | None:
        """About how many executions start before this queued one (None: not queued)."""
        return await self._queue.ahead(tenant, execution_id)

    async def backlog(self) -> Backlog:
        """What waits in every tenant's line (for /metrics)."""
        return await self._queue.backlog()

    async def announce(self) -> None:
        """Tell every process that work was queued (best effort: their own rounds
        look anyway)."""
        try:
            await self._control.announce_queued()
        except FlowcastError as exc:
            log.warning("could not announce queued work", extra={"error": str(exc)})

    def announce_in(self, batch: Batch) -> None:
        """``announce`` as a best-effort command of ``batch`` (a queued start's creation)."""
        self._control.announce_queued_in(batch)

    async def run(self) -> None:
        """Take work whenever nudged (or half a lease passed), while slots are free and
        the process accepts; every half lease, nudged or not, give back first what dead
        takers never claimed (a busy process is nudged by every run that ends: a look
        only when no nudge came for half a lease would never come there)."""
        loop = asyncio.get_running_loop()
        while not self._stopping:
            # A tick instead of a timeout around the wait: on Python 3.11 a cancel that
            # lands as such a timeout fires can come out as the timeout, and be lost.
            tick = loop.call_later(self._every, self._nudged.set)
            try:
                await self._nudged.wait()
            finally:
                tick.cancel()
            self._nudged.clear()
            if self._stopping:
                return
            if self._tell:
                self._tell = False
                await self.announce()
            if time.monotonic() >= self._next_reclaim:
                self._next_reclaim = time.monotonic() + self._every
                try:
                    await self.reclaim()
                except FlowcastError as exc:
                    log.warning("giving back stale deliveries failed", extra={"error": str(exc)})
            while self._runs.accepting and self.free() > 0 and not self._recoveries_waiting():
                try:
                    with self.slot():
                        took = await self.take_one()
                    if not took:
                        break
                except FlowcastError as exc:
                    log.warning("taking queued work failed", extra={"error": str(exc)})
                    break

    async def take_one(self) -> bool:
        """Take and start one queued execution; False when none could be taken."""
        fence = self._parts.new_fence()
        taken = await self._queue.take(fence)
        if taken is None:
            return False
        await self._claim_and_start(taken, fence)
        return True

    async def _claim_and_start(self, taken: Taken, fence: str) -> None:
        eid = taken.execution_id
        try:
            meta, state = await self._record_of(eid)
        except NotFound:
            # Taken between the start's admission and its record's creation (start.lua
            # follows queue.lua ``enter``, a round trip later), and still not there
            # after RECORD_WAIT_SECONDS: not claimed, and not dropped for good. The
            # delivery stays in ``taken``; past a lease ``reclaim`` queues it again
            # once its record says ``queued`` (or drops it, should it never appear).
            log.info("queued execution taken before it exists", extra={"executionId": eid})
            await self._parts.launcher.quietly(eid, self._admission.leave(taken.tenant, fence))
            return
        workflow: Workflow | None = None
        try:
            # Read while it is still queued: once claimed, its run must start.
            version, given, run, saved = await self._states.load(eid, state)
            try:
                workflow = await self._states.load_version(
                    version, tenant=meta.tenant, workflow_id=meta.workflow_id
                )
            except NotFound:
                # The store lost its workflow (a cluster node restarted empty) and the
                # tenant's stored one changed or went too: claimed all the same, to end
                # it (``_lost``) rather than leave it queued for good.
                log.warning("a queued execution's workflow is lost", extra={"executionId": eid})
            # As every claim does: what a store back behind forgot (the id to number above).
            ceiling = await self._recall(eid, meta) if self._recall is not None else 0
            await self._watch.hold(eid, fence)
            # No id is reserved for its first event (start.lua reserves id 1 so that a
            # start is shown live at once): it waited in line, and is shown once stored,
            # a round trip later. Reserved, a worker dead between this claim and its
            # first write left id 1 to a dropped gap, the log starting at
            # execution:recovered; reserving none, the next owner starts the log itself
            # (takeovers.py). Found by the queue storm (stress/queue_storm.py).
            claim = await self._ownership.claim(
                eid, Mode.TAKE, fence, expected="0", base_at_least=ceiling
            )
        except (WrongStatus, NotFound, DeliveryRevoked) as exc:
            # A stale delivery: cancelled, claimed by another, given back, or gone.
            log.info("queued execution not taken", extra={"executionId": eid, "why": str(exc)})
            await self._drop(taken, fence)
            return
        # Launched before anything else is awaited: a shutdown that cancels this task
        # now finds the run here to hand off (else it would wait for its lease to end,
        # charged as a crash), and a cancel sent here finds the run to stop.
        if workflow is None:
            first = not meta.continues and claim.base == 0
            self._parts.launcher.launch(
                eid,
                claim,
                identity=identity_of(meta),
                body=workflow_lost(given if first else NOT_STARTED, queued_ms(meta)),
                meta=meta,
            )
        else:
            self._start(meta, claim, workflow, given, run, saved, queued_ms(meta))
        # A failure of the store here (or before the claim answered) leaves the delivery
        # in ``taken``: past a lease ``reclaim`` revokes it and queues it again if still
        # queued; a claim slower than that is refused (it never runs beside the next
        # taker's, nor past its tenant's cap).
        await self._parts.launcher.quietly(eid, self._queue.claimed(taken))

    async def _record_of(self, execution_id: str) -> tuple[ExecutionMeta, dict[bytes, bytes]]:
        """The record of a taken execution and its run state as stored (one round trip,
        not two: issue 25); a start is taken as soon as it is queued, a round trip
        before its record is written, so a missing one is read again for a moment
        (NotFound after RECORD_WAIT_SECONDS): as soon as the next announcement of queued
        work comes (its process announces it once the record is written: a backoff of
        5 ms first cost every such start 3 to 5 ms beyond the write, issue 25), else
        after the backoff's wait. One take at a time waits here (``run``)."""
        backoff = Backoff(base=0.005, cap=0.1)
        deadline = time.monotonic() + RECORD_WAIT_SECONDS
        while True:
            # Cleared before reading: an announcement during the read means "read again".
            self._announced.clear()
            try:
                return await self._buffer.meta_and_state(execution_id)
            except NotFound:
                if time.monotonic() > deadline:
                    raise
                # A tick, not a timeout around the wait (see ``run``).
                tick = asyncio.get_running_loop().call_later(backoff.next(), self._announced.set)
                try:
                    await self._announced.wait()
                finally:
                    tick.cancel()

    async def _drop(self, taken: Taken, fence: str) -> None:
        eid = taken.execution_id
        if self._metrics is not None:
            self._metrics.stale_deliveries.inc()
        await self._parts.launcher.quietly(
            eid,
            self._watch.release(eid, fence),
            self._admission.leave(taken.tenant, fence),
            self._queue.claimed(taken),
        )

    async def reclaim(self) -> None:
        """Queue again what a dead taker took and never claimed (a janitor pass)."""
        for taken in await self._queue.stale():
            # Its taker is fenced out first, atomically with the status: a claim it
            # makes from now on is refused, so its admission can go back to the line.
            try:
                found = await self._ownership.revoke(taken.execution_id, taken.fence)
            except WrongStatus:
                await self._queue.claimed(taken)  # claimed after all (or cancelled)
                continue
            if not found:
                await self._no_record(taken)
                continue
            # Back at its place: the delivery carries its score (a resume's is before
            # every start's).
            if await self._queue.requeue(taken):
                if self._metrics is not None:
                    self._metrics.queue_reclaims.inc()
                log.warning(
                    "queued execution taken by a dead worker; queued again",
                    extra={"executionId": taken.execution_id},
                )
                self.nudge()

    async def _no_record(self, taken: Taken) -> None:
        """A delivery given back whose record is not there: a start whose record is
        still to be written (its two writes far apart: a stalled store or process) goes
        back to its place in line; one queued ORPHAN_LEASES leases ago whose record never
        came (its process died between them) is dropped."""
        queued = taken.queued_ms
        if queued < 0:
            queued += CONTINUATION_OFFSET_MS
        age_ms = await self._watch.now_ms() - queued
        if age_ms < ORPHAN_LEASES * self._queue.lease_ms:
            await self._queue.requeue(taken)
            return
        log.warning(
            "a queued execution whose record never came is dropped from its line",
            extra={"executionId": taken.execution_id},
        )
        await self._queue.claimed(taken)

    @translated
    async def reconcile(self) -> int:
        """Put back in line every queued execution no line holds: after the store came
        back from another server (a restart, a failover, a restore), the line and the
        record, in other hash slots, may disagree. On one server, the lines and the
        tenants' unfinished indexes come back from the same moment, so each index is
        read once; on a cluster the node of the lines may have lost an index as well
        (the records, on other nodes, say queued and nothing names them), so every
        execution record is looked at (a SCAN of each primary; only after a node
        changed). Returns how many it put back."""
        found = 0
        async for eid in self._unfinished():
            try:
                meta = await self._buffer.meta(eid)
            except NotFound:
                continue
            if meta.status != Status.QUEUED:
                continue
            if await self._queue.again(meta.tenant, eid, score=line_score(meta)):
                found += 1
        if found:
            log.warning("queued executions no line held were queued again", extra={"count": found})
            await self.announce()
            self.nudge()
        return found

    async def _unfinished(self) -> AsyncIterator[str]:
        """The executions a queued one may be among (see ``reconcile``)."""
        keys = self._buffer.keys
        redis = self._buffer.redis
        if isinstance(redis, RedisCluster):
            head, tail = f"{keys.prefix}:{{", "}:meta"
            async for raw in redis.scan_iter(match=f"{head}*{tail}", count=1000):
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                yield name[len(head) : -len(tail)]
            return
        head, tail = f"{keys.prefix}:{{t:", "}:executions:open"
        async for raw in redis.scan_iter(match=f"{head}*{tail}", count=1000):
            members: Any = await redis.zrange(raw, 0, -1)
            for member in members:
                yield member.decode()


def line_score(meta: ExecutionMeta) -> int:
    """A queued execution's score in its tenant's line, from its record: when it was
    created, less CONTINUATION_OFFSET_MS for a resume (before every start)."""
    score = created_ms(meta.created_at)
    return score - CONTINUATION_OFFSET_MS if meta.continues else score


def queued_ms(meta: ExecutionMeta) -> int:
    """How long a queued execution waited, from its creation to now (this host's
    clock; 0 when its record says no readable time)."""
    try:
        created = created_ms(meta.created_at)
    except ValueError:
        return 0
    return max(0, round(time.time() * 1000) - created)
