"""Checkpoints: what a run keeps of its blocks, in Redis with their events (SPEC §7).

Each event that moves a run forward carries the run state fields it changes, and
append.lua stores them in the execution's ``state`` hash in the same atomic write as
the event, so the checkpoint and the event log never disagree:

    field       set by              value
    ----------  ------------------  --------------------------------------------------
    o:<block>   block:completed     the block's output, as kept (below)
    s:<block>   block:skipped       1
    t:<block>   block:started       the attempt that started
    a:<block>   execution:resumed   the answer a human gave the block

A pause saves nothing else, and a recovery (another process taking over after the
owner died or handed off) or a resume reads the same fields back.

Outputs are *kept* as their events carry them: compacted by the run's compactor (large
values as refs into the value store, more eagerly once the ring is under pressure), in
the checkpoint and in the executor's memory alike. What the checkpoint holds inline
counts against the execution's byte budget (append.lua, ``RingModel.hold``), so Redis
holds the budget plus a small constant per block, whatever the outputs; a short run
never pays for offloading; and a run that produces a gibibyte holds refs, not the
gibibyte, loading a value again only when a template reads it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from lib.execution.events import Checkpoint
from lib.execution.offload import is_ref
from lib.execution.values import ValueStore

OUTPUT, SKIPPED, ATTEMPT, ANSWER = "o:", "s:", "t:", "a:"


def output_field(block_id: str, kept_json: bytes) -> Checkpoint:
    return ((OUTPUT + block_id, kept_json),)


def skipped_field(block_id: str) -> Checkpoint:
    return ((SKIPPED + block_id, b"1"),)


def attempt_field(block_id: str, attempt: int) -> Checkpoint:
    return ((ATTEMPT + block_id, b"%d" % attempt),)


def answer_field(block_id: str, kept_json: bytes) -> Checkpoint:
    return ((ANSWER + block_id, kept_json),)


def read_fields(
    fields: Mapping[str, Any],
) -> tuple[dict[str, Any], list[str], dict[str, int], dict[str, Any]]:
    """(outputs, skipped, attempts, answers) from a state hash's fields (JSON-decoded)."""
    outputs: dict[str, Any] = {}
    skipped: list[str] = []
    attempts: dict[str, int] = {}
    answers: dict[str, Any] = {}
    for name, value in fields.items():
        kind, block_id = name[:2], name[2:]
        if kind == OUTPUT:
            outputs[block_id] = value
        elif kind == SKIPPED:
            skipped.append(block_id)
        elif kind == ATTEMPT:
            attempts[block_id] = int(value)
        elif kind == ANSWER:
            answers[block_id] = value
    return outputs, skipped, attempts, answers


def write_fields(
    outputs: Mapping[str, Any],
    skipped: list[str],
    attempts: Mapping[str, int],
    answers: Mapping[str, Any],
) -> dict[str, bytes]:
    """The state hash fields of a checkpoint (to store it again, whole)."""
    fields = {OUTPUT + block_id: orjson.dumps(value) for block_id, value in outputs.items()}
    fields.update({SKIPPED + block_id: b"1" for block_id in skipped})
    fields.update({ATTEMPT + block_id: b"%d" % n for block_id, n in attempts.items()})
    fields.update({ANSWER + block_id: orjson.dumps(value) for block_id, value in answers.items()})
    return fields


class Keeper:
    """Keeps one run's outputs as their events carry them, and loads them back."""

    def __init__(
        self,
        *,
        execution_id: str,
        compact: Callable[[Any], Awaitable[tuple[Any, bytes]]] | None = None,
        store: ValueStore | None = None,
    ) -> None:
        self._execution_id = execution_id
        self._compact = compact  # the execution log's keep
        self._store = store

    async def keep(self, value: Any) -> tuple[Any, bytes]:
        """``value`` as the run keeps it (as its event will carry it), and that form's
        JSON for the checkpoint."""
        if self._compact is None:
            return value, orjson.dumps(value)
        return await self._compact(value)

    async def load(self, value: Any, *, count: Callable[[int], None] | None = None) -> Any:
        """``value`` with the refs in it replaced by what they stand for. FlowcastError
        when the store cannot give one back (unreachable, or the value is gone).
        ``count`` is told each ref's size before it is read (it may refuse by raising)."""
        if is_ref(value):
            if self._store is None or value.get("available") is False:
                return value
            if count is not None:
                count(int(value.get("size") or 0))
            ident = str(value.get("id"))
            chunks = [chunk async for chunk in self._store.read(self._execution_id, ident)]
            return orjson.loads(b"".join(chunks))
        if isinstance(value, dict):
            return {key: await self.load(item, count=count) for key, item in value.items()}
        if isinstance(value, list):
            return [await self.load(item, count=count) for item in value]
        return value


def holds_refs(encoded: bytes) -> bool:
    """True when a kept value's JSON has a ref in it (it must be loaded to be read)."""
    return REF_MARK in encoded


REF_MARK = b'"$ref":"value"'
