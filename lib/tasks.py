"""Stopping a background task so that it stays stopped.

On Python 3.11, ``asyncio.wait_for`` returns its inner call's result and drops a cancel
that lands as that call completes (fixed in 3.12). redis-py sends every command through
it once a socket timeout is set, so a loop of Redis calls cancelled at that moment runs
on, and whoever awaits its end waits forever. ``stop`` asks again until the task ends.
Flowcast's own code never uses ``wait_for`` (ruff bans it in ``lib`` and ``app``).
"""

from __future__ import annotations

import asyncio
from typing import Any

AGAIN_SECONDS = 0.02  # a dropped cancel is asked again this often


async def stop(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any that a dropped
    cancel left running. For loops that do no work of their own after a cancel: a
    second cancel may land in whatever they do with the first. What a task raised
    before it was stopped is its owner's to see, as with ``gather(return_exceptions=True)``."""
    running = {task for task in tasks if task is not None}
    while running:
        for task in running:
            task.cancel()
        done, running = await asyncio.wait(running, timeout=AGAIN_SECONDS)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: not reported again as never retrieved
