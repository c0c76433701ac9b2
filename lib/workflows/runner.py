"""Decides what runs in this process: start, resume, cancel, take over, shut down.

The runner wins each transition, then has the launcher (launcher.py) run what follows
here, one task per ownership.

Every change of ownership is a transition of ``Ownership`` (one Lua call each): any
replica may resume a pause or cancel an execution, and the janitor of any replica
reports the executions whose owner died or handed them off, and those whose approval
timed out, to be taken over or ended (takeovers.py; the loops are tending.py's). A
request either wins its transition (202) or gets 409 with the status that won; once it
won, the run it launched retries whatever Redis work follows, so a 202 always takes
effect.

A shutdown drains (tending.py): no new block starts, the running ones may finish
within the grace, then each run hands its execution off (no last event) for another
process to recover at once.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lib import tracing
from lib.backend import Batch
from lib.errors import (
    BufferUnavailable,
    Conflict,
    FlowcastError,
    InvalidInput,
    NotFound,
    NotPausedThere,
    OverQuota,
    PauseHeld,
    ShuttingDown,
)
from lib.execution.admission import paused_member
from lib.execution.buffer import EXECUTION_OVERHEAD_BYTES
from lib.execution.events import (
    utc_timestamp,
)
from lib.execution.log import ExecutionLog
from lib.execution.ownership import START_RESERVED, Claim, node_of
from lib.execution.queue import Entered
from lib.execution.record import ExecutionMeta, Field, Mode, Status, StopReason
from lib.metrics import Metrics
from lib.slices import encode
from lib.webhooks import spec as webhooks
from lib.webhooks.spec import Webhook
from lib.workflows.bodies import cancelled_in_line, new_run, resumed
from lib.workflows.dispatch import Dispatcher, queued_ms
from lib.workflows.executor import RunState
from lib.workflows.janitor import Janitor, cancelled
from lib.workflows.launcher import Body, ending_body, identity_of
from lib.workflows.leases import LeaseKeeper
from lib.workflows.listener import ControlListener
from lib.workflows.model import Workflow
from lib.workflows.parts import Parts
from lib.workflows.schemas import SchemaChecks
from lib.workflows.takeovers import Takeovers
from lib.workflows.tending import Tending

log = logging.getLogger(__name__)

# How long a start answered with a 202 waits for its first event to be stored.
FIRST_STORED_SECONDS = 1.0


def new_execution_id() -> str:
    """An unguessable execution id (144 random bits)."""
    return "ex_" + secrets.token_urlsafe(18)


@dataclass(frozen=True)
class Started:
    execution_id: str
    status: str
    ahead: int | None = None  # queued: about how many start before it


class Runner:
    """Starts, resumes and cancels executions; owns the tasks that run them here.

    It is given its parts, built once for the process (``build_runner`` in
    app/runtime.py): the ``Parts`` it shares with the takeovers (the transitions and
    what they keep in step, the run states, the endings, ``runs``, the executions
    running here, and their launcher), and the loops that act on ``runs`` (the lease
    keeper, the control listener, the janitor, the dispatcher: ``Tending``) with the
    takeovers they report to.
    """

    def __init__(
        self,
        parts: Parts,
        *,
        keeper: LeaseKeeper,
        listener: ControlListener,
        janitor: Janitor,
        takeovers: Takeovers,
        shutdown_grace_seconds: float = 30.0,
        worker_slots: int = 64,
        metrics: Metrics | None = None,
        schemas: SchemaChecks | None = None,
    ) -> None:
        transitions = parts.transitions
        self._schemas = schemas or SchemaChecks()
        self._parts = parts
        self._buffer = parts.buffer
        self._ownership = transitions.ownership
        self._watch = transitions.watch
        self._admission = transitions.admission
        self._control = transitions.control
        self._store = transitions.store
        self._states = parts.states
        self._finals = parts.finals
        self._runs = parts.runs
        self._launcher = parts.launcher
        self._takeovers = takeovers
        self.node_id = parts.node_id
        self._queue = transitions.queue
        # Takes queued work for this process's free slots; woken by the control
        # listener (work queued elsewhere) and by each run here that ends.
        self._metrics = metrics
        self.dispatcher = Dispatcher(
            parts,
            slots=worker_slots,
            start=self._start_taken,
            # A take asks how the run ended only when the store was seen behind: the
            # start path (takeovers.py recall).
            recall=functools.partial(takeovers.recalled, ends=False),
            metrics=metrics,
        )
        listener.on_queued = self.dispatcher.heard
        self._launcher.on_free = self.dispatcher.freed
        self._tending = Tending(
            parts,
            keeper=keeper,
            listener=listener,
            janitor=janitor,
            takeovers=takeovers,
            dispatcher=self.dispatcher,
            shutdown_grace_seconds=shutdown_grace_seconds,
        )

    async def __aenter__(self) -> Runner:
        try:
            # Marks the data as this server's before this process writes any (store.lua).
            await self._store.check()
        except FlowcastError as exc:
            log.warning("the buffer is not reachable at start", extra={"error": str(exc)})
        try:
            await self._queue.publish_weights()
        except FlowcastError as exc:
            log.warning("could not publish the tenant weights", extra={"error": str(exc)})
        self._tending.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Shutdown: start nothing new, let running blocks finish within the grace
        # period, then hand every execution still running off to another process.
        self._runs.accepting = False
        await self._tending.stop()

    def running_here(self) -> int:
        """Executions running in this process: the worker slots they fill."""
        return len(self._runs)

    def pending_events(self) -> int:
        """Events emitted by the runs here and not stored yet."""
        return sum(run.pending() for run in self._runs.values())

    def retained_bytes(self) -> int:
        """Bytes the rings of the runs here retain, as their compactors model them."""
        return sum(run.retained() for run in self._runs.values())

    # -- the API's operations ------------------------------------------------------

    async def start(
        self,
        workflow: Workflow,
        *,
        input: Any,
        tenant: str,
        inline_files: bool = False,
        webhook: Webhook | None = None,
        execution_id: str | None = None,
        write_back: Callable[[], Awaitable[None]] | None = None,
        first_stored: bool = False,
        confirm: Callable[[Batch], None] | None = None,
    ) -> Started:
        """Create an execution and start running it here; returns once it is replayable.

        ``first_stored``: return once its first event is stored too (a 202 answer).
        ``inline_files`` keeps file values' content inline up to their own cap, exempt
        from the pressure threshold (SPEC §5). ``webhook`` is this execution's own, added
        to the workflow's (SPEC §15). An ``execution_id`` named in advance (an
        Idempotency-Key's record names it before it exists) may be created by another
        request first: then that one runs it, and this one starts nothing.
        ``write_back`` writes that record back, should the store lose writes of the run
        here (a restore from an older snapshot): on a cluster the record is in another
        hash slot than the execution, so it is a write of its own, made before the
        execution is written back. ``confirm`` reads, in the start's own round trip,
        that ``workflow`` is still the stored one (``WorkflowStore.confirm_in``): when
        it is not, ``WorkflowChanged`` and nothing was started.
        """
        if not self._runs.accepting:
            raise ShuttingDown("the server is shutting down and starts no new executions")
        if workflow.input_schema is not None:
            # Before anything is written: a refused input creates and counts nothing.
            await self._check(
                tenant,
                workflow.input_schema,
                input,
                whose="the workflow's inputSchema",
            )
        execution_id = execution_id or new_execution_id()
        now = datetime.now(UTC)
        identity: dict[str, str] = {
            Field.WORKFLOW_ID.value: workflow.id,
            Field.TENANT.value: tenant,
            Field.CREATED_AT.value: utc_timestamp(now),
            Field.INLINE_FILES.value: "1" if inline_files else "",
        }
        hooks = webhooks.encoded([*(workflow.webhooks or []), *([webhook] if webhook else [])])
        if hooks:
            identity[Field.WEBHOOKS.value] = hooks
        trace = tracing.new_trace()
        if trace is not None:
            identity[Field.TRACE.value] = trace
        with self.dispatcher.slot() as here:
            created = await self._create(
                execution_id, workflow, input, identity, now, confirm, here=here
            )
            if created is not None and not isinstance(created, Entered):
                claim, saved = created
                events = self._run_new(
                    execution_id, claim, identity, workflow, input, saved, write_back=write_back
                )
        if created is None:
            log.info("execution created by another request", extra={"executionId": execution_id})
            return await self.found(execution_id)
        if isinstance(created, Entered):
            # Queued: a worker with a free slot takes it (this one first, if it has one);
            # the others were told with its creation (``announce_in``).
            self.dispatcher.nudge()
            return Started(execution_id, "queued", ahead=created.ahead)
        if first_stored:
            await events.first_stored(START_RESERVED, FIRST_STORED_SECONDS)
        return Started(execution_id, "running")

    async def found(self, execution_id: str) -> Started:
        """What an execution another request created answers a start with the same id
        (an Idempotency-Key's repeat): ``queued`` with its place while it waits in line
        (SPEC §14 "Accepting"), else ``running``. A repeat told ``running`` of a queued
        execution waited for a run not begun, and its answer is what later repeats
        replay."""
        try:
            meta = await self._buffer.meta(execution_id)
        except NotFound:
            return Started(execution_id, "running")  # created, then expired: it ran
        if meta.status == Status.QUEUED:
            ahead = await self._queue.ahead(meta.tenant, execution_id)
            if ahead is not None:
                return Started(execution_id, "queued", ahead=ahead)
        return Started(execution_id, "running")

    def _run_new(
        self,
        execution_id: str,
        claim: Claim,
        identity: dict[str, str],
        workflow: Workflow,
        input: Any,
        saved: dict[str, bytes],
        *,
        queued_ms: int = 0,
        write_back: Callable[[], Awaitable[None]] | None = None,
        meta: ExecutionMeta | None = None,
    ) -> ExecutionLog:
        """Run a new execution here from its first event, as ``claim``'s owner."""
        if self._metrics is not None:
            self._metrics.queue_wait.observe(queued_ms / 1000)

        opening, body = new_run(self._launcher, workflow, input, saved, queued_ms)
        return self._launcher.launch(
            execution_id,
            claim,
            identity=identity,
            body=body,
            opening=opening,
            write_back=write_back,
            meta=meta,
        )

    def _start_taken(
        self,
        meta: ExecutionMeta,
        claim: Claim,
        workflow: Workflow,
        input: Any,
        run: RunState,
        saved: dict[str, bytes],
        queued_ms: int,
    ) -> None:
        """Run an execution the dispatcher took from the queue and claimed here: a
        start from its first event, or a resume that waited in line from its answer."""
        if meta.continues:
            answer = run.answers.get(meta.continues)
            body = self._resumed(meta.continues, answer)
            self._launcher.launch(meta.id, claim, identity=identity_of(meta), body=body, meta=meta)
            return
        self._run_new(
            meta.id,
            claim,
            identity_of(meta),
            workflow,
            input,
            saved,
            queued_ms=queued_ms,
            meta=meta,
        )

    async def _create(
        self,
        execution_id: str,
        workflow: Workflow,
        input: Any,
        identity: dict[str, str],
        now: datetime,
        confirm: Callable[[Batch], None] | None = None,
        *,
        here: bool,
    ) -> tuple[Claim, dict[str, bytes]] | Entered | None:
        """Admit the tenant's execution and create it, owned here, with its run state
        (the claim and the state as stored), or queued (``Entered``); None when another
        request created it first (ownership.start then undoes the admission)."""
        # What a resume or a recovery needs is there from the start, in the same write
        # that creates the execution: a process may die right after the 202. The
        # workflow version is stored before, in the batch of the admission and the
        # lease entry (ownership.start).
        raw, version = workflow.canonical()
        saved = await self._states.encode(execution_id, {"workflow": version, "input": input})
        tenant = identity[Field.TENANT]
        # What the run state keeps counts for its tenant from the start, in the start's
        # round trip, before the admission: a tenant past its storage quota is refused
        # there (OverQuota) and nothing is created.
        size = sum(len(value) for value in saved.values()) + EXECUTION_OVERHEAD_BYTES

        def checked(batch: Batch) -> None:
            self._buffer.reserve_in(batch, tenant, execution_id, size, (version, len(raw)))
            if confirm is not None:
                confirm(batch)

        try:
            claim = await self._ownership.start(
                execution_id,
                fence=self._parts.new_fence(),
                workflow_id=workflow.id,
                tenant=tenant,
                created_at=identity[Field.CREATED_AT],
                created_ms=int(now.timestamp() * 1000),
                extra={
                    Field.INLINE_FILES.value: identity[Field.INLINE_FILES],
                    # Only when traced, or with webhooks: else the record is as it was.
                    **{k: v for k, v in identity.items() if k in (Field.TRACE, Field.WEBHOOKS)},
                    Field.QUOTA_BASE.value: str(size),
                    Field.QUOTA_RECORDED.value: str(size),
                },
                state=saved,
                checked=checked,
                alongside=lambda batch: self._states.save_version_in(batch, workflow),
                here=here,
                announce=self.dispatcher.announce_in,
            )
        except OverQuota:
            raise  # refused before anything was counted
        except BaseException:
            # Refused after it was counted (another check, the admission), or not known
            # to be: the figure goes (a named id another request created is counted
            # again by its run's first figure).
            await self._uncount(tenant, execution_id)
            raise
        if claim is None or isinstance(claim, Entered):
            return claim
        return claim, saved

    async def _uncount(self, tenant: str, execution_id: str) -> None:
        """Take back the figure a refused start counted (best effort: left, it stops
        counting after the retention)."""
        try:
            await self._buffer.unreserve(tenant, execution_id)
        except BufferUnavailable as exc:
            log.warning(
                "could not take back a refused start's storage figure",
                extra={"executionId": execution_id, "error": str(exc)},
            )

    async def resume(
        self, execution_id: str, *, tenant: str, block_id: str | None, input: Any
    ) -> Started:
        """Answer a pause: validate ``input``, win the claim, run on here."""
        if not self._runs.accepting:
            raise ShuttingDown("the server is shutting down and resumes nothing")
        meta = await self._owned(execution_id, tenant)
        if meta.status != Status.PAUSED or not isinstance(meta.pause, dict):
            raise Conflict(
                "not_paused", f"the execution is {meta.status}, not paused", status=meta.status
            )
        paused_at = str(meta.pause.get("blockId", ""))
        if block_id is not None and block_id != paused_at:
            raise NotPausedThere(execution_id, paused_at=paused_at, asked=block_id)
        await self._check(tenant, meta.pause.get("schema") or {}, input, whose="the pause's schema")
        fence = self._parts.new_fence()
        # The same admission as a start's: run here only with a free slot and while
        # the tenant runs fewer than its cap; else in line, before its starts.
        # The slot is held until the launch fills it (``Dispatcher.slot``).
        with self.dispatcher.slot() as here:
            now = here and await self._queue.room(tenant, fence)
            # A resume that may not run now is accepted all the same: its answer is
            # stored with the claim (paused -> queued), then it waits in line before its
            # tenant's starts. ``fence``'s lease entry, written before the claim, covers
            # the step between: should this process die there, a janitor finds the
            # execution queued and puts it in line.
            claim = await self._claim(
                execution_id,
                Mode.RESUME,
                fence,
                tenant,
                meta=meta,
                block_id=paused_at,
                answer=await encode(input),  # in slices: an answer may be 10 MB
                later=not now,
            )
            if not now:
                return await self._in_line(execution_id, tenant, fence)
            body = self._resumed(paused_at, input)
            self._launcher.launch(
                execution_id, claim, identity=identity_of(meta), body=body, meta=meta
            )
        return Started(execution_id, "running")

    async def _in_line(self, execution_id: str, tenant: str, fence: str) -> Started:
        """A resume accepted to run later takes its place in line (instead of its pause's
        entry), and the workers hear of it."""
        ahead = await self._queue.line(tenant, execution_id, replaces=paused_member(execution_id))
        await self._launcher.quietly(execution_id, self._watch.release(execution_id, fence))
        await self.dispatcher.announce()
        self.dispatcher.nudge()
        return Started(execution_id, "queued", ahead=ahead)

    def _resumed(self, paused_at: str, input: Any) -> Body:
        return resumed(self._launcher, self._states, paused_at, input)

    async def cancel(self, execution_id: str, *, tenant: str) -> Started:
        """Cancel a running or paused execution wherever it runs.

        The claim decides, in Redis, against everything racing with it: a paused
        execution becomes this process's to end; a running one gets its cancel flag, so
        its owner's next final event becomes the cancel (append.lua), and the owner is
        told at once. A finished one is a 409 with the status that won.
        """
        meta = await self._owned(execution_id, tenant)
        given: Any = None
        if meta.status == Status.QUEUED and not meta.continues:
            # Its first event, written with the cancel, shows the input it was given.
            _version, given, _run, _saved = await self._states.load(execution_id)
        fence = self._parts.new_fence()
        claim = await self._claim(execution_id, Mode.CANCEL, fence, tenant, meta=meta)
        if claim.status_before is Status.QUEUED:
            await self._launcher.quietly(execution_id, self._queue.dequeue(tenant, execution_id))
            # A resume in line has its log already: it only ends. Told by the claim (its
            # stored events), not by ``meta``: read before the claim, it may have said
            # paused for a resume that went in line meanwhile.
            ending = (
                ending_body(cancelled)
                if meta.continues or claim.last_id > 0
                else cancelled_in_line(given, queued_ms(meta))
            )
            self._launcher.launch(
                execution_id, claim, identity=identity_of(meta), body=ending, meta=meta
            )
            return Started(execution_id, "cancelling")
        if claim.status_before is not Status.RUNNING:
            self._launcher.launch(
                execution_id,
                claim,
                identity=identity_of(meta),
                body=ending_body(cancelled),
                meta=meta,
            )
            return Started(execution_id, "cancelling")
        await self._launcher.quietly(execution_id, self._watch.release(execution_id, fence))
        local = self._runs.get(execution_id)
        if local is not None and local.fence == claim.owner:
            local.stop(StopReason.CANCEL)
        else:
            # The flag reaches the owner with its next write or renewal anyway.
            await self._launcher.quietly(
                execution_id, self._control.send_cancel(node_of(claim.owner), execution_id)
            )
        return Started(execution_id, "cancelling")

    async def _owned(self, execution_id: str, tenant: str) -> ExecutionMeta:
        meta = await self._buffer.meta(execution_id)
        if meta.tenant != tenant:
            raise NotFound("execution", execution_id)
        return await self._buffer.resolved(meta)

    async def _claim(
        self,
        execution_id: str,
        mode: Mode,
        fence: str,
        tenant: str,
        *,
        meta: ExecutionMeta,
        block_id: str = "",
        answer: bytes = b"",
        later: bool = False,
    ) -> Claim:
        """Watch ``fence``'s lease, then win the transition with it (``later``: a
        resume that waits in line; its pause's entry is replaced by its place).

        A refused claim undoes the watch. One whose answer was lost (the buffer failed
        mid-call) keeps it: if the claim did apply, the lease it set expires unrenewed
        and a janitor ends the execution, so it is never running with nobody watching.
        A store that came back behind is told first what it forgot (``recall``): a run
        whose end it lost has that end stored again, and the claim is refused with it.
        """
        try:
            # A store that came back without writes it had acknowledged (an older
            # snapshot, or empty) less than a lease ago holds every pause that long
            # (claim.lua HELD): it may be one it brought back after a resume it lost,
            # whose owner, stalled, takes the run back within a lease (the fresh-eyes
            # review of 73d4c9d, two 202s for one pause).
            store = await self._store.wait_settled()
            ceiling = await self._takeovers.recalled(execution_id, meta)
            await self._watch.hold(execution_id, fence)
            claim = await self._ownership.claim(
                execution_id,
                mode,
                fence,
                block_id=block_id,
                answer=answer,
                base_at_least=ceiling,
                later=later,
                behind_ms=int(store.behind_seconds * 1000),
            )
        except (Conflict, NotFound, PauseHeld):  # refused: the claim did not apply
            await self._launcher.quietly(
                execution_id,
                self._watch.release(execution_id, fence),
                self._admission.leave(tenant, fence),
            )
            raise
        except FlowcastError:
            await self._launcher.quietly(execution_id, self._admission.leave(tenant, fence))
            raise
        if claim.status_before is Status.PAUSED and not later:
            # The pause stops counting as such: its new owner counts (or it ends).
            await self._launcher.quietly(
                execution_id, self._admission.leave(tenant, paused_member(execution_id))
            )
        return claim

    async def _check(self, tenant: str, schema: dict[str, Any], input: Any, *, whose: str) -> None:
        """Refuse (422) an ``input`` that ``schema`` does not accept; checked off the
        event loop, within the template CPU bound (SPEC §8)."""
        problems = await self._schemas.problems(tenant, schema, input, whose=whose)
        if problems:
            raise InvalidInput(f"the input does not match {whose}", problems)
