"""The last events of the runs this process ended, kept to re-assert into a store that
forgot them.

A Redis restarted from an older snapshot (or a lagging replica promoted, or an empty
one) may have forgotten how a run here ended. Left alone, a janitor would end it a
second time under ids clients already saw. So each process keeps the last event of its
latest runs (and a pause's run state), and when another Redis server answers, stores
again those the store lacks under the run's own fence and epoch (append.lua lets a
newer epoch back in), the ids in between recorded as dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from lib.errors import WriteRefused
from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.events import EXECUTION_PAUSED, Event
from lib.execution.flush import batch_meta
from lib.execution.record import Field
from lib.execution.watchlists import WatchLists
from lib.workflows.executor import RunState
from lib.workflows.leases import LocalRun
from lib.workflows.model import Workflow
from lib.workflows.runstate import RunStates

log = logging.getLogger(__name__)


# Finals remembered, newest last; larger events are not kept (their memory would add up).
MAX_FINALS = 4_096
MAX_FINAL_BYTES = 16 * 1024


@dataclass(frozen=True)
class SavedPause:
    """What a pause saved: enough to save it again into a store that lost it."""

    workflow: Workflow
    input: Any
    run: RunState  # its checkpoint, outputs as kept (large ones are refs)
    deadline_ms: int | None

    def size(self) -> int:
        return len(orjson.dumps([self.input, self.run.to_json()]))


@dataclass(frozen=True)
class Final:
    """The last event a run here stored, kept for a while to re-assert it if the store
    comes back without it (restarted from an older snapshot, or empty)."""

    event: Event
    fence: str
    epoch: int
    identity: dict[str, str]
    pause: SavedPause | None = None


class Finals:
    """The kept last events, newest last, and their re-assertion."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        watch: WatchLists,
        admission: Admission,
        states: RunStates,
    ) -> None:
        self._buffer = buffer
        self._watch = watch
        self._admission = admission
        self._states = states
        self._kept: OrderedDict[str, Final] = OrderedDict()

    def remember(self, local: LocalRun, event: Event) -> None:
        """Keep the last event a run here stored (with its pause's state)."""
        self._kept.pop(local.execution_id, None)
        pause = local.saved_pause if event.type == EXECUTION_PAUSED else None
        if len(event.json) > MAX_FINAL_BYTES or (
            event.type == EXECUTION_PAUSED and (pause is None or pause.size() > MAX_FINAL_BYTES)
        ):
            # Too large to keep in memory; a pause restored without its state would be
            # worse than none (nobody could resume it), so it is not kept either.
            return
        self._kept[local.execution_id] = Final(
            event, local.fence, local.epoch, local.identity, pause
        )
        while len(self._kept) > MAX_FINALS:
            self._kept.popitem(last=False)

    async def reassert(self) -> None:
        """Another Redis server answers: store again the kept events it lacks."""
        finals = list(self._kept.items())
        if not finals:
            return
        stored = await self._buffer.last_ids([execution_id for execution_id, _ in finals])
        restored = 0
        for (execution_id, final), last_id in zip(finals, stored, strict=True):
            if last_id is not None and last_id >= final.event.id:
                continue
            try:
                if final.pause is not None:
                    tenant = final.identity[Field.TENANT]
                    await self._restore_pause(execution_id, tenant, final.pause)
                await self._buffer.append(
                    execution_id,
                    [final.event],
                    fence=final.fence,
                    epoch=final.epoch,
                    meta={**final.identity, **batch_meta([final.event])},
                    after_drop=True,
                    reserve=final.event.id,
                    recreate=True,
                )
            except WriteRefused as exc:
                log.warning(
                    "could not restore a run's last event",
                    extra={"executionId": execution_id, "reason": exc.reason},
                )
                continue
            if last_id is None:
                await self._buffer.index_again(execution_id, final.identity[Field.TENANT])
            restored += 1
        if restored:
            log.warning("restored the last events the store lost", extra={"count": restored})

    async def _restore_pause(self, execution_id: str, tenant: str, pause: SavedPause) -> None:
        """Save a pause's run state and deadline again, before its event is restored."""
        version = await self._states.save_version(pause.workflow)
        fields = {"workflow": version, "input": pause.input}
        await self._states.save(execution_id, fields, deadline_ms=pause.deadline_ms)
        await self._states.save_checkpoint(execution_id, pause.run)
        # It counts for its tenant again, as a pause does.
        await self._admission.count_paused(tenant, execution_id, "")
        if pause.deadline_ms is not None:
            await self._watch.watch_deadline(execution_id, pause.deadline_ms)
