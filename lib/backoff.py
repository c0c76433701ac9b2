"""Jittered exponential backoff, shared by every retry loop in Flowcast.

Each wait is drawn between half the current delay and the delay itself, so many
processes retrying after the same outage spread out; the delay then grows by ``factor``
up to ``cap``, and ``reset`` starts over after a success.
"""

from __future__ import annotations

import asyncio
import random


class Backoff:
    """The waits of one retry loop."""

    def __init__(self, *, base: float, cap: float, factor: float = 2.0) -> None:
        self._base = base
        self._cap = cap
        self._factor = factor
        self.delay = base

    async def wait(self) -> None:
        """Sleep about ``delay`` (jittered), then grow it."""
        await asyncio.sleep(self.next())

    def next(self) -> float:
        """The next wait (jittered), growing the delay: for a loop that waits on
        something else at the same time."""
        wait = random.uniform(self.delay / 2, self.delay)
        self.delay = min(self.delay * self._factor, self._cap)
        return wait

    def reset(self) -> None:
        self.delay = self._base
