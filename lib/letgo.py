"""Freeing large values in slices (SPEC §8: no value holds the event loop).

Freeing a value frees everything in it at once, in C, with the loop held: the 1.4
million objects of a parsed 35 MB ``http`` answer took 0.3-0.4 s when the last reference
to it went (the end of the block's attempt). ``let_go`` takes such a value apart a chunk
at a time instead, in the slices of ``lib/slices.py``.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import Any

from lib.slices import PIECE, Pacer, pause, weight

# What ``let_go`` frees at once: this many elements of a list or an object, each holding
# at most ``_LOOSE`` elements at any depth (a larger one is taken apart the same way).
_CHUNK, _LOOSE = 1024, 256
_graveyard: deque[Any] = deque()
_digger: list[asyncio.Task[None]] = []


def let_go(*values: Any) -> None:
    """Hand over large values the caller is done with, to be freed in slices.

    Freeing a value frees everything in it at once: the 1.4 million objects of a parsed
    35 MB answer took 0.3 s with the loop held when the last reference went. A value
    handed over here is taken apart a chunk at a time instead, but only if nothing else
    holds it by then (its reference count says so); anything else is only let go of.
    The caller drops its own references right after (a local going out of scope)."""
    seen: set[int] = set()
    for value in values:
        if id(value) not in seen and weight(value) > PIECE:
            seen.add(id(value))
            _graveyard.append(value)
    loop = asyncio.get_running_loop()
    if _digger and (_digger[0].done() or _digger[0].get_loop() is not loop):
        _digger.clear()  # a loop that ended with its digger (tests run one loop each)
    if _graveyard and not _digger:
        task = loop.create_task(_dig(), name="let-go")
        _digger.append(task)
        task.add_done_callback(lambda _: _digger.clear())


async def _dig() -> None:
    pacer = Pacer()
    await pause()  # the callers' frames end first, with their references
    while _graveyard:
        value = _graveyard.popleft()
        # Held only here: by ``value`` and by getrefcount's argument.
        if sys.getrefcount(value) <= 2:
            while value:
                if isinstance(value, list):
                    chunk = value[-_CHUNK:]
                    del value[-_CHUNK:]
                else:
                    chunk = [value.popitem()[1] for _ in range(min(_CHUNK, len(value)))]
                _graveyard.extend(
                    child
                    for child in chunk
                    if isinstance(child, list | dict) and weight(child, _LOOSE) > _LOOSE
                )
                del chunk  # the small ones go now, the large ones in their turn
                await pacer.tick()
        del value
        await pacer.tick()
