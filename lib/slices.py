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
import gc
import hashlib
import json
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


# A body at most this long is parsed in one call (a few milliseconds at most).
PIECE_BYTES = 128 * 1024
_SPACE = b" \t\r\n"


_Parse = Callable[[bytes], Any]
_BLANK = re.compile(rb"[ \t\r\n]*")


class _Unsliced(Exception):
    """The body is not cut where ``decode`` tried: it is parsed whole instead."""


async def decode(body: bytes, parse: _Parse, attempt: _Parse) -> Any:
    """``parse(body)``, the body parsed by pieces of about ``PIECE_BYTES`` with the loop
    running between them, when it is a large array or object.

    An array's elements (an object's members) are cut at commas and each run parsed by
    ``parse`` wrapped in brackets; a cut inside a string or a nested value does not
    parse, and the run grows to the next comma further on. The last element (member
    value) is parsed the same way inside, so ``{"input": [... 5 million ...]}`` is cut
    where it is large. Whatever does not parse by pieces (bad JSON, a large element
    that is not the last) is parsed whole, so the answer and the errors are those of
    ``parse``. ``attempt`` parses a run where a cut is tried: as ``parse`` does, but
    without any slower second try when it fails (a cut in the wrong place fails)."""
    if len(body) <= PIECE_BYTES:
        return parse(body)
    await pause()
    try:
        return await _value(body, 0, len(body), _Parsers(parse, attempt, Pacer()))
    except _Unsliced:
        return parse(body)


class _Parsers:
    def __init__(self, parse: _Parse, attempt: _Parse, pacer: Pacer) -> None:
        self.parse = parse
        self.attempt = attempt
        self.pacer = pacer


async def _value(body: bytes, start: int, end: int, parse: _Parsers) -> Any:
    while start < end and body[start] in _SPACE:
        start += 1
    while end > start and body[end - 1] in _SPACE:
        end -= 1
    if end - start <= PIECE_BYTES or body[start] not in b"[{":
        return _parsed(parse.parse, body[start:end])
    opening, closing = body[start : start + 1], b"]" if body[start] == ord("[") else b"}"
    if body[end - 1] != closing[0]:
        raise _Unsliced
    return await _container(body, start + 1, end - 1, opening, closing, parse)


async def _container(
    body: bytes, start: int, end: int, opening: bytes, closing: bytes, parse: _Parsers
) -> Any:
    """The array or object whose inside is ``body[start:end]``, parsed by runs."""
    whole: Any = _aged([] if opening == b"[" else {})
    position = start
    while position < end:
        found = await _run(body, position, end, opening, closing, parse)
        if found is None:
            _add(whole, await _rest(body, position, end, opening, closing, parse))
            break
        cut, run = found
        _add(whole, run)
        position = cut + 1
        await parse.pacer.tick()  # the loop runs between runs
    return whole


def _aged(container: Any) -> Any:
    """``container``, moved to the garbage collector's oldest generation while empty.

    A list that grows to millions of elements by runs allocates few objects the
    collector counts, so it stayed young until a young collection walked it whole:
    with six 10 MB bodies parsed at once, one young collection walked all six, 80-180
    ms with the loop stopped. Once old, only a full collection walks it. Collecting
    the two young generations costs about a millisecond; it is done once per large
    array or object of a large body."""
    if gc.isenabled():
        gc.collect(1)
    return container


# Cuts tried for one run before the rest is taken as one (large) element.
_TRIES = 8
_ENDINGS = (b"},", b"],", b'",')


async def _run(
    body: bytes, start: int, end: int, opening: bytes, closing: bytes, parse: _Parsers
) -> tuple[int, Any] | None:
    """The next run of elements from ``start``, about ``PIECE_BYTES`` long, and the
    comma that ends it; None when no cut tried parses. The loop may run between two
    cuts tried (eight failed tries in a row held it 20-30 ms)."""
    cut = body.find(b",", start + PIECE_BYTES, end)
    for _ in range(_TRIES):
        if cut == -1:
            return None
        try:
            return cut, _parsed(parse.attempt, opening + body[start:cut] + closing)
        except _Unsliced:
            cut = _next_cut(body, cut + 1, min(end, cut + 4 * PIECE_BYTES))
        await parse.pacer.tick()
    return None


