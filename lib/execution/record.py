"""The execution record: what Redis holds of one execution, defined once.

An execution's record is its metadata hash ``<prefix>:{<eid>}:meta``. Its field names
are ``Field``; its ``status`` is a ``Status``; the transitions that change its owner are
claim.lua's ``Mode``s (the table of who may ask what is drawn in ownership.py); a
takeover says why in ``recoveryReason`` (``RecoveryReason``); and a run of this process
stops its work for a ``StopReason``.

Every refusal a script replies with (an error reply whose first word is the ``Reply``)
becomes one typed exception, in one place: ``REFUSALS`` maps each (script, reply) to
its leaf of ``lib.errors``, and ``refused`` translates a script's ``ResponseError``
through it. A reply the map does not know is the store's own trouble (OOM at
maxmemory, READONLY, MISCONF): ``BufferUnavailable``, an outage, never a state.
tests/execution/test_record.py reads every ``.lua`` under ``lib/`` and fails if any
of its refusals is not in the map.

    script      reply             exception          meaning
    ----------  ----------------  -----------------  ------------------------------------
    append.lua  NOEXEC            WriteGone          no metadata (the store lost it)
    append.lua  FENCED <owner>    WriteFenced        another owner, same or later epoch
    append.lua  ORDER <lastId>    WriteOutOfOrder    the batch does not follow lastId
    append.lua  CANCEL            CancelWins         a cancel wins over the final event
    claim.lua   NOEXEC            NotFound           no such execution (or it expired)
    claim.lua   STATUS <status>   WrongStatus        not in a status this applies to
    claim.lua   BLOCK <blockId>   NotPausedThere     paused at another block
    claim.lua   LEASE             LeaseHeld          the lease runs (or no hand-off)
    claim.lua   MOVED             OwnerMoved         another owner than the one named
    claim.lua   NOTDUE            NotDue             the approval deadline has not passed
    claim.lua   MODE <mode>       UnknownTransition  no such transition (a bug)
    claim.lua   SUSPECT           SuspectHeld        the caller runs a suspect already
    claim.lua   REVOKED           DeliveryRevoked    the delivery was given back
    claim.lua   HELD <ms>         PauseHeld          a pause is held: the store is behind
    queue.lua   MODE <op>         UnknownTransition  no such operation (a bug)
    renew.lua   GONE              RecordLost         no metadata: the writer recreates it
    renew.lua   FENCED            Fenced             another owner, same or later epoch
    renew.lua   BEHIND            RecordLost         lost writes: the writer writes back
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import orjson
from redis.exceptions import ResponseError

from lib.errors import (
    BufferUnavailable,
    CancelWins,
    DeliveryRevoked,
    Fenced,
    FlowcastError,
    LeaseHeld,
    NotDue,
    NotFound,
    NotPausedThere,
    OwnerMoved,
    PauseHeld,
    RecordLost,
    SuspectHeld,
    UnknownTransition,
    WriteFenced,
    WriteGone,
    WriteOutOfOrder,
    WrongStatus,
)
from lib.execution.events import Event


class Field(StrEnum):
    """The fields of an execution's metadata hash (start.lua creates it)."""

    # Identity, written when it is created (and again when the store lost it).
    WORKFLOW_ID = "workflowId"
    TENANT = "tenant"
    CREATED_AT = "createdAt"
    UPDATED_AT = "updatedAt"
    INLINE_FILES = "inlineFiles"  # "1": file values kept inline up to their own cap
    WEBHOOKS = "webhooks"  # JSON: the webhooks its events go to (lib/webhooks); absent: none
    # Its trace when tracing was on at accept (lib/otel.py): every process that runs
    # it adds its spans to that one; "" or absent: not traced.
    TRACE = "trace"
    # Ownership (claim.lua, renew.lua; append.lua lets a newer epoch take it back).
    STATUS = "status"
    OWNER = "owner"  # the owner's fencing token; "" once handed off
    EPOCH = "epoch"  # one more at every claim that changes the owner
    LEASE_UNTIL = "leaseUntil"  # ms, Redis's clock
    HANDOFF = "handoff"  # the fence that let go at a shutdown, until taken over
    CANCEL_REQUESTED = "cancelRequested"  # "1": the next final event is the cancel
    PAUSE_BLOCK = "pauseBlock"  # the block a pause waits at
    PAUSE_DEADLINE = "pauseDeadline"  # ms, Redis's clock; "" for none
    RECOVERIES = "recoveries"  # execution:recovered events stored
    RECOVERY_REASON = "recoveryReason"  # why the latest takeover happened
    CRASHES = "crashes"  # deaths of an owner charged to it (blame.py)
    DEATHS = "deaths"  # every death of an owner while it ran: a suspect once above 0
    QUARANTINED = "quarantined"  # "1": charged as its process's suspect; it ends failed
    # A resume waiting in line (claim.lua "resume" to queued): the block it answered,
    # until a worker takes it and runs it on from there.
    CONTINUES = "continues"
    # "<lastId> <ms, Redis's clock>": a pause stored again from a process's memory after
    # the store came back empty (finals.py) takes no resume or cancel until then, while
    # its last id is still that pause's: the store may have lost a resume of it whose
    # owner, stalled, takes the run back within a lease (claim.lua HELD).
    HELD = "held"
    # The replay buffer (append.lua).
    LAST_ID = "lastId"
    # When (ms, Redis's clock) it was created or an owner last appended to it: one not
    # written since the store was last found behind is as that store brought it back
    # (store.lua restoredAt, takeovers.py ``recall``).
    WRITTEN_AT = "writtenAt"
    FIRST_ID = "firstId"  # the oldest id retained
    BYTES = "bytes"  # the retained events' envelope bytes
    COUNT = "count"  # the retained events
    RESERVED = "reserved"  # ids an owner may show live above lastId
    CHECKPOINT_BYTES = "ckptBytes"  # outputs and answers the checkpoint holds inline
    # Its tenant's storage ledger (lib/quota.py): the run state's bytes as created, and
    # the footprint the ledger was last handed (append.lua).
    QUOTA_BASE = "quotaBase"
    QUOTA_RECORDED = "quotaRecorded"
    COPIED_BYTES = "copiedBytes"  # the output, error and pause this hash copies
    # Outcomes, as JSON (or {"$event": id} naming the event that holds a large one).
    OUTPUT = "output"
    ERROR = "error"
    PAUSE = "pause"
    # "rejected" once a person answered an approval with ``approved: false`` (flush.py):
    # the lists say so beside a run that then completed.
    DECISION = "decision"


