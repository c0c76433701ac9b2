"""Flowcast's exceptions.

    FlowcastError                      root of everything Flowcast raises on purpose
    ├── NotFound                       an unknown workflow, execution or value
    ├── Conflict                       the target is not in a state that allows this
    ├── InvalidInput                   a request the caller can fix (carries problems)
    │   └── WorkflowInvalid            a workflow definition with every problem found
    ├── BlockError                     a block attempt failed (code, message, retryable)
    ├── ShuttingDown                   the process no longer starts executions
    ├── TooBusy                        the tenant runs as many executions as it may
    │   └── TooManyStreams             the tenant has as many streams open as it may
    ├── BufferUnavailable              the event buffer could not be reached
    └── WriteRefused                   the buffer refused a batch (fenced, out of order, gone)

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


class Conflict(FlowcastError):
    """The target exists but is not in a state that allows the request."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


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


class TooBusy(FlowcastError):
    """The tenant already runs its most executions; ``retry_after`` is a hint in seconds."""

    code = "too_many_executions"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyStreams(TooBusy):
    """The tenant already has its most SSE connections open (on this replica)."""

    code = "too_many_streams"


class BufferUnavailable(FlowcastError):
    """The event buffer could not be reached (or answered with an error)."""

    code = "buffer_unavailable"


class WriteRefused(FlowcastError):
    """The buffer refused a batch on purpose; retrying the same batch cannot help.

    ``reason`` is ``fenced`` (the writer is no longer the execution's owner), ``order``
    (the batch does not follow ``last_id``, the id stored last) or ``gone`` (the
    execution's metadata no longer exists).
    """

    code = "write_refused"

    def __init__(self, execution_id: str, reason: str, *, last_id: int | None = None) -> None:
        super().__init__(f"the buffer refused a batch for {execution_id}: {reason}")
        self.execution_id = execution_id
        self.reason = reason
        self.last_id = last_id
