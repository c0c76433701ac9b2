"""JSON encoding of large values in slices that each hold the event loop briefly.

``orjson.dumps`` is one C call that holds the GIL for all of a value: 5 million zeros
take 80-150 ms on a busy machine, and a thread does not help (it holds the same GIL).
Every tenant's requests wait that long (step 16's review, row 1: "no tenant's data holds
the event loop"). ``encode`` gives the same bytes as ``orjson.dumps`` but builds them
piece by piece, each piece at most ``PIECE`` elements, and lets the loop run between
pieces. ``size_past`` answers "is this value's JSON larger than ``limit``?" at a cost
proportional to ``limit``, not to the value.

A value of at most ``PIECE`` elements (the normal case) is encoded by one call, as
before: counting its elements stops at ``PIECE``, so it costs microseconds.

Several large values in slices at once take turns (``_Lane``): one slice per turn of the
loop, whoever's it is. Each yielding with ``asyncio.sleep(0)`` alone, six 10 MB echoes
put a slice of each (and of each of their walks) into every turn: rounds of 100-200 ms
that every request waited for at each of its steps.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import orjson

# Elements encoded in one go: about a millisecond of orjson on a busy machine.
PIECE = 16_384
# The longest the loop is held between two yields of ``encode``. Each turn of the loop
# holds at most one slice, so each step of another request waits for one at most: at 5
# ms, another tenant's GET beside two 10 MB echoes took 42-50 ms (p50), at 2 ms 17-32
# ms, the echoes no slower (a turn between two slices costs microseconds).
SLICE_SECONDS = 0.002


def weight(value: Any, cap: int = PIECE) -> int:
    """How many elements ``value`` holds, counted up to just past ``cap``."""
    if not isinstance(value, list | dict):
        return 1
    count = 0
    stack: list[Any] = [value]
    while stack:
        current = stack.pop()
        children = current.values() if isinstance(current, dict) else current
        count += len(children)
        if count > cap:
            return count
        if not _SCALARS.issuperset(map(type, children)):  # in C: only scalars below
            stack.extend(child for child in children if isinstance(child, list | dict))
    return count


_SCALARS = frozenset({str, int, float, bool, type(None)})


class _Lane:
    """The turns of one event loop's large-value work: one slice per turn of the loop.

    A slice that is used up waits in line (``wait``); one waiter is let go per turn of
    the loop, so between two slices, whoever's, the loop polls its sockets, runs its
    timers (lease renewals) and every other ready callback. A lone large value waits
    one empty turn between two slices (microseconds)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._granting = False

    def wait(self) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiting.append(waiter)
        if not self._granting:
            self._granting = True
            self._loop.call_soon(self._grant)
        return waiter

    def _grant(self) -> None:
        """Let the first waiter go (its slice runs on the next turn), and come back on
        the next turn while others wait."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # a cancelled waiter is skipped
                waiter.set_result(None)
                break
        if self._waiting:
            self._loop.call_soon(self._grant)
        else:
            self._granting = False


_lanes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Lane] = weakref.WeakKeyDictionary()


async def pause() -> None:
    """Let the loop run a turn, and the other large values' slices in line go first."""
    loop = asyncio.get_running_loop()
    lane = _lanes.get(loop)
    if lane is None:
        lane = _lanes[loop] = _Lane(loop)
    await lane.wait()


class Pacer:
    """Lets the event loop run every ``SLICE_SECONDS`` of a long walk in Python."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def tick(self) -> None:
        """Called between two steps of the walk: yields when this slice is used up."""
        if time.perf_counter() - self._since > SLICE_SECONDS:
            await pause()
            self._since = time.perf_counter()


# Above this, hashing runs in a thread: hashlib lets go of the GIL while it hashes.
_HASH_IN_THREAD_BYTES = 1024 * 1024


async def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex; in a thread when large, so hashing 10 MB (20-40
    ms) does not hold the event loop."""
    if len(data) < _HASH_IN_THREAD_BYTES:
        return hashlib.sha256(data).hexdigest()
    return (await asyncio.to_thread(hashlib.sha256, data)).hexdigest()


# Bytes ``contains`` reads at once (about a millisecond).
FIND_BYTES = 1024 * 1024


async def contains(data: bytes, needle: bytes) -> bool:
    """``needle in data``; a long ``data`` is searched in windows, the loop running
    between them (``in`` over 36 MB took 40-45 ms)."""
    if len(data) <= FIND_BYTES:
        return needle in data
    for start in range(0, len(data), FIND_BYTES):
        if data.find(needle, start, start + FIND_BYTES + len(needle) - 1) != -1:
            return True
        await pause()
    return False


