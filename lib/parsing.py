"""JSON parsed from large bodies in slices that each hold the event loop briefly.

``orjson.loads`` is one C call that holds the GIL for all of a body: a 35 MB answer of
an ``http`` block took seconds (step 16's review, row 1). ``decode`` parses the same
value by pieces of about ``PIECE_BYTES``, the loop running between them (the slices of
``lib/slices.py``), and keeps what a large body built out of the garbage collector's
full collections, which would otherwise walk its millions of containers at once
(``lib.letgo.keep_out``).
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Callable
from typing import Any

import orjson

from lib.letgo import keep_out
from lib.slices import Pacer, pause

# A body at most this long is parsed in one call (a few milliseconds at most).
PIECE_BYTES = 128 * 1024
# An array or object at least this long in a body is kept out of the garbage collector's
# full collections (lib/letgo.py ``keep_out``): tens of thousands of containers and more.
KEEP_OUT_BYTES = 1024 * 1024
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
        value = parse(body)
    if len(body) >= KEEP_OUT_BYTES:
        keep_out(value)
    return value


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
    whole: Any = [] if opening == b"[" else {}
    # A large one is kept out of full collections as it grows, run by run: built first
    # and kept out after, it was walked by the full collections its own runs set off
    # (10-120 ms each for 300,000 objects, more and more often as it grew).
    kept = end - start >= KEEP_OUT_BYTES
    if kept:
        keep_out(whole)
    else:
        _aged(whole)
    position = start
    while position < end:
        found = await _run(body, position, end, opening, closing, parse)
        if found is None:
            _add(whole, await _rest(body, position, end, opening, closing, parse))
            break
        cut, run = found
        _add(whole, run)
        del run
        if kept:
            keep_out()
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
    run of a large body cut in the wrong place fails fast (``decode``)."""
    if _long_number(body):
        return json.loads(body)
    return orjson.loads(body)
