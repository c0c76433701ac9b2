"""The last events of the runs this process ended, kept to re-assert into a store that
forgot them.

A Redis restarted from an older snapshot (or a lagging replica promoted, or an empty
one) may have forgotten how a run here ended. Left alone, a janitor would end it a
second time under ids clients already saw. So each process keeps the last event of its
latest runs (and a pause's run state), and when another Redis server answers, stores
again those the store lacks under the run's own fence and epoch (append.lua lets a
newer epoch back in), the ids in between recorded as dropped.

A process that left takes its memory with it, so the last event is also recorded
outside Redis, in the value store beside the execution's values (``record_final``,
before the run is let go): a takeover of a store found behind reads it (takeovers.py)
and stores the run's end again, under its own id, instead of running it a second time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from lib.backend import translating
from lib.errors import BufferUnavailable, WriteRefused
from lib.execution.admission import Admission, paused_member
from lib.execution.buffer import EventBuffer
from lib.execution.ceiling import record_name
from lib.execution.events import EXECUTION_PAUSED, Event
from lib.execution.flush import batch_meta
from lib.execution.record import Field
from lib.execution.values import ValueStore
from lib.execution.watchlists import WatchLists
from lib.webhooks.outbox import hint
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

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow.to_json(),
            "input": self.input,
            "run": self.run.to_json(),
            "deadlineMs": self.deadline_ms,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SavedPause:
        return cls(
            Workflow.model_validate(raw["workflow"]),
            raw.get("input"),
            RunState.from_json(raw.get("run") or {}),
            raw.get("deadlineMs"),
        )


@dataclass(frozen=True)
class Final:
    """The last event a run here stored, kept for a while to re-assert it if the store
    comes back without it (restarted from an older snapshot, or empty)."""

    event: Event
    fence: str
    epoch: int
    identity: dict[str, str]
    pause: SavedPause | None = None

    def to_record(self) -> dict[str, Any]:
        """As the durable record stores it (``record_final``)."""
        return {
            "id": self.event.id,
            "final": {
                "type": self.event.type,
                "event": self.event.json.decode(),
                "fence": self.fence,
                "epoch": self.epoch,
                "identity": self.identity,
                "pause": self.pause.to_json() if self.pause is not None else None,
            },
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Final:
        final = record["final"]
        event = Event.stored(id=int(record["id"]), type=final["type"], raw=final["event"].encode())
        pause = SavedPause.from_json(final["pause"]) if final.get("pause") else None
        return cls(event, final["fence"], int(final["epoch"]), dict(final["identity"]), pause)


async def record_final(values: ValueStore, execution_id: str, final: Final) -> None:
    """Record the run's last event outside Redis (the value store), so a takeover after
    the store came back without it ends the run as it ended. ``ValueStoreError``."""
    name = record_name(final.fence, "final")
    await values.put_record(execution_id, name, orjson.dumps(final.to_record()))


class Finals:
    """The kept last events, newest last, and their re-assertion."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        watch: WatchLists,
        admission: Admission,
        states: RunStates,
        lease_seconds: float,
    ) -> None:
        self._buffer = buffer
        # How long a restored pause's deadline waits at least: an owner that resumed it
        # since (the store forgot that too) re-asserts its run within a lease.
        self._hold_ms = int(lease_seconds * 1000)
        self._watch = watch
        self._admission = admission
        self._states = states
        self._kept: OrderedDict[str, Final] = OrderedDict()

    @staticmethod
    def final_of(local: LocalRun, event: Event) -> Final:
        """The last event a run here stored, with what restoring it needs."""
        pause = local.saved_pause if event.type == EXECUTION_PAUSED else None
        return Final(event, local.fence, local.epoch, local.identity, pause)

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

    def forget(self, execution_id: str) -> None:
        """A run of ``execution_id`` starts here (its pause was resumed): what was kept
        of it is no longer its last event, and that run re-asserts itself."""
        self._kept.pop(execution_id, None)

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
            restored += await self.restore(execution_id, final, last_id)
        if restored:
            log.warning("restored the last events the store lost", extra={"count": restored})

    async def restore(self, execution_id: str, final: Final, last_id: int | None) -> bool:
        """Store ``final`` again (the store has the run up to ``last_id``; None: not at
        all), under the run's own fence and epoch; False when the store refused it
        (another owner holds the run)."""
        meta = {**final.identity, **batch_meta([final.event])}
        try:
            if final.pause is not None:
                tenant = final.identity[Field.TENANT]
                await self._restore_pause(execution_id, tenant, final.pause)
                # No resume or cancel for a lease (claim.lua HELD): the store may have
                # lost a resume of it, whose owner, if it lives, takes the run back.
                until_ms = await self._watch.now_ms() + self._hold_ms
                meta[Field.HELD] = f"{final.event.id} {until_ms}"
            if final.identity.get(Field.WEBHOOKS):
                # The store forgot the hint and the deliveries owed with the event: a
                # hint again, before it is stored again (as its writer left one).
                with translating("leave a webhook hint"):
                    await hint(
                        self._buffer.redis, self._buffer.prefix, execution_id, [final.event.id]
                    )
            await self._buffer.append(
                execution_id,
                [final.event],
                fence=final.fence,
                epoch=final.epoch,
                meta=meta,
                after_drop=True,
                reserve=final.event.id,
                recreate=True,
            )
        except WriteRefused as exc:
            log.warning(
                "could not restore a run's last event",
                extra={"executionId": execution_id, "reason": exc.reason},
            )
            return False
        if final.pause is None:
            # Ended: it no longer counts as paused for its tenant, should a pause of it
            # have been stored again first (by the process that paused it, when the
            # store came back empty) and counted; for 30 days (the fresh-eyes review
            # of e37bdfa: the tenant's cap one lower after each).
            tenant = final.identity[Field.TENANT]
            try:
                await self._admission.leave(tenant, paused_member(execution_id))
            except BufferUnavailable as exc:
                log.warning(
                    "a restored end still counts as paused for its tenant",
                    extra={"executionId": execution_id, "error": str(exc)},
                )
        if last_id is None:
            await self._buffer.index_again(execution_id, final.identity)
        return True

    async def _restore_pause(self, execution_id: str, tenant: str, pause: SavedPause) -> None:
        """Save a pause's run state and deadline again, before its event is restored."""
        version = await self._states.save_version(pause.workflow)
        fields = {"workflow": version, "input": pause.input}
        await self._states.save(execution_id, fields, deadline_ms=pause.deadline_ms)
        await self._states.save_checkpoint(execution_id, pause.run)
        # It counts for its tenant again, as a pause does.
        await self._admission.count_paused(tenant, execution_id, "")
        if pause.deadline_ms is not None:
            # Not expired sooner than a lease from now, even if its deadline passed: the
            # store that forgot the pause may have forgotten its resume too, and that
            # run's owner, if it lives, takes the execution back within a lease
            # (renew.lua) instead of seeing its ids reused by an expiry.
            await self._watch.watch_deadline(
                execution_id, pause.deadline_ms, not_within_ms=self._hold_ms
            )
