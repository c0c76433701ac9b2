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


async def test_a_large_container_is_sized_at_once_and_decided_as_a_walk_would(
    store: LocalValueStore,
) -> None:
    """Step 16's review (row 1): an input of 5 million zeros was walked an element at a
    time on the event loop (seconds for every tenant). A container is now sized in C
    first: kept whole when within the threshold, offloaded whole when it is a flat list
    (no part could go alone), and walked only when a part may be a ref, a file or too
    large on its own; the outcome is what the walk gave."""
    zeros = [0] * 300_000
    refs_inside = {"kept": {"$ref": "value", "id": "lv_" + "0" * 64}, "n": [1, 2]}
    mixed = [1.5, None, True, "y" * 2_000]
    data = await compactor(store).compact({"z": zeros, "r": refs_inside, "m": mixed})
    assert data["z"]["kind"] == "array" and data["z"]["preview"] == 300_000
    assert await stored(store, data["z"]) == zeros
    assert data["r"] == refs_inside  # a ref already made stays as it is
    assert data["m"][:3] == [1.5, None, True] and data["m"][3]["kind"] == "string"
    small = {"list": list(range(50)), "nested": {"deep": [[1], [2, [3]]]}}
    assert await compactor(store).compact({"s": small}) == {"s": small}


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


@pytest.mark.parametrize(
    "policy",
    [
        OffloadPolicy(budget_bytes=1024 * 1024),  # the default 8 MiB threshold and file cap
        OffloadPolicy(budget_bytes=1024 * 1024, event_limit=1),
        OffloadPolicy(large_value_bytes=64, budget_bytes=1024, inline_file_bytes=0),
        OffloadPolicy(),
    ],
)
def test_no_threshold_or_cap_is_above_half_the_budget(
    store: LocalValueStore, policy: OffloadPolicy
) -> None:
    half = policy.budget_bytes // 2
    assert policy.pressure_bytes <= policy.normal_bytes <= half
    assert policy.inline_file_cap_bytes <= half
    compact = Compactor(store=store, execution_id="ex_test", policy=policy)
    # ``fits`` says "nothing to offload" only for envelopes that ``compact`` would keep.
    assert compact.threshold <= half and not compact.fits(half + 1)
    for _ in range(policy.event_limit + 1):
        compact.stored(half // policy.event_limit + 1)
    assert compact.ring.under_pressure
    assert compact.threshold <= half and not compact.fits(half + 1)


HALF_KB = OffloadPolicy(large_value_bytes=8 * 1024 * 1024, budget_bytes=10_000)


async def test_a_value_past_half_the_budget_is_offloaded_whatever_the_threshold(
    store: LocalValueStore,
) -> None:
    compact = Compactor(store=store, execution_id="ex_test", policy=HALF_KB)
    data = await compact.compact({"blockId": "a", "output": "x" * 6_000})
    assert data["output"]["$ref"] == "value" and data["output"]["size"] == 6_002
    assert await stored(store, data["output"]) == "x" * 6_000


async def test_values_that_together_pass_half_the_budget_go_largest_first(
    store: LocalValueStore,
) -> None:
    compact = Compactor(store=store, execution_id="ex_test", policy=HALF_KB)
    original = {"blockId": "a", "small": "s" * 3_000, "large": {"text": "l" * 4_000}}
    data = await compact.compact(original)
    assert len(orjson.dumps(data)) <= HALF_KB.ceiling_bytes
    assert data["blockId"] == "a" and data["small"] == "s" * 3_000
    assert data["large"]["$ref"] == "value" and data["large"]["kind"] == "object"
    assert await stored(store, data["large"]) == original["large"]


def file_value(name: str, size: int) -> dict[str, Any]:
    content = base64.b64encode((bytes(range(256)) * (size // 256 + 1))[:size]).decode()
    return {"name": name, "mimeType": "x/y", "size": size, "base64": content}


async def test_inline_files_are_not_exempt_from_half_the_budget(
    store: LocalValueStore,
) -> None:
    policy = OffloadPolicy(budget_bytes=10_000, inline_file_bytes=8 * 1024 * 1024)
    compact = Compactor(store=store, execution_id="ex_test", policy=policy, inline_files=True)
    # One file past half the budget: its content goes, though it is within its own cap.
    alone = await compact.compact({"output": file_value("big", 4_500)})
    assert alone["output"]["base64"]["$ref"] == "value"
    # Two files within half the budget each, past it together: the larger one goes.
    left, right = file_value("left", 3_000), file_value("right", 2_000)
    data = await compact.compact({"output": {"left": left, "right": right}})
    assert len(orjson.dumps(data)) <= policy.ceiling_bytes
    assert data["output"]["right"] == right
    assert data["output"]["left"]["name"] == "left"
    assert await stored(store, data["output"]["left"]["base64"]) == left["base64"]


async def test_a_tiny_budget_never_turns_short_fields_into_refs(store: LocalValueStore) -> None:
    policy = OffloadPolicy(budget_bytes=1024)
    compact = Compactor(store=store, execution_id="ex_test", policy=policy)
    data = await compact.compact({"blockId": "b", "output": "x" * 500, "other": "y" * 500})
    # Both texts become refs (each smaller than its text); the refs alone still pass the
    # ceiling, but a ref for "b" would only be larger.
    assert data["blockId"] == "b"
    assert data["output"]["$ref"] == "value" and data["other"]["$ref"] == "value"


async def test_a_value_past_half_the_budget_that_cannot_be_stored_is_marked_unavailable(
    tmp_path: Path,
) -> None:
    failing = FailingStore(root=tmp_path)
    policy = OffloadPolicy(budget_bytes=10_000, retry_base_seconds=0.001)
    compact = Compactor(store=failing, execution_id="ex_test", policy=policy)
    # Below the configured 8 MiB threshold, but keeping both would break the budget.
    data = await compact.compact({"a": "a" * 3_000, "b": "b" * 3_000})
    assert len(orjson.dumps(data)) <= policy.ceiling_bytes
    refs = {key: value for key, value in data.items() if isinstance(value, dict)}
    assert len(refs) == 1, data
    ((key, ref),) = refs.items()
    assert ref["available"] is False and ref["preview"] == key * 256
    assert failing.attempts == policy.attempts