class Status(StrEnum):
    """An execution's status (SPEC §3); ``queued`` until a worker takes it (SPEC §14)."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: Final = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})


class Mode(StrEnum):
    """The transitions claim.lua makes (its ARGV[1])."""

    RESUME = "resume"
    CANCEL = "cancel"
    TAKEOVER = "takeover"
    HANDOFF = "handoff"
    EXPIRE = "expire"
    TAKE = "take"  # queued -> running, by a worker that took it from the queue
    REVOKE = "revoke"  # queued: a taker that never claimed is fenced out (a janitor)


class Takeover(StrEnum):
    """Which owner a takeover may replace (claim.lua's ARGV[5])."""

    EXPIRED = ""  # one whose lease ended, or that handed off
    HANDOFF = "handoff"  # only one that handed off (the store's leases are not trusted yet)
    DEAD = "dead"  # one known dead, its lease still running: an earlier process of this
    # node (the caller proved it: it holds what that process held until it died)


class RecoveryReason(StrEnum):
    """Why a takeover happened (``recoveryReason``, and execution:recovered's reason)."""

    HANDOFF = "handoff"  # the owner let go at a shutdown
    WORKER_LOST = "worker_lost"  # the owner stopped renewing its lease
    # Its owners died while running it, the last time with it its process's one suspect
    # beside other runs (blame.py): the new owner ends it failed, running nothing again.
    QUARANTINED = "quarantined"


class StopReason(StrEnum):
    """Why a run here had its work cancelled."""

    CANCEL = "cancel"  # a cancel was accepted: the run ends cancelled
    HANDOFF = "handoff"  # a shutdown: another process goes on with it
    FENCED = "fenced"  # another owner replaced this one: it may write nothing more


class Script(StrEnum):
    """The Lua scripts that read or write an execution's record."""

    START = "start.lua"
    APPEND = "append.lua"
    READ = "read.lua"
    CLAIM = "claim.lua"
    RENEW = "renew.lua"
    ADMIT = "admit.lua"
    WATCH = "watch.lua"
    STORE = "store.lua"
    SLOTS = "slots.lua"
    QUOTA = "quota.lua"  # a tenant's storage ledger (lib/quota.py), no execution key
    QUEUE = "queue.lua"  # the admission and the fair queue (queue.py), no execution key
    OUTBOX = "outbox.lua"  # the webhook deliveries owed (lib/webhooks), no execution key


class Reply(StrEnum):
    """The first word of a script's error reply (the rest, if any, is its detail)."""

    NOEXEC = "NOEXEC"
    FENCED = "FENCED"
    ORDER = "ORDER"
    CANCEL = "CANCEL"
    STATUS = "STATUS"
    BLOCK = "BLOCK"
    LEASE = "LEASE"
    MOVED = "MOVED"
    NOTDUE = "NOTDUE"
    MODE = "MODE"
    GONE = "GONE"
    BEHIND = "BEHIND"
    SUSPECT = "SUSPECT"
    REVOKED = "REVOKED"
    HELD = "HELD"


@dataclass(frozen=True)
class Asked:
    """What the caller asked, for the exception to say: the execution, and for a
    resume the block it answers."""

    execution_id: str
    block_id: str = ""


# Builds the exception of one refusal from what was asked and the reply's detail.
Build = Callable[[Asked, str], FlowcastError]


@dataclass(frozen=True)
class Refusal:
    """One error reply of one script, what it means and what it becomes."""

    script: Script
    reply: Reply
    error: type[FlowcastError]
    meaning: str
    build: Build
    detail: str = ""  # what follows the reply's first word, if anything


def _not_found(asked: Asked, _detail: str) -> FlowcastError:
    return NotFound("execution", asked.execution_id)


REFUSALS: Final[tuple[Refusal, ...]] = (
    Refusal(
        Script.APPEND, Reply.NOEXEC, WriteGone, "no metadata (the store lost it)",
        lambda asked, _detail: WriteGone(asked.execution_id),
    ),
    Refusal(
        Script.APPEND, Reply.FENCED, WriteFenced, "another owner, same or later epoch",
        lambda asked, detail: WriteFenced(asked.execution_id, owner=detail),
        detail="<owner>",
    ),
    Refusal(
        Script.APPEND, Reply.ORDER, WriteOutOfOrder, "the batch does not follow lastId",
        lambda asked, detail: WriteOutOfOrder(asked.execution_id, last_id=int(detail)),
        detail="<lastId>",
    ),
    Refusal(
        Script.APPEND, Reply.CANCEL, CancelWins, "a cancel wins over the final event",
        lambda asked, _detail: CancelWins(asked.execution_id),
    ),
    Refusal(
        Script.CLAIM, Reply.NOEXEC, NotFound, "no such execution (or it expired)",
        _not_found,
    ),
    Refusal(
        Script.CLAIM, Reply.STATUS, WrongStatus, "not in a status this applies to",
        lambda asked, detail: WrongStatus(asked.execution_id, detail),
        detail="<status>",
    ),
    Refusal(
        Script.CLAIM, Reply.BLOCK, NotPausedThere, "paused at another block",
        lambda asked, detail: NotPausedThere(
            asked.execution_id, paused_at=detail, asked=asked.block_id
        ),
        detail="<blockId>",
    ),
    Refusal(
        Script.CLAIM, Reply.LEASE, LeaseHeld, "the lease runs (or no hand-off)",
        lambda asked, _detail: LeaseHeld(asked.execution_id),
    ),
    # A reply of one word reaches the client as "ERR MOVED" (the server adds the code),
    # so redis-py never reads it as a cluster redirect; "MOVED <detail>" would be one.
    Refusal(
        Script.CLAIM, Reply.MOVED, OwnerMoved, "another owner than the one named",
        lambda asked, _detail: OwnerMoved(asked.execution_id),
    ),
    Refusal(
        Script.CLAIM, Reply.NOTDUE, NotDue, "the approval deadline has not passed",
        lambda asked, _detail: NotDue(asked.execution_id),
    ),
    Refusal(
        Script.CLAIM, Reply.MODE, UnknownTransition, "no such transition (a bug)",
        lambda asked, detail: UnknownTransition(asked.execution_id, detail),
        detail="<mode>",
    ),
    Refusal(
        Script.CLAIM, Reply.SUSPECT, SuspectHeld, "the caller runs a suspect already",
        lambda asked, _detail: SuspectHeld(asked.execution_id),
    ),
    Refusal(
        Script.CLAIM, Reply.REVOKED, DeliveryRevoked, "the delivery was given back",
        lambda asked, _detail: DeliveryRevoked(asked.execution_id),
    ),
    Refusal(
        Script.CLAIM, Reply.HELD, PauseHeld, "a pause is held: the store is behind",
        lambda asked, detail: PauseHeld(asked.execution_id, held_ms=int(detail)),
        detail="<ms>",
    ),
    Refusal(
        Script.QUEUE, Reply.MODE, UnknownTransition, "no such operation (a bug)",
        lambda asked, detail: UnknownTransition(asked.execution_id, detail),
        detail="<op>",
    ),
    Refusal(
        Script.RENEW, Reply.GONE, RecordLost, "no metadata: the writer recreates it",
        lambda asked, _detail: RecordLost(asked.execution_id, whole=True),
    ),
    Refusal(
        Script.RENEW, Reply.FENCED, Fenced, "another owner, same or later epoch",
        lambda asked, _detail: Fenced(asked.execution_id),
    ),
    Refusal(
        Script.RENEW, Reply.BEHIND, RecordLost, "lost writes: the writer writes back",
        lambda asked, _detail: RecordLost(asked.execution_id, whole=False),
    ),
)  # fmt: skip

_BY_REPLY: Final[dict[tuple[Script, str], Refusal]] = {
    (refusal.script, refusal.reply.value): refusal for refusal in REFUSALS
}


def refusal_of(script: Script, exc: ResponseError) -> tuple[Refusal, str] | None:
    """The refusal a script's error reply is, with its detail; None for an error of
    the store's own (OOM, READONLY, …)."""
    reply, _, detail = str(exc).partition(" ")
    found = _BY_REPLY.get((script, reply))
    return None if found is None else (found, detail)


def refused(script: Script, exc: ResponseError, asked: Asked) -> FlowcastError:
    """The typed exception for a script's error reply (see ``REFUSALS``)."""
    found = refusal_of(script, exc)
    if found is None:
        return BufferUnavailable(f"the buffer refused {script}: {exc}")
    refusal, detail = found
    return refusal.build(asked, detail)


def draw_refusals() -> str:
    """``REFUSALS`` as the table this module's docstring shows."""
    return "".join(
        f"    {r.script:<10}  {f'{r.reply} {r.detail}'.strip():<16}  "
        f"{r.error.__name__:<17}  {r.meaning}\n"
        for r in REFUSALS
    )


# -- the record as read, and what a batch or a read gives back ------------------------


@dataclass(frozen=True)
class ExecutionMeta:
    """What the buffer knows about one execution, as stored in its metadata hash."""

    id: str
    workflow_id: str
    status: str
    created_at: str
    updated_at: str
    last_id: int
    first_id: int
    retained_bytes: int
    retained_count: int
    tenant: str
    owner: str
    epoch: int = 0
    checkpoint_bytes: int = 0  # outputs and answers its checkpoint holds inline
    recoveries: int = 0  # execution:recovered events stored
    crashes: int = 0  # deaths of an owner charged to it (blame.py)
    deaths: int = 0  # every death of an owner while it ran: a suspect once above 0
    reserved: int = 0
    inline_files: bool = False
    webhooks: str = ""  # JSON: the webhooks its events go to (lib/webhooks/spec.py)
    cancel_requested: bool = False
    continues: str = ""  # queued: the block a resume answered (a continuation)
    output: Any = None
    error: Any = None
    pause: Any = None
    decision: str = ""  # "rejected": an approval was answered with approved false
    trace: str = ""  # its trace (lib/otel.py); "": not traced
    written_ms: int = 0  # created or last appended to (Field.WRITTEN_AT)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_hash(cls, execution_id: str, fields: Mapping[bytes, bytes]) -> ExecutionMeta:
        def text(name: Field, default: str = "") -> str:
            value = fields.get(name.encode())
            return value.decode() if value is not None else default

        def number(name: Field) -> int:
            return int(text(name, "0") or 0)

        def loaded(name: Field) -> Any:
            value = fields.get(name.encode())
            return orjson.loads(value) if value else None

        return cls(
            id=execution_id,
            workflow_id=text(Field.WORKFLOW_ID),
            status=text(Field.STATUS),
            created_at=text(Field.CREATED_AT),
            updated_at=text(Field.UPDATED_AT),
            last_id=number(Field.LAST_ID),
            first_id=number(Field.FIRST_ID),
            retained_bytes=number(Field.BYTES),
            retained_count=number(Field.COUNT),
            tenant=text(Field.TENANT),
            owner=text(Field.OWNER),
            epoch=number(Field.EPOCH),
            checkpoint_bytes=number(Field.CHECKPOINT_BYTES),
            recoveries=number(Field.RECOVERIES),
            crashes=number(Field.CRASHES),
            deaths=number(Field.DEATHS),
            reserved=number(Field.RESERVED),
            inline_files=text(Field.INLINE_FILES) == "1",
            webhooks=text(Field.WEBHOOKS),
            cancel_requested=text(Field.CANCEL_REQUESTED) == "1",
            continues=text(Field.CONTINUES),
            output=loaded(Field.OUTPUT),
            error=loaded(Field.ERROR),
            pause=loaded(Field.PAUSE),
            decision=text(Field.DECISION),
            trace=text(Field.TRACE),
            written_ms=number(Field.WRITTEN_AT),
        )


@dataclass(frozen=True)
class AppendResult:
    last_id: int
    first_id: int
    retained_bytes: int
    retained_count: int
    reserved: int = 0
    cancel_requested: bool = False


@dataclass(frozen=True)
class Page:
    """Events after a cursor, with the metadata and dropped ranges read atomically."""

    events: list[Event]
    meta: ExecutionMeta
    dropped: list[tuple[int, int]]

    def gap_reason(self, after: int, before: int) -> str:
        """Why ids between ``after`` and ``before`` (both excluded) are not retained.

        The ring evicts only below the first retained id; any other hole was dropped,
        whether its range is recorded yet or still only known to the writer.
        """
        for low, high in self.dropped:
            if low < before and high > after:
                return "dropped"
        if self.meta.first_id and after + 1 < self.meta.first_id:
            return "evicted"
        return "dropped"
