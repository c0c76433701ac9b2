"""Compaction: which values become refs, their previews, pressure, inline files, failures."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from lib.execution.offload import Compactor, OffloadPolicy, RingModel
from lib.execution.values import LocalValueStore, ValueStoreError

POLICY = OffloadPolicy(
    large_value_bytes=1_000,
    budget_bytes=100_000,
    event_limit=1_000,
    inline_file_bytes=5_000,
    retry_base_seconds=0.001,
)


class FailingStore(LocalValueStore):
    """A local store whose puts fail while ``failing`` is set (a seam for faults)."""

    def __init__(self, *, root: Path) -> None:
        super().__init__(root=root)
        self.failing = True
        self.attempts = 0

    async def put(self, execution_id: str, value: str, data: bytes) -> None:
        self.attempts += 1
        if self.failing:
            raise ValueStoreError("injected failure")
        await super().put(execution_id, value, data)


@pytest.fixture
def store(tmp_path: Path) -> LocalValueStore:
    return LocalValueStore(root=tmp_path)


def compactor(store: LocalValueStore, **options: Any) -> Compactor:
    return Compactor(store=store, execution_id="ex_test", policy=POLICY, **options)


async def stored(store: LocalValueStore, ref: dict[str, Any]) -> Any:
    chunks: AsyncIterator[bytes] = store.read("ex_test", ref["id"])
    return orjson.loads(b"".join([chunk async for chunk in chunks]))


async def test_small_values_are_left_alone(store: LocalValueStore) -> None:
    data = {"blockId": "a", "output": {"text": "x" * 500, "n": [1, 2, 3]}}
    assert await compactor(store).compact(data) == data
    assert await store.executions() == []


async def test_a_large_string_becomes_a_ref_with_a_256_character_preview(
    store: LocalValueStore,
) -> None:
    text = "".join(chr(65 + i % 26) for i in range(5_000))
    data = await compactor(store).compact({"blockId": "a", "output": {"text": text}})
    ref = data["output"]["text"]
    encoded = orjson.dumps(text)
    assert ref == {
        "$ref": "value",
        "id": "lv_" + hashlib.sha256(encoded).hexdigest(),
        "kind": "string",
        "size": len(encoded),
        "preview": text[:256],
        "sha256": hashlib.sha256(encoded).hexdigest(),
    }
    assert data["blockId"] == "a"
    assert await stored(store, ref) == text


async def test_arrays_and_objects_preview_their_length_and_first_20_keys(
    store: LocalValueStore,
) -> None:
    array = list(range(1_000))
    obj = {f"key{i:03d}": i for i in range(200)}
    data = await compactor(store).compact({"a": array, "o": obj})
    assert data["a"]["kind"] == "array" and data["a"]["preview"] == 1_000
    assert data["o"]["kind"] == "object" and data["o"]["preview"] == list(obj)[:20]
    assert await stored(store, data["a"]) == array
    assert await stored(store, data["o"]) == obj


async def test_nested_values_are_compacted_bottom_up(store: LocalValueStore) -> None:
    big = "y" * 2_000
    data = await compactor(store).compact({"output": {"small": 1, "inner": {"big": big}}})
    # Only the large leaf goes; its ancestors are small once it is a ref.
    assert data["output"]["small"] == 1
    assert data["output"]["inner"]["big"]["kind"] == "string"


async def test_the_threshold_tightens_once_the_ring_is_past_half_its_budget(
    store: LocalValueStore,
) -> None:
    compact = compactor(store)
    medium = "m" * 400  # above budget / limit = 100 bytes, below the normal 1,000
    assert (await compact.compact({"v": medium}))["v"] == medium
    for _ in range(60):
        compact.stored(1_000)  # 60 KB retained: past half of the 100 KB budget
    assert compact.threshold == 100
    assert (await compact.compact({"v": medium}))["v"]["$ref"] == "value"


def test_the_ring_model_evicts_like_the_ring() -> None:
    ring = RingModel(budget_bytes=1_000, event_limit=5)
    for _ in range(10):
        ring.add(100)
    assert ring.retained_bytes == 500  # the event limit binds
    ring.add(900)
    assert ring.retained_bytes == 1_000  # the budget binds, the newest is kept
    ring.add(5_000)
    assert ring.retained_bytes == 5_000  # a single oversized event is still kept


async def test_inline_files_are_exempt_from_pressure_up_to_their_own_cap(
    store: LocalValueStore,
) -> None:
    small_file = {
        "name": "a.bin",
        "mimeType": "x/y",
        "size": 2_400,
        "base64": base64.b64encode(b"a" * 2_400).decode(),
    }
    large_file = {**small_file, "size": 6_000, "base64": base64.b64encode(b"b" * 6_000).decode()}
    compact = compactor(store, inline_files=True)
    for _ in range(60):
        compact.stored(1_000)
    data = await compact.compact({"output": {"small": small_file, "large": large_file}})
    assert data["output"]["small"] == small_file
    assert data["output"]["large"]["name"] == "a.bin"
    assert data["output"]["large"]["base64"]["$ref"] == "value"
    # Without the request, the same file content is offloaded like any value.
    plain = await compactor(store).compact({"output": small_file})
    assert plain["output"]["base64"]["$ref"] == "value"


async def test_a_failed_offload_under_pressure_keeps_the_value_inline(tmp_path: Path) -> None:
    failing = FailingStore(root=tmp_path)
    compact = Compactor(store=failing, execution_id="ex_test", policy=POLICY)
    for _ in range(60):
        compact.stored(1_000)
    medium = "m" * 400
    assert (await compact.compact({"v": medium}))["v"] == medium
    assert failing.attempts == POLICY.attempts
    assert compact.offload_failures == 1


async def test_a_value_above_the_normal_threshold_that_cannot_be_stored_is_marked_unavailable(
    tmp_path: Path,
) -> None:
    failing = FailingStore(root=tmp_path)
    compact = Compactor(store=failing, execution_id="ex_test", policy=POLICY)
    data = await compact.compact({"v": "z" * 5_000})
    assert data["v"]["available"] is False
    assert data["v"]["preview"] == "z" * 256
    failing.failing = False
    again = await compact.compact({"v": "z" * 5_000})
    assert "available" not in again["v"]
    assert again["v"]["id"] == data["v"]["id"]


async def test_the_same_value_is_stored_once_per_execution(tmp_path: Path) -> None:
    counting = FailingStore(root=tmp_path)
    counting.failing = False
    compact = Compactor(store=counting, execution_id="ex_test", policy=POLICY)
    first = await compact.compact({"output": "q" * 3_000})
    second = await compact.compact({"output": {"a": "q" * 3_000}})
    assert first["output"]["id"] == second["output"]["a"]["id"]
    assert counting.attempts == 1
