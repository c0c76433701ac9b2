"""Size limits on what callers send: nesting depth and template length.

Bodies are capped in bytes at the HTTP edge; these limits bound the shape of what is
inside, so no input makes validation, templates or the executor recurse or scan without
end.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import orjson

from lib.slices import Pacer

MAX_DEPTH = 64
MAX_TEMPLATE_CHARS = 64 * 1024


def too_deep(value: Any, limit: int = MAX_DEPTH, *, encoded: bytes | None = None) -> bool:
    """True when ``value`` nests lists and objects more than ``limit`` levels deep.

    Found in C on the value's JSON, not by a walk in Python: a request's input is
    checked on the event loop, and a walk of millions of elements held every tenant's
    requests for seconds (step 16's review, row 1). Each pass takes out the innermost
    pairs of brackets; a value ``limit`` deep is gone after ``limit`` passes. A caller
    that has the value's JSON already passes it as ``encoded``."""
    if encoded is None:
        try:
            encoded = orjson.dumps(value)
        except (TypeError, orjson.JSONEncodeError):
            return _walked_too_deep(value, limit)  # not JSON orjson takes (a huge integer)
    # Objects count as lists: "{" as "[", "}" as "]", everything else gone.
    brackets = _outside_strings(encoded).translate(_AS_LISTS, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")  # every innermost pair, one level
    return bool(brackets)


def _outside_strings(encoded: bytes) -> bytes:
    """The JSON text ``encoded`` without its strings (they may hold brackets), in C.

    Escapes go first: pairs of backslashes left to right (as JSON reads them), then
    escaped quotes; every quote left opens or closes a string. A regular expression
    over the strings took 1.4 s for one string of a million characters."""
    unescaped = encoded.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(unescaped.split(b'"')[::2])


_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_AS_LISTS = bytes.maketrans(b"{}", b"[]")


# Bytes of JSON read by one step of ``too_deep_in_slices`` (about a millisecond).
DEPTH_WINDOW = 256 * 1024
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


async def too_deep_in_slices(encoded: bytes, limit: int = MAX_DEPTH) -> bool:
    """``too_deep(..., encoded=encoded)`` for a large value's JSON, read in windows of
    ``DEPTH_WINDOW`` bytes with the event loop let run between them (lib/slices.py).

    The whole passes of ``too_deep`` held the loop 20-35 ms for 10 MB (more for many
    brackets). Here each window's text outside strings becomes steps of +1 and -1 (in
    C), and the deepest nesting is the highest running sum (``accumulate``, in C): the
    same answer, since a value nested D deep leaves brackets after D - 1 passes. A
    window never ends inside a run of backslashes, so every escape is read whole."""
    pacer = Pacer()
    depth, inside, start = 0, False, 0
    while start < len(encoded):
        end = min(len(encoded), start + DEPTH_WINDOW)
        while end < len(encoded) and encoded[end - 1] == ord("\\"):
            end += 1
        text = encoded[start:end].replace(b"\\\\", b"").replace(b'\\"', b"")
        parts = text.split(b'"')
        outside = b"".join(parts[1::2] if inside else parts[::2])
        inside ^= len(parts) % 2 == 0  # an odd number of quotes: a string goes on
        steps = outside.translate(_STEPS, _NOT_BRACKETS)
        if steps:
            if max(accumulate(memoryview(steps).cast("b"), initial=depth)) > limit:
                return True
            depth += len(steps) - 2 * steps.count(b"\xff")
        start = end
        await pacer.tick()
    return False


def _walked_too_deep(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if isinstance(current, dict):
            children: Any = current.values()
        elif isinstance(current, list):
            children = current
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def long_templates(value: Any, path: str = "") -> list[str]:
    """JSON path suffixes of template strings longer than MAX_TEMPLATE_CHARS."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        current, where = stack.pop()
        if isinstance(current, str):
            if len(current) > MAX_TEMPLATE_CHARS and ("{{" in current or "{%" in current):
                found.append(where)
        elif isinstance(current, dict):
            stack.extend((child, f"{where}.{key}") for key, child in current.items())
        elif isinstance(current, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(current))
    return sorted(found)
