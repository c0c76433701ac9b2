"""The durable ceiling: ids an owner may show live, recorded outside Redis.

Redis reserves the ids an owner shows before they are stored (flush.py), so a process
that takes over numbers above them. A Redis restored from an older snapshot (or a
lagging replica promoted) forgets those reservations; when the owner is still alive it
re-asserts them, but an owner that died or stalled across the restore cannot, and its
clients saw ids the store no longer knows. So each owner also records, in the value
store beside the execution's values (swept with them), a ceiling above every id it may
show: ``rec_<fence digest>``, JSON ``{"ceiling", "base", "epoch"}``, one object per
owner, only ever raised by it. It is raised in blocks of ``BLOCK_IDS`` ahead of use (one
value-store write per block, in the background), and the writer shows an unstored event
live only under it. A takeover of a store found behind (takeovers.py) numbers above the
highest ceiling of every owner of the execution (claim.lua's "base at least"): the ids
in between are reported as a ``dropped`` gap, at most about a block. So does a resume,
a cancel or an expiry (every claim asks ``Takeovers.recall`` first), and a claim of a run
whose final record says it ended stores that end again instead.

The ids an owner's claim (or start) reserved in Redis need no ceiling: every snapshot
that holds the claim holds them, and one that does not names no event of this owner.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from lib.backoff import Backoff
from lib.execution.values import RECORD_PREFIX, ValueStore, ValueStoreError
from lib.tasks import stop

log = logging.getLogger(__name__)

# How far ahead of the ids in use the ceiling is raised, and so the largest gap a
# takeover after a restore reports for ids nobody saw.
BLOCK_IDS = 4_096


def record_name(fence: str, kind: str = "ceiling") -> str:
    """The value store name of one owner's record of one kind (``ceiling``, or
    ``final``: finals.py), a digest (fences hold ``:``)."""
    return RECORD_PREFIX + hashlib.sha256(f"{kind} {fence}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Durable:
    """What the owners of one execution recorded outside Redis."""

    ceiling: int = 0  # the highest ceiling: no owner showed an id above it
    base: int = 0  # the highest base an owner started from (a later owner's claim)
    final: dict[str, Any] | None = None  # the final record with the highest event id


async def read_durable(values: ValueStore, execution_id: str) -> Durable:
    """The records every owner of the execution wrote; ``ValueStoreError`` when the
    value store cannot say."""
    ceiling = base = 0
    final: dict[str, Any] | None = None
    for data in await values.records(execution_id):
        try:
            record = orjson.loads(data)
            ceiling = max(ceiling, int(record.get("ceiling", 0)))
            base = max(base, int(record.get("base", 0)))
            if "final" in record and (final is None or record["id"] > final["id"]):
                final = record
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            log.warning("an unreadable durable record", extra={"executionId": execution_id})
    return Durable(ceiling, base, final)


class Ceiling:
    """One owner's durable ceiling: ``value`` is the highest id it may show before it
    is stored. ``want`` an id and the ceiling is raised in the background when the id
    comes within half a block of it; ``on_raised`` is called after each raise."""

    def __init__(
        self,
        *,
        values: ValueStore,
        execution_id: str,
        fence: str,
        epoch: int,
        base: int,
        block: int = BLOCK_IDS,
    ) -> None:
        self._values = values
        self._execution_id = execution_id
        self._name = record_name(fence)
        self._epoch = epoch
        self._base = base
        self._block = block
        # Reserved in Redis by the claim itself: shown without a record.
        self.value = base
        self._wanted = base
        self._task: asyncio.Task[None] | None = None
        self.on_raised: Callable[[], None] | None = None

    def want(self, event_id: int) -> None:
        """An id about to be shown: raise the ceiling ahead of it if it comes near."""
        self._wanted = max(self._wanted, event_id)
        if not self._due():
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._raise(), name=f"ceiling:{self._execution_id}")

    def _due(self) -> bool:
        if self.value == self._base:
            # Only past what the claim reserved: a start's first event (its first
            # frame) shares the moment with no value-store write.
            return self._wanted > self.value
        return self._wanted > self.value - self._block // 2

    async def _raise(self) -> None:
        backoff = Backoff(base=0.05, cap=2.0)
        while self._due():
            target = self._wanted + self._block
            record = {"ceiling": target, "base": self._base, "epoch": self._epoch}
            try:
                await self._values.put_record(self._execution_id, self._name, orjson.dumps(record))
            except ValueStoreError as exc:
                # Unshown meanwhile, the events are shown once stored, as ever.
                log.warning(
                    "could not raise the durable id ceiling; will retry",
                    extra={"executionId": self._execution_id, "error": str(exc)},
                )
                await backoff.wait()
                continue
            backoff.reset()
            self.value = target
            if self.on_raised is not None:
                self.on_raised()

    async def close(self) -> None:
        """Stop raising it (the run let go)."""
        if self._task is not None:
            await stop(self._task)
            self._task = None