def _next_cut(body: bytes, start: int, end: int) -> int:
    """The next comma after what likely ends an element (an object, a list, a string),
    else the next comma: a cut inside an element does not parse."""
    endings = [at + 1 for at in (body.find(ending, start, end) for ending in _ENDINGS) if at >= 0]
    return min(endings) if endings else body.find(b",", start, end)


async def _rest(
    body: bytes, start: int, end: int, opening: bytes, closing: bytes, parse: _Parsers
) -> Any:
    """The last run of a container: one large element (member), parsed inside by runs,
    or else all of it at once."""
    if _BLANK.fullmatch(body, start, end):
        raise _Unsliced  # a trailing comma: the whole parse says so
    if end - start <= PIECE_BYTES:
        return _parsed(parse.parse, opening + body[start:end] + closing)
    if opening == b"[":
        try:
            return [await _value(body, start, end, parse)]
        except _Unsliced:
            return _parsed(parse.parse, opening + body[start:end] + closing)
    colon = _after_key(body, start, end)
    if colon is not None:
        key = _parsed(parse.parse, body[start:colon])
        if isinstance(key, str):
            try:
                return {key: await _value(body, colon + 1, end, parse)}
            except _Unsliced:
                pass
    return _parsed(parse.parse, opening + body[start:end] + closing)


def _after_key(body: bytes, start: int, end: int) -> int | None:
    """Where the ``:`` after an object member's key is, if the member starts with one."""
    quote = body.find(b'"', start, end)
    if quote == -1 or body[start:quote].strip(_SPACE):
        return None
    at = quote + 1
    while True:
        at = body.find(b'"', at, end)
        if at == -1:
            return None
        backslashes = 0
        while body[at - 1 - backslashes] == ord("\\"):
            backslashes += 1
        if backslashes % 2 == 0:
            break
        at += 1
    colon = body.find(b":", at + 1, end)
    if colon == -1 or body[at + 1 : colon].strip(_SPACE):
        return None
    return colon


def _parsed(parse: _Parse, piece: bytes) -> Any:
    try:
        return parse(piece)
    except ValueError:  # json.JSONDecodeError and orjson's are ValueErrors
        raise _Unsliced from None


def _add(whole: Any, run: Any) -> None:
    if isinstance(whole, list):
        whole.extend(run)
    else:
        whole.update(run)


# Every digit as "0", everything else as a space: a run of 19 digits is then found by
# ``bytes.find``, 4-20 times faster than the regular expression ``[0-9]{19}`` (which
# cost 1-2 ms per 128 KiB of a body of numbers, at each cut ``decode`` tried).
_DIGITS_AS_ZERO = bytes(byte if byte in b"0123456789" else 32 for byte in range(256)).translate(
    bytes.maketrans(b"0123456789", b"0000000000")
)
_NINETEEN_DIGITS = b"0" * 19


def _long_number(body: bytes) -> bool:
    """True when ``body`` holds a run of 19 digits (a number the standard library and
    orjson may read differently)."""
    return body.translate(_DIGITS_AS_ZERO).find(_NINETEEN_DIGITS) != -1


async def decode_json(body: bytes) -> Any:
    """``parse_json(body)``, in slices when the body is large (``decode``)."""
    return await decode(body, parse_json, _attempt)


def parse_json(body: bytes) -> Any:
    """A JSON body as the standard library reads it, by orjson where that is the same."""
    if not _long_number(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the standard library decides: its value, or its error, as before
    return json.loads(body)


def _attempt(body: bytes) -> Any:
    """``parse_json`` without the standard library's second try when orjson fails: a
    run of a large body cut in the wrong place fails fast (``lib.slices.decode``)."""
    if _long_number(body):
        return json.loads(body)
    return orjson.loads(body)
