"""Compaction: large values inside an event's ``data`` become refs to the value store.

Before an event is stored (and before live readers see it, so both copies are the same
bytes), every value whose JSON is larger than the threshold is written to the value
store and replaced by ``{"$ref": "value", "id", "kind", "size", "preview", "sha256"}``.
The walk is bottom-up: children first, then a container that is still too large.

The threshold is ``large_value_bytes`` (at most half the budget) until the execution's
ring is under pressure (retained bytes past half the budget), then budget ÷ event limit,
so a full ring still fits. The retained bytes are modelled here, event by event as
compacted, exactly as the ring script evicts, so a burst cannot slip through at the
loose threshold before a flush catches up.

Whatever the configuration, an event's ``data`` never keeps more than half the budget
inline: no threshold or cap is above that ceiling, and when several values that each
pass their own threshold add up past it, the largest go too (``_fit``). The envelope
around ``data`` is a few hundred bytes, and the budget is at least a kilobyte, so every
stored event fits the budget and the ring's retained bytes never exceed it.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson

from lib.backoff import Backoff
from lib.errors import FlowcastError
from lib.execution.values import ValueStore, value_id
from lib.metrics import Metrics
from lib.slices import Pacer, contains, encode, sha256_hex

log = logging.getLogger(__name__)

PREVIEW_CHARS = 256
PREVIEW_KEYS = 20
FILE_KEYS = frozenset({"name", "mimeType", "size", "base64"})


@dataclass(frozen=True)
class OffloadPolicy:
    """The thresholds of SPEC §5, from the buffer's bounds and the configured caps."""

    large_value_bytes: int = 8 * 1024 * 1024
    budget_bytes: int = 64 * 1024 * 1024
    event_limit: int = 10_000
    inline_file_bytes: int = 8 * 1024 * 1024
    attempts: int = 3
    retry_base_seconds: float = 0.05

    @property
    def ceiling_bytes(self) -> int:
        """The most an event's ``data`` may keep inline: half the budget."""
        return self.budget_bytes // 2

    @property
    def normal_bytes(self) -> int:
        """The threshold without pressure: the configured one, never above the ceiling."""
        return min(self.large_value_bytes, self.ceiling_bytes)

    @property
    def pressure_bytes(self) -> int:
        """The threshold under pressure: budget ÷ event limit, never above the normal."""
        return min(self.normal_bytes, max(self.budget_bytes // self.event_limit, 64))

    @property
    def inline_file_cap_bytes(self) -> int:
        """The cap for file content kept inline on request, never above the ceiling.

        ``inlineFiles`` exempts a file from the pressure threshold, not from the budget:
        with ``FLOWCAST_INLINE_FILE_BYTES`` above half the budget, one file alone could
        otherwise make an event the ring cannot hold. Several files that each pass this
        cap but together pass the ceiling are handled by ``Compactor._fit``.
        """
        return min(self.inline_file_bytes, self.ceiling_bytes)


class RingModel:
    """The retained bytes of an execution's ring, evicting as the Lua script does.

    ``held_bytes`` are what the checkpoint holds inline (outputs, answers): they count
    against the budget and are never evicted.
    """

    def __init__(self, *, budget_bytes: int, event_limit: int) -> None:
        self._budget = budget_bytes
        self._limit = event_limit
        self._sizes: deque[int] = deque()
        self.retained_bytes = 0
        self.held_bytes = 0

    def add(self, size: int) -> None:
        self._sizes.append(size)
        self.retained_bytes += size
        self._evict()

    def hold(self, size: int) -> None:
        self.held_bytes += size
        self._evict()

    def _evict(self) -> None:
        while len(self._sizes) > 1 and (
            len(self._sizes) > self._limit or self.retained_bytes + self.held_bytes > self._budget
        ):
            self.retained_bytes -= self._sizes.popleft()

    @property
    def under_pressure(self) -> bool:
        return self.retained_bytes + self.held_bytes > self._budget // 2


def is_file_value(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.keys() == FILE_KEYS
        and isinstance(value.get("base64"), str)
    )


def _preview(value: Any) -> Any:
    if isinstance(value, str):
        return value[:PREVIEW_CHARS]
    if isinstance(value, list):
        return len(value)
    return list(itertools.islice(value, PREVIEW_KEYS))  # not a copy of every key first


# In a container's JSON: a ref or a file may be inside (its walk decides); a list of
# numbers, booleans and nulls only has no part that could be offloaded on its own.
_REF_MARK = b'"$ref"'
_FILE_MARK = b'"base64"'


# Bytes of JSON ``_flat`` reads at once (well under a millisecond).
_FLAT_WINDOW = 1024 * 1024


async def _flat(encoded: bytes, pacer: Pacer) -> bool:
    """True for the JSON of a list of numbers, booleans and nulls only; each test is a
    memchr over the bytes, not a regular expression (50 ms for 10 MB on the loop), by
    windows with the loop let run between them (the whole 10 MB took 5-10 ms)."""
    if encoded[:1] != b"[":
        return False
    brackets = 0
    for start in range(0, len(encoded), _FLAT_WINDOW):
        end = start + _FLAT_WINDOW
        # The searches first: they stop at the first object or string.
        if encoded.find(b"{", start, end) != -1 or encoded.find(b'"', start, end) != -1:
            return False
        brackets += encoded.count(b"[", start, end) + encoded.count(b"]", start, end)
        if brackets > 2:
            return False
        await pacer.tick()
    return brackets == 2


def is_ref(value: Any) -> bool:
    """True for a ref into the value store (SPEC §5)."""
    return isinstance(value, dict) and value.get("$ref") == "value"


def _kind(value: Any) -> str:
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"


def _ref(value: Any, encoded: bytes, digest: str) -> dict[str, Any]:
    """The ref that stands for ``value`` (whose JSON is ``encoded``) once it is stored."""
    return {
        "$ref": "value",
        "id": value_id(digest),
        "kind": _kind(value),
        "size": len(encoded),
        "preview": _preview(value),
        "sha256": digest,
    }


def _shrinks(value: Any, encoded: bytes, inline_size: int) -> bool:
    """True when a ref for ``value`` takes fewer bytes than it does inline now."""
    # Every digest has the same length, so a dummy one measures the ref without hashing.
    return len(orjson.dumps(_ref(value, encoded, "0" * 64))) < inline_size


class Compactor:
    """Compacts one execution's events; keeps the ring model and what it stored."""

    def __init__(
        self,
        *,
        store: ValueStore,
        execution_id: str,
        policy: OffloadPolicy,
        inline_files: bool = False,
        metrics: Metrics | None = None,
    ) -> None:
        self._store = store
        self._execution_id = execution_id
        self._policy = policy
        self._inline_files = inline_files
        self._metrics = metrics
        self.ring = RingModel(budget_bytes=policy.budget_bytes, event_limit=policy.event_limit)
        self._stored: set[str] = set()
        self.offload_failures = 0
        # The walk of a container of many small parts lets the loop run between them
        # (700,000 objects in a 35 MB http answer: seconds of walking; step 16, row 1).
        self._pacer = Pacer()

    @property
    def threshold(self) -> int:
        """The offload threshold in force now."""
        if self.ring.under_pressure:
            return self._policy.pressure_bytes
        return self._policy.normal_bytes

    def fits(self, envelope_size: int) -> bool:
        """True when no value inside an envelope this size can need offloading."""
        # The threshold is never above the ceiling, so an envelope within it cannot need
        # ``_fit`` either: this agrees with ``compact`` in every configuration.
        return envelope_size <= self.fit_bytes

    @property
    def fit_bytes(self) -> int:
        """The largest envelope ``fits`` takes."""
        return min(self.threshold, self._policy.inline_file_cap_bytes)

    def stored(self, envelope_size: int) -> None:
        """Count an event, as it will be stored, into the ring model."""
        self.ring.add(envelope_size)

    async def compact(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with every value above the threshold replaced by a ref."""
        threshold = self.threshold
        files: list[dict[str, Any]] = []
        compacted: dict[str, Any] = {}
        for key, value in data.items():
            compacted[key], _ = await self._walk(value, threshold, files)
        await self._fit(compacted, data, files)
        return compacted

    async def _walk(
        self, value: Any, threshold: int, files: list[dict[str, Any]]
    ) -> tuple[Any, int]:
        """The compacted value and the size that counts for its ancestors' decisions;
        inline files kept as they are go into ``files``."""
        if isinstance(value, str):
            encoded = orjson.dumps(value)
            if len(encoded) > threshold:
                return await self._offload(value, encoded), 0
            return value, len(encoded)
        if is_ref(value):
            return value, 0  # compacted already (a block's kept output): stays as it is
        if self._inline_files and is_file_value(value):
            return await self._walk_inline_file(value, files)
        if isinstance(value, list | dict):
            # Sized at once in C before any walk in Python: an event's data is walked on
            # the event loop, and a walk costs microseconds an element (5 million of
            # them held every tenant's requests for seconds; step 16's review, row 1),
            # and encoded in slices, so a large value does not hold it either.
            encoded = await encode(value)
            plain = not await contains(encoded, _REF_MARK) and not (
                self._inline_files and await contains(encoded, _FILE_MARK)
            )
            if plain and len(encoded) <= threshold:
                return value, len(encoded)  # what the walk would find: nothing to offload
            if plain and await _flat(encoded, self._pacer):
                return await self._offload(value, encoded), 0  # no part could go alone
        if isinstance(value, list):
            items = []
            size = 2 + max(len(value) - 1, 0)
            for item in value:
                await self._pacer.tick()
                new_item, item_size = await self._walk(item, threshold, files)
                items.append(new_item)
                size += item_size
            if size > threshold:
                return await self._offload(value, await encode(value)), 0
            return items, size
        if isinstance(value, dict):
            fields = {}
            size = 2 + max(len(value) - 1, 0)
            for key, item in value.items():
                await self._pacer.tick()
                new_item, item_size = await self._walk(item, threshold, files)
                fields[key] = new_item
                size += len(orjson.dumps(key)) + 1 + item_size
            if size > threshold:
                return await self._offload(value, await encode(value)), 0
            return fields, size
        return value, len(orjson.dumps(value))

    async def _walk_inline_file(
        self, value: dict[str, Any], files: list[dict[str, Any]]
    ) -> tuple[Any, int]:
        # Files kept inline on request are exempt from the pressure threshold, and so
        # count for nothing in their ancestors' decisions: only their own cap applies,
        # and past it just the content goes to the store.
        content = value["base64"]
        encoded = orjson.dumps(content)
        if len(encoded) > self._policy.inline_file_cap_bytes:
            content = await self._offload(content, encoded)
        kept = {**value, "base64": content}
        if isinstance(content, str):
            files.append(kept)
        return kept, 0

    async def _fit(
        self, compacted: dict[str, Any], data: dict[str, Any], files: list[dict[str, Any]]
    ) -> None:
        """Offload more of ``compacted``, in place, until it is within the ceiling.

        Each value is within its threshold, but several of them (inline files above
        all, which count for nothing in the walk) can still add up past half the
        budget. The largest inline files go first, as past their own cap; then the
        largest top-level values, stored as they came in ``data`` (a value in the store
        never holds refs). Offloading here is required by the budget, so a failure
        leaves a ref marked unavailable, never the value.
        """
        ceiling = self._policy.ceiling_bytes
        size = len(orjson.dumps(compacted))
        if size <= ceiling:
            return
        # Only what a ref makes smaller is a candidate: a short ``blockId`` stays itself
        # even when a tiny budget leaves the refs alone past the ceiling.
        for file in sorted(files, key=lambda kept: len(kept["base64"]), reverse=True):
            encoded = orjson.dumps(file["base64"])
            if not _shrinks(file["base64"], encoded, len(encoded)):
                continue
            file["base64"] = await self._offload(file["base64"], encoded, required=True)
            size += len(orjson.dumps(file["base64"])) - len(encoded)
            if size <= ceiling:
                return
        sizes = {key: len(orjson.dumps(value)) for key, value in compacted.items()}
        for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
            original = data[key]
            encoded = orjson.dumps(original)
            if is_ref(compacted[key]) or not _shrinks(original, encoded, sizes[key]):
                continue
            compacted[key] = await self._offload(original, encoded, required=True)
            size += len(orjson.dumps(compacted[key])) - sizes[key]
            if size <= ceiling:
                return

    async def _offload(self, value: Any, encoded: bytes, *, required: bool = False) -> Any:
        ref = _ref(value, encoded, await sha256_hex(encoded))
        if await self._put(ref["id"], encoded):
            return ref
        self.offload_failures += 1
        if self._metrics is not None:
            self._metrics.offload_failures.inc()
        if not required and len(encoded) <= self._policy.normal_bytes:
            # Offloading only for pressure failed: keep it inline at the normal threshold.
            return value
        log.error(
            "large value could not be stored; the event keeps a preview only",
            extra={"executionId": self._execution_id, "valueId": ref["id"], "size": len(encoded)},
        )
        return {**ref, "available": False}

    async def _put(self, value: str, encoded: bytes) -> bool:
        if value in self._stored:
            return True
        base = self._policy.retry_base_seconds
        backoff = Backoff(base=base, cap=base * 4**self._policy.attempts, factor=4)
        for attempt in range(1, self._policy.attempts + 1):
            try:
                await self._store.put(self._execution_id, value, encoded)
            except FlowcastError as exc:
                log.warning(
                    "value offload failed",
                    extra={
                        "executionId": self._execution_id,
                        "attempt": attempt,
                        "error": str(exc),
                    },
                )
                if attempt < self._policy.attempts:
                    await backoff.wait()
                continue
            self._stored.add(value)
            if self._metrics is not None:
                self._metrics.bytes_offloaded.inc(len(encoded))
            return True
        return False
