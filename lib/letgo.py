"""Large values and the event loop, after they are built (SPEC §8: no value holds it).

Freeing a value frees everything in it at once, in C, with the loop held: the 1.4
million objects of a parsed 35 MB ``http`` answer took 0.3-0.4 s when the last reference
to it went (the end of the block's attempt). ``let_go`` takes such a value apart a chunk
at a time instead, in the slices of ``lib/slices.py``.

While it lives, CPython's full garbage collections walk every container in it, all at
once, with the loop held: 0.2-0.6 s for the same answer, each time one ran.
``keep_out`` moves such a value out of their way (the permanent generation, where
startup's objects already are: app/memory.py) as soon as it is built. What was in the
oldest generation then is moved with it, cyclic garbage included, which full
collections then do not free either: a sweep every ``SWEEP_SECONDS`` hands each kept
value that only it still holds to ``let_go``, and once none is left, moves the
permanent generation back (``gc.unfreeze``) for the next full collection to find that
garbage, after which what lives is kept out again. So garbage waits as long as the
large values parsed beside it live, and never more than ``HOLD_SECONDS``: past that, a
full collection walks the values still kept (once a minute at most, with large values
parsed all the time: before, once per large value).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections import deque
from typing import Any

from lib.slices import PIECE, Pacer, pause, weight

# What ``let_go`` frees at once: this many elements of a list or an object, each holding
# at most ``_LOOSE`` elements at any depth (a larger one is taken apart the same way).
_CHUNK, _LOOSE = 1024, 256
_graveyard: deque[Any] = deque()
_digger: list[asyncio.Task[None]] = []
# How often the values ``keep_out`` holds are looked at, to be let go of once nobody
# else holds them.
SWEEP_SECONDS = 2.0
# The longest garbage is held back while large values stay kept one after another:
# then one full collection (walking them: 0.3-0.4 s for a 35 MB answer's) finds it. A
# server makes ~16 objects of cyclic garbage per execution that reach the oldest
# generation (measured: 600 two-block executions), a few KB.
HOLD_SECONDS = 60.0
_kept: list[Any] = []
_sweeper: list[asyncio.Task[None]] = []


class _Refreeze:
    """A garbage collector callback: once due, keeps everything out of later full
    collections right after one ends (``gc.freeze``)."""

    def __init__(self) -> None:
        self.due = False

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if self.due and phase == "stop" and info["generation"] == 2:
            self.due = False
            gc.freeze()  # a full collection just ended: nothing left is garbage


_refreeze = _Refreeze()


def keep_out(*values: Any) -> None:
    """Keep ``values`` (large containers being built, of a parsed body) out of full
    collections until nothing else holds them, with everything else alive now (called
    with none: what was built since the last call, as a container grows). The young
    generations are collected first (a millisecond or so: their garbage is not moved)."""
    if not gc.isenabled():
        return
    gc.collect(1)
    gc.freeze()
    if not values:
        return
    _kept.extend(values)
    loop = asyncio.get_running_loop()
    if _sweeper and (_sweeper[0].done() or _sweeper[0].get_loop() is not loop):
        _sweeper.clear()  # a loop that ended with its sweeper (tests run one loop each)
    if not _sweeper:
        task = loop.create_task(_sweep(), name="keep-out")
        _sweeper.append(task)
        task.add_done_callback(lambda _: _sweeper.clear())


def kept() -> int:
    """How many values ``keep_out`` holds out of full collections now."""
    return len(_kept)


async def _sweep() -> None:
    since = time.monotonic()  # when garbage was last let out of the permanent generation
    # Until nothing is kept once the values let go of are taken apart: one kept while
    # this waited for that (a large body parsed meanwhile) is swept too, or nothing
    # would let go of it until some other large body was kept.
    while _kept or _digger:
        while _kept:
            await asyncio.sleep(SWEEP_SECONDS)
            if time.monotonic() - since > HOLD_SECONDS:
                # Large values kept all along (one after another): what garbage they
                # hold back is found now, at the cost of one full collection that walks
                # them.
                gc.unfreeze()
                gc.collect()
                gc.freeze()
                since = time.monotonic()
            # Held only by ``_kept``, by the loop's name and by getrefcount's argument.
            done = [value for value in _kept if sys.getrefcount(value) <= 3]
            if not done:
                continue
            _kept[:] = [value for value in _kept if all(value is not gone for gone in done)]
            let_go(*done)
            del done
        while _digger:  # what is left of them is kept out until taken apart
            await asyncio.shield(_digger[0])
    gc.unfreeze()
    # What was kept out before (startup's objects: app/memory.py) is walked again by
    # full collections, 70 ms for a bare server's: kept out again right after the next
    # one, when nothing it did not free is garbage.
    _refreeze.due = True
    if _refreeze not in gc.callbacks:
        gc.callbacks.append(_refreeze)


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
