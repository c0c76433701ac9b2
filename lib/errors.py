"""Flowcast's exceptions.

    FlowcastError                      root of everything Flowcast raises on purpose
    ├── NotFound                       an unknown workflow, execution or value
    │   └── RecordLost                 the store lost an owner's execution, whole or in part
    ├── Conflict                       the target is not in a state that allows this
    │   ├── WrongStatus                a transition asked of an execution in another status
    │   ├── NotPausedThere             a resume names another block than the paused one
    │   ├── LeaseHeld                  a takeover while the owner's lease still runs
    │   ├── OwnerMoved                 the execution has another owner than the one named
    │   ├── NotDue                     an expiry before the approval deadline passed
    │   ├── SuspectHeld                a takeover of a suspect by a process that runs one
    │   ├── Fenced                     a renewal by an owner another one replaced
    │   └── UnknownTransition          a transition the script does not know (a bug)
    ├── InvalidInput                   a request the caller can fix (carries problems)
    │   └── WorkflowInvalid            a workflow definition with every problem found
    ├── BlockError                     a block attempt failed (code, message, retryable)
    ├── ShuttingDown                   the process no longer starts executions
    ├── WorkflowChanged                a start's workflow changed since this process read it
    ├── TooBusy                        the tenant runs as many executions as it may
    │   ├── TooManyStreams             the tenant has as many streams open as it may
    │   └── OverQuota                  the tenant keeps as many bytes in Redis as it may
    ├── BufferUnavailable              the event buffer could not be reached
    └── WriteRefused                   the buffer refused a batch on purpose
        ├── WriteFenced                another owner holds the execution
        ├── WriteOutOfOrder            the batch does not follow the stored last id
        ├── WriteGone                  the execution's metadata no longer exists
        └── CancelWins                 a cancel accepted earlier wins over the final event

Every refusal a Lua script replies with becomes one of these leaves in exactly one
place, ``lib/execution/record.py``'s ``REFUSALS``.

HTTP status codes are chosen only in ``app``'s exception handlers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FlowcastError(Exception):
    """Root of every error Flowcast raises on purpose."""

    code = "flowcast_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(FlowcastError):
    """An unknown workflow, execution or value."""

    code = "not_found"

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} was not found")
        self.kind = kind
        self.ident = ident
        self.code = f"{kind}_not_found"


class RecordLost(NotFound):
    """The store lost a running execution (``whole``) or some of its writes: its owner's
    writer writes it back."""

    def __init__(self, execution_id: str, *, whole: bool) -> None:
        super().__init__("execution", execution_id)
        self.execution_id = execution_id
        self.whole = whole


class Conflict(FlowcastError):
    """The target exists but is not in a state that allows the request."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class WrongStatus(Conflict):
    """The execution is in ``status``, which the transition asked does not apply to."""

    def __init__(self, execution_id: str, status: str) -> None:
        super().__init__(f"execution_{status}", f"the execution is {status}", status=status)
        self.execution_id = execution_id
        self.status = status


class NotPausedThere(Conflict):
    """A resume names ``asked``, but the execution is paused at ``paused_at``."""

    def __init__(self, execution_id: str, *, paused_at: str, asked: str) -> None:
        super().__init__(
            "not_paused_there",
            f"the execution is paused at {paused_at!r}, not at {asked!r}",
            status="paused",
            pausedAt=paused_at,
        )
        self.execution_id = execution_id
        self.paused_at = paused_at
        self.asked = asked


class LeaseHeld(Conflict):
    """A takeover while the owner's lease still runs (or, for a hand-off only, while
    the owner has not let go)."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("lease", f"the owner of {execution_id} still holds its lease")
        self.execution_id = execution_id


class OwnerMoved(Conflict):
    """The execution has another owner than the one the caller named."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("moved", f"{execution_id} has another owner than the one expected")
        self.execution_id = execution_id


class SuspectHeld(Conflict):
    """A takeover of a run whose owners died, by a process that runs a suspect already
    (blame.py): left for a process without one."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("suspect", f"{execution_id} waits for a process with no suspect")
        self.execution_id = execution_id


class DeliveryRevoked(Conflict):
    """A worker's claim of a queued execution it took, after a janitor found the
    delivery unclaimed for a lease and gave it back to the line (claim.lua "revoke")."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("revoked", f"the delivery of {execution_id} was given back to the line")
        self.execution_id = execution_id


class NotDue(Conflict):
    """An expiry asked before the pause's approval deadline passed."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("notdue", f"the approval deadline of {execution_id} has not passed")
        self.execution_id = execution_id


class Fenced(Conflict):
    """An owner's renewal after another owner replaced it: it must stop."""

    def __init__(self, execution_id: str) -> None:
        super().__init__("fenced", f"this process no longer owns {execution_id}")
        self.execution_id = execution_id


class UnknownTransition(Conflict):
    """A transition the script does not know: a bug in the caller, not a state."""

    def __init__(self, execution_id: str, mode: str) -> None:
        super().__init__("mode", f"no transition {mode!r} for {execution_id}")
        self.execution_id = execution_id
        self.mode = mode


