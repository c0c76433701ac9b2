"""The ownership state machine with the parts it keeps in step, on one buffer, built
as the app builds them (``Transitions.build`` in lib/workflows/parts.py)."""

from __future__ import annotations

from lib.execution.buffer import EventBuffer
from lib.workflows.parts import Transitions


def ownership_parts(buffer: EventBuffer, lease_seconds: float) -> Transitions:
    return Transitions.build(buffer, lease_seconds=lease_seconds)