# Bytes scanned by one regular-expression search of ``search``.
SCAN_BYTES = 256 * 1024


async def search(pattern: re.Pattern[bytes], data: bytes, *, longest: int = 64) -> bool:
    """True when ``pattern`` (whose matches are at most ``longest`` bytes) matches in
    ``data``; a long ``data`` is scanned in windows, the loop running between them."""
    if len(data) <= SCAN_BYTES:
        return pattern.search(data) is not None
    for start in range(0, len(data), SCAN_BYTES):
        if pattern.search(data, start, min(len(data), start + SCAN_BYTES + longest)):
            return True
        await pause()
    return False


async def encode(value: Any, option: int = 0) -> bytes:
    """``orjson.dumps(value, option=option)`` (the same bytes, the same errors), in
    slices when large."""
    if weight(value) <= PIECE:
        return orjson.dumps(value, option=option)
    await pause()  # in line behind the slices of the large values already in hand
    parts: list[bytes] = []
    since = time.perf_counter()
    for piece in pieces(value, option):
        parts.append(piece)
        if time.perf_counter() - since > SLICE_SECONDS:
            await pause()  # the loop runs between pieces
            since = time.perf_counter()
    return await joined(parts)


# Above this, ``bytes.join`` lets go of the GIL while it copies (CPython's stringlib).
_JOIN_IN_THREAD_BYTES = 1024 * 1024


async def joined(parts: list[bytes]) -> bytes:
    """``b"".join(parts)``; in a thread when large: copying 10 MB into fresh pages took
    5-10 ms on a busy machine, with the loop held."""
    if sum(map(len, parts)) < _JOIN_IN_THREAD_BYTES:
        return b"".join(parts)
    return await asyncio.to_thread(b"".join, parts)


async def size_past(value: Any, limit: int) -> int:
    """The size of ``value``'s JSON when it is at most ``limit``, else a number above
    ``limit``; it costs about what encoding ``limit`` bytes costs, whatever the value,
    in slices."""
    if weight(value) <= PIECE:
        return len(orjson.dumps(value))
    await pause()
    size = 0
    since = time.perf_counter()
    for piece in pieces(value):
        size += len(piece)
        if size > limit:
            break
        if time.perf_counter() - since > SLICE_SECONDS:
            await pause()
            since = time.perf_counter()
    return size


def pieces(value: Any, option: int = 0) -> Iterator[bytes]:
    """``orjson.dumps(value, option=option)`` as consecutive pieces, each of at most
    ``PIECE`` elements (``OPT_SORT_KEYS``: an object's members in the order orjson
    sorts them, by code point)."""
    if weight(value) <= PIECE:
        yield orjson.dumps(value, option=option)
    elif isinstance(value, list):
        yield b"["
        yield from _runs(
            value,
            lambda run: orjson.dumps(value[run], option=option)[1:-1],
            lambda at: pieces(value[at], option),
        )
        yield b"]"
    else:
        keys = sorted(value) if option & orjson.OPT_SORT_KEYS else list(value)
        items = [value[key] for key in keys]
        yield b"{"
        yield from _runs(
            items,
            lambda run: orjson.dumps({key: value[key] for key in keys[run]}, option=option)[1:-1],
            lambda at: _member(keys[at], items[at], option),
        )
        yield b"}"


def _member(key: Any, value: Any, option: int) -> Iterator[bytes]:
    yield orjson.dumps({key: None})[1:-6]  # the key as orjson spells it, with its checks
    yield b":"
    yield from pieces(value, option)


def _runs(
    children: list[Any],
    whole: Callable[[slice], bytes],
    alone: Callable[[int], Iterator[bytes]],
) -> Iterator[bytes]:
    """The children's JSON, comma-separated: runs of light children encoded together,
    a heavy child on its own in pieces. The run grows while runs stay light."""
    start, step = 0, PIECE
    while start < len(children):
        run = slice(start, min(start + step, len(children)))
        if weight(children[run]) <= PIECE:
            if start:
                yield b","
            yield whole(run)
            start = run.stop
            step = min(PIECE, step * 2)
        elif step > 1:
            step = max(1, step // 8)
        else:
            if start:
                yield b","
            yield from alone(start)
            start += 1
            step = PIECE
