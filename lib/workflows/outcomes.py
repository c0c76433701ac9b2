"""What a run of the executor stands at or ends with: its checkpoint (``RunState``), a
pause it waits in (``Pause``, raised as ``Paused``), a block that failed for good
(``BlockFailed``), or a drain that handed it off (``HandedOff``). The launcher turns
each into the execution's last event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lib.errors import FlowcastError


class BlockFailed(FlowcastError):
    """A block failed for good, so the execution fails."""

    def __init__(self, block_id: str, code: str, message: str) -> None:
        super().__init__(message)
        self.block_id = block_id
        self.code = code

    def as_error(self) -> dict[str, str]:
        """The ``error`` object of ``execution:failed``."""
        return {"code": self.code, "message": self.message, "blockId": self.block_id}


@dataclass
class RunState:
    """Where a run stands (its checkpoint): enough to go on in any process.

    ``attempts`` is the last attempt each block started. A resumed block (one with an
    answer) carries on with its attempt; after a recovery (``recovered``) every block
    that had not finished starts again with its next attempt.
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    answers: dict[str, Any] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    recovered: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "skipped": self.skipped,
            "answers": self.answers,
            "attempts": self.attempts,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunState:
        return cls(
            outputs=dict(raw.get("outputs", {})),
            skipped=list(raw.get("skipped", [])),
            answers=dict(raw.get("answers", {})),
            attempts=dict(raw.get("attempts", {})),
        )

    def unfinished(self) -> list[str]:
        """Blocks that started and neither completed nor were skipped."""
        done = {*self.outputs, *self.skipped}
        return [block_id for block_id in self.attempts if block_id not in done]


@dataclass(frozen=True)
class Pause:
    """The approval an execution waits for."""

    block_id: str
    prompt: str
    schema: dict[str, Any]
    timeout_seconds: int | None = None


class Paused(FlowcastError):
    """Nothing more can run until a human answers ``pause``; ``state`` resumes it."""

    def __init__(self, pause: Pause, state: RunState) -> None:
        super().__init__(f"paused at {pause.block_id!r}")
        self.pause = pause
        self.state = state


class HandedOff(FlowcastError):
    """The run was drained: what is left runs in another process, from the checkpoint."""

    def __init__(self, deferred: list[str]) -> None:
        super().__init__(f"handed off before {', '.join(deferred)}")
        self.deferred = deferred
