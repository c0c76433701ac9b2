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

Outputs are *kept*, in the checkpoint and in the executor's memory alike: inline while
the run's inline outputs add up to at most an allowance (an eighth of the event budget:
a short run never pays for offloading), else as one ref into the value store (the
same ref its event carries, when the event offloaded it too). So a run that produces a
gibibyte of output holds refs, not the gibibyte, Redis holds at most the allowance
beside the ring, and a value is loaded again only when a template reads it or it is
part of the final output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from lib.execution.events import Checkpoint
from lib.execution.offload import Compactor, is_ref
from lib.execution.values import ValueStore

# Values this small always stay inline: a ref would not be smaller.
SMALL_BYTES = 1024

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
    """Keeps one run's outputs small (refs into the value store) and loads them back."""

    def __init__(
        self,
        *,
        execution_id: str,
        compactor: Compactor | None = None,
        store: ValueStore | None = None,
        inline_allowance: int | None = None,
        final_inline_bytes: int | None = None,
    ) -> None:
        self._execution_id = execution_id
        self._compactor = compactor
        self._store = store
        # Bytes of inline values the run may keep in all (None: no limit).
        self._allowance = inline_allowance
        self._inline = 0
        # Refs above this stay refs in the final output: its event would carry them so.
        self.final_inline_bytes = final_inline_bytes

    async def keep(self, value: Any) -> tuple[Any, bytes | None]:
        """``value`` as the run keeps it, and that form's JSON for the checkpoint.

        The JSON is None when a large value could not be stored: the run then keeps
        the value itself, and the checkpoint goes without it (a recovery runs the
        block again).
        """
        encoded = orjson.dumps(value)
        size = len(encoded)
        if (
            size <= SMALL_BYTES
            or self._compactor is None
            or self._allowance is None
            or self._inline + size <= self._allowance
        ):
            self._inline += size
            return value, encoded
        ref = await self._compactor.ref_for(value, encoded)
        if ref is None:
            return value, None
        return ref, orjson.dumps(ref)

    async def load(self, value: Any, *, up_to: int | None = None) -> Any:
        """``value`` with the refs in it replaced by what they stand for (those of at
        most ``up_to`` bytes, if given). FlowcastError when the store cannot give one
        back (unreachable, or the value is gone)."""
        if is_ref(value):
            size = value.get("size")
            if self._store is None or (up_to is not None and (size or 0) > up_to):
                return value
            if value.get("available") is False:
                return value
            ident = str(value.get("id"))
            chunks = [chunk async for chunk in self._store.read(self._execution_id, ident)]
            return orjson.loads(b"".join(chunks))
        if isinstance(value, dict):
            return {key: await self.load(item, up_to=up_to) for key, item in value.items()}
        if isinstance(value, list):
            return [await self.load(item, up_to=up_to) for item in value]
        return value
