"""What the log's flush (flush.py) does about a store it cannot reach or that lost its
writes: the live gate an owner shows its events behind, and the writer's state.

The gate (``LiveGate``) is open while the owner knows its lease held; a failed renewal
closes it at once. Closed, the writer shows nothing it has not stored.

The writer's state says what its next append must do. It is one ``WriterState``,
changed only by a ``Transition`` through ``TRANSITIONS``; a repair never steps down to
a weaker one, only an append that went through ends it, and a refusal is final:

    state         next append                        check / lost writes /     settle
                                                     lost execution            refuse
    ------------  ---------------------------------  ------------------------  --------
    IN_STEP       the queued batch, if any           CHECKING / WRITING_BACK   IN_STEP
                                                     / RECREATING              REFUSED
    CHECKING      the batch, or an empty one even    CHECKING / WRITING_BACK   IN_STEP
                  when idle: its reply tells whether / RECREATING              REFUSED
                  the store lost the execution
    WRITING_BACK  with the identity and the whole    WRITING_BACK /            IN_STEP
                  checkpoint as stored so far        WRITING_BACK / RECREATING REFUSED
    RECREATING    as WRITING_BACK, recreating the    RECREATING (all three)    IN_STEP
                  metadata if it is missing                                    REFUSED
    REFUSED       none: another owner took over      REFUSED                   REFUSED
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class LiveGate:
    """Whether an owner may show its events live: open while its lease is known held.

    The owner's lease keeper renews it with every lease renewal that succeeded and
    closes it at once when one fails: from inside, a store down for everyone and a store
    lost by this process alone look the same, and in the second case another process
    may take over. A lease period without a renewal (the process stalled) closes it too.
    Closed, the writer holds events back; it shows them once the gate opens again.
    """

    def __init__(self, *, lease_seconds: float, renewed_at: float | None = None) -> None:
        self._lease_seconds = lease_seconds
        self._renewed_at = time.monotonic() if renewed_at is None else renewed_at
        self._closed = False
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    def always_open(cls) -> LiveGate:
        """A gate for a writer with no lease to keep (tests, tools)."""
        return cls(lease_seconds=float("inf"))

    @property
    def open(self) -> bool:
        return not self._closed and time.monotonic() - self._renewed_at < self._lease_seconds

    def renewed(self, at: float) -> None:
        """The lease was renewed by a call that began at ``at`` (monotonic seconds)."""
        self._renewed_at = max(self._renewed_at, at)
        self._closed = False
        for listener in self._listeners:
            listener()

    def close(self) -> None:
        """A renewal failed, or the owner was fenced out: show nothing more for now."""
        self._closed = True

    def when_open(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a renewal (re)opens the gate."""
        self._listeners.append(listener)


class WriterState(enum.Enum):
    """What the writer's next append must do (the table in the module doc)."""

    IN_STEP = "in step"
    CHECKING = "checking"
    WRITING_BACK = "writing back"
    RECREATING = "recreating"
    REFUSED = "refused"


class Transition(enum.Enum):
    """What moves the writer from one state to another."""

    CHECK = "check"  # the lease keeper found the execution missing (request_repair)
    LOST_WRITES = "lost writes"  # an append found the store behind this writer
    LOST_EXECUTION = "lost execution"  # an append found no metadata ("NOEXEC")
    SETTLE = "settle"  # an append went through: the store has all this writer stored
    REFUSE = "refuse"  # another owner took over ("FENCED")


_IN_STEP, _CHECKING, _WRITING_BACK, _RECREATING, _REFUSED = WriterState
# The table of the module doc: a repair never steps down to a weaker one; only an
# append that went through ends it; a refusal is final.
TRANSITIONS: dict[tuple[WriterState, Transition], WriterState] = {
    (_IN_STEP, Transition.CHECK): _CHECKING,
    (_IN_STEP, Transition.LOST_WRITES): _WRITING_BACK,
    (_IN_STEP, Transition.LOST_EXECUTION): _RECREATING,
    (_IN_STEP, Transition.SETTLE): _IN_STEP,
    (_CHECKING, Transition.CHECK): _CHECKING,
    (_CHECKING, Transition.LOST_WRITES): _WRITING_BACK,
    (_CHECKING, Transition.LOST_EXECUTION): _RECREATING,
    (_CHECKING, Transition.SETTLE): _IN_STEP,
    (_WRITING_BACK, Transition.CHECK): _WRITING_BACK,
    (_WRITING_BACK, Transition.LOST_WRITES): _WRITING_BACK,
    (_WRITING_BACK, Transition.LOST_EXECUTION): _RECREATING,
    (_WRITING_BACK, Transition.SETTLE): _IN_STEP,
    (_RECREATING, Transition.CHECK): _RECREATING,
    (_RECREATING, Transition.LOST_WRITES): _RECREATING,
    (_RECREATING, Transition.LOST_EXECUTION): _RECREATING,
    (_RECREATING, Transition.SETTLE): _IN_STEP,
    **{(state, Transition.REFUSE): _REFUSED for state in WriterState},
    **{(_REFUSED, move): _REFUSED for move in Transition},
}
