"""Masking secret values as ``***`` wherever they would come back out.

A value is searched for in every spelling it may come back in (as is, percent-encoded
as urllib and as httpx write it, escaped in JSON text, in base64); other
transformations cannot be recognized. No regular expression: each text is searched for
the spellings it may hold, and the ranges found are masked together, so two secrets
that overlap are both masked whole. With many spellings, a text is first cut into the
4-character pieces a spelling can start with (64 KiB at a time), and only the spellings
whose first four characters it holds are searched for; a chunk's held-back end is found
the same way. Masking costs about the text's length, whatever the number of values known
(step 16's review: 128 values of 8 KiB made every streamed chunk cost ~4 ms).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

MASK = "***"
_HEAD = 4
_DIRECT = 32
_WINDOW = 64 * 1024  # a text is cut into pieces this much at a time
# Below this, a direct search for every spelling costs less than cutting a long text
# into pieces (measured: 1,000 spellings of ~8 KiB search 1 MB in ~18 ms, pieces ~230).
_DIRECT_COST = 0.5

Spans = list[tuple[int, int]]


@functools.lru_cache(maxsize=256)
def spellings(value: str) -> frozenset[str]:
    """``value`` as it may come back: as is, percent-encoded (a URL, a form), escaped
    in JSON text, in base64."""
    found = {
        value,
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote(value, safe="/:@!$&'()*+,;=?~"),
        urllib.parse.quote_plus(value),
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(value)[1:-1],
        base64.b64encode(value.encode("utf-8", "surrogatepass")).decode(),
        *_in_url(value),
    }
    # Too short to mask without masking everything else too.
    return frozenset(s for s in found if len(s) >= min(_HEAD, len(value)))


async def spelled(values: Iterable[str]) -> dict[str, frozenset[str]]:
    """Each value's spellings, for ``Redactor.add_spelled``, worked out a value at a time
    with the event loop let run in between: a value of 8 KiB costs ~2 ms of CPU, so the
    64 secrets one workflow may read would hold the loop, every tenant's requests with
    it, ~0.15 s at once, and several times that on a busy CPU."""
    found: dict[str, frozenset[str]] = {}
    for value in values:
        if value and value not in found:
            found[value] = spellings(value)
            await asyncio.sleep(0)
    return found


def _in_url(value: str) -> set[str]:
    """``value`` as httpx writes it into a URL's path and into its query (it leaves some
    characters as they are that urllib would encode, and encodes others)."""
    found: set[str] = set()
    for before, prefix in (("http://h/p", "/p"), ("http://h/?q=", "/?q=")):
        try:
            raw = httpx.URL(before + value).raw_path.decode("ascii", "replace")
        except (httpx.InvalidURL, UnicodeError, ValueError):
            continue
        found.add(raw.removeprefix(prefix))
    return found


class _Index:
    """The known spellings, arranged for searching: longest first, by their first four
    characters (``heads``), the few shorter than that, and every beginning of one to
    three characters (``starts``: for a chunk's end that may begin a spelling)."""

    def __init__(self, spellings: Iterable[str]) -> None:
        self.ordered = sorted(spellings, key=len, reverse=True)
        self.heads: dict[str, list[str]] = {}
        self.short: list[str] = []
        self.starts: set[str] = set()
        for spelling in self.ordered:
            if len(spelling) < _HEAD:
                self.short.append(spelling)
            else:
                self.heads.setdefault(spelling[:_HEAD], []).append(spelling)
            self.starts.update(spelling[:size] for size in range(1, min(len(spelling), _HEAD)))
        self.longest = len(self.ordered[0]) if self.ordered else 0
        # What searching for each spelling directly costs per character of text: a
        # search skips ahead about a needle's length at a time.
        self.direct_cost = sum(1 / len(spelling) for spelling in self.ordered)

    def candidates(self, text: str) -> Iterable[str]:
        """The spellings ``text`` may hold: those whose head it holds, and the short."""
        if len(self.ordered) <= _DIRECT:
            return self.ordered
        if len(text) > _WINDOW and self.direct_cost <= _DIRECT_COST:
            return self.ordered  # long needles in a long text: each search skips ahead
        found: set[str] = set()
        step = _WINDOW - _HEAD + 1  # windows overlap so that no piece is cut
        for at in range(0, max(len(text) - _HEAD + 1, 0), step):
            window = text[at : at + _WINDOW]
            pieces = {window[i : i + _HEAD] for i in range(len(window) - _HEAD + 1)}
            found.update(pieces & self.heads.keys())
        return [spelling for head in found for spelling in self.heads[head]] + self.short

    def prefix_tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins (and is not) a spelling:
        only the last ``longest - 1`` characters can, each looked up by its head."""
        size = len(text)
        for start in range(max(size - self.longest + 1, 0), size):
            rest = size - start
            if rest < _HEAD:
                return rest if text[start:] in self.starts else self._shorter(text, rest)
            for spelling in self.heads.get(text[start : start + _HEAD], ()):
                if len(spelling) > rest and spelling.startswith(text[start:]):
                    return rest
        return 0

    def _shorter(self, text: str, rest: int) -> int:
        for size in range(rest - 1, 0, -1):
            if text[len(text) - size :] in self.starts:
                return size
        return 0


class Redactor:
    """Masks known values in text, JSON values and (``stream``) chunks."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._spellings: dict[str, frozenset[str]] = {}  # each value's spellings
        self._counts: Counter[str] = Counter()  # how many values give each spelling
        self._index: _Index | None = None
        self.add(values)

    def __bool__(self) -> bool:
        return bool(self._counts)

    def add(self, values: Iterable[str]) -> None:
        """Mask these values from now on (a value already known costs nothing)."""
        self.add_spelled({value: spellings(value) for value in values if value})

    def add_spelled(self, spelled: Mapping[str, frozenset[str]]) -> None:
        """Mask these values, their spellings already worked out (``spelled``)."""
        for value, found in spelled.items():
            if value and value not in self._spellings:
                self._spellings[value] = found
                self._counts.update(found)
                self._index = None

    def remove(self, values: Iterable[str]) -> None:
        """Stop masking these values (spellings another value shares stay masked)."""
        for value in values:
            for spelling in self._spellings.pop(value, ()):
                self._counts[spelling] -= 1
                if self._counts[spelling] <= 0:
                    del self._counts[spelling]
                self._index = None

    def index(self) -> _Index:
        """The spellings arranged for searching, built once per change of the values."""
        if self._index is None:
            self._index = _Index(self._counts)
        return self._index

    def spans(self, text: str) -> Spans:
        """The ranges of ``text`` that hold a known spelling, merged, in order."""
        if not self._counts:
            return []
        found: Spans = []
        for spelling in self.index().candidates(text):
            start = text.find(spelling)
            while start != -1:
                found.append((start, start + len(spelling)))
                start = text.find(spelling, start + 1)
        if not found:
            return []
        found.sort()
        merged = [found[0]]
        for start, end in found[1:]:
            if start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def text(self, text: str) -> str:
        return _masked(text, self.spans(text))

    def value(self, value: Any) -> Any:
        """A JSON value with secrets masked in every string (keys included)."""
        if not self._counts:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(item) for k, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value

    def stream(self) -> ChunkRedactor:
        return ChunkRedactor(self)


def _masked(text: str, spans: Spans) -> str:
    if not spans:
        return text
    parts = []
    at = 0
    for start, end in spans:
        parts += [text[at:start], MASK]
        at = end
    parts.append(text[at:])
    return "".join(parts)


class ChunkRedactor:
    """Masks secrets in a stream of chunks, also when one is split across chunks.

    The end of what arrived that could be the start of a secret is held back until the
    next chunk shows whether it is (so is a whole match that reaches into that end, for
    an overlapping secret); ``flush`` gives what is left when the stream ends. Text
    without any secret in it is never held back.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._held = ""

    def feed(self, chunk: str) -> str:
        if not self._redactor:
            return chunk
        raw = self._held + chunk
        spans = self._redactor.spans(raw)
        cut = len(raw) - self._redactor.index().prefix_tail(raw)
        for start, end in reversed(spans):
            if start < cut < end:
                cut = start
        self._held = raw[cut:]
        return _masked(raw[:cut], [(s, e) for s, e in spans if e <= cut])

    def flush(self) -> str:
        held, self._held = self._held, ""
        return self._redactor.text(held)