@dataclass(frozen=True)
class Problem:
    """One problem found in the caller's input: where (a JSON path) and what."""

    path: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


def error_path(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as a JSON path suffix (``.a[2].b``)."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


class InvalidInput(FlowcastError):
    """Input the caller can fix; ``problems`` lists every problem found."""

    code = "invalid_input"

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


class WorkflowInvalid(InvalidInput):
    """A workflow definition that cannot be accepted, with every problem found."""

    code = "invalid_workflow"

    def __init__(self, problems: list[Problem]) -> None:
        count = len(problems)
        super().__init__(f"the workflow has {count} problem{'s' if count != 1 else ''}", problems)


class BlockError(FlowcastError):
    """A block attempt failed.

    ``retryable`` tells the executor whether another attempt may help; ``retry_after``
    (seconds) is a lower bound on the wait before it, e.g. from an HTTP ``Retry-After``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.retry_after = retry_after


class ShuttingDown(FlowcastError):
    """The process is shutting down and starts nothing new."""

    code = "shutting_down"


class WorkflowChanged(FlowcastError):
    """The workflow a start went on with, as this process last read it, was replaced or
    deleted since: the start is taken back (it changed nothing) and the workflow is read
    again. Never an answer of its own: the caller starts once more."""

    code = "workflow_changed"

    def __init__(self, workflow_id: str) -> None:
        super().__init__(f"workflow {workflow_id!r} changed since it was read")
        self.workflow_id = workflow_id


class TooBusy(FlowcastError):
    """The tenant already runs its most executions; ``retry_after`` is a hint in seconds."""

    code = "too_many_executions"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyStreams(TooBusy):
    """The tenant already has its most SSE connections open (on this replica)."""

    code = "too_many_streams"


class OverQuota(TooBusy):
    """What the tenant keeps in Redis (workflows, secrets, retained executions) leaves
    no room for this (FLOWCAST_TENANT_STORAGE_BYTES); figures in bytes."""

    code = "storage_quota"

    def __init__(self, tenant: str, *, used: int, limit: int, needed: int, retry_after: int):
        super().__init__(
            f"storage quota reached: the tenant keeps {used} bytes of its {limit} "
            f"(FLOWCAST_TENANT_STORAGE_BYTES) and this needs {max(needed, 0)} more; "
            "delete workflows or secrets, or wait for finished executions to expire",
            retry_after=retry_after,
        )
        self.tenant = tenant
        self.used = used
        self.limit = limit
        self.needed = needed

    @property
    def details(self) -> dict[str, int]:
        return {"usedBytes": self.used, "limitBytes": self.limit, "neededBytes": self.needed}


class BufferUnavailable(FlowcastError):
    """The event buffer could not be reached (or answered with an error)."""

    code = "buffer_unavailable"


class PauseHeld(BufferUnavailable):
    """A resume or cancel of a pause while the store is behind (it came back without
    writes it had acknowledged, less than a lease ago), or of one a replica stored again
    after the store came back empty, within a lease of that: the store may have lost a
    resume of it, whose owner takes the run back if it lives. Answered 503 with
    ``Retry-After`` (claim.lua HELD)."""

    code = "pause_held"

    def __init__(self, execution_id: str, *, held_ms: int) -> None:
        self.retry_after = max(1, -(-held_ms // 1000))
        super().__init__(
            "the event store came back without writes it had acknowledged; the pause of "
            f"{execution_id} takes no answer for {self.retry_after} s, so that a resume "
            "the store lost is never answered twice: try again then"
        )
        self.execution_id = execution_id


class WriteRefused(FlowcastError):
    """The buffer refused a batch on purpose; retrying the same batch cannot help.

    ``reason`` is ``fenced`` (the writer is no longer the execution's owner), ``order``
    (the batch does not follow ``last_id``, the id stored last), ``gone`` (the
    execution's metadata no longer exists) or ``cancel`` (a cancel wins over the batch's
    final event); each has its leaf below.
    """

    code = "write_refused"

    def __init__(self, execution_id: str, reason: str, *, last_id: int | None = None) -> None:
        super().__init__(f"the buffer refused a batch for {execution_id}: {reason}")
        self.execution_id = execution_id
        self.reason = reason
        self.last_id = last_id


class WriteFenced(WriteRefused):
    """Another owner with the same or a later epoch holds the execution (``owner``)."""

    def __init__(self, execution_id: str, *, owner: str = "") -> None:
        super().__init__(execution_id, "fenced")
        self.owner = owner


class WriteOutOfOrder(WriteRefused):
    """The batch does not follow ``last_id``, the id stored last."""

    def __init__(self, execution_id: str, *, last_id: int) -> None:
        super().__init__(execution_id, "order", last_id=last_id)


class WriteGone(WriteRefused):
    """The execution's metadata no longer exists (the store lost it, or it expired)."""

    def __init__(self, execution_id: str) -> None:
        super().__init__(execution_id, "gone")


class CancelWins(WriteRefused):
    """A cancel was accepted before the batch's final event: the writer ends the run
    ``execution:cancelled`` instead; nothing was written."""

    def __init__(self, execution_id: str) -> None:
        super().__init__(execution_id, "cancel")
