"""The janitor: ends the executions that nobody else will end.

Every process runs one. It ends an execution whose owner stopped renewing its lease
with ``execution:failed`` (``worker_lost``, or ``execution:cancelled`` if a cancel was
asked for), and a pause whose approval deadline passed with ``execution:failed``
(``approval_timeout``). Each ending starts with a fenced claim, so of all the janitors
exactly one writes it, and the old owner can never append after it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from lib.errors import Conflict, FlowcastError, NotFound
from lib.execution.buffer import EventBuffer, ExecutionMeta
from lib.execution.control import Control
from lib.execution.emitter import Emitter
from lib.execution.events import EXECUTION_CANCELLED, EXECUTION_FAILED

log = logging.getLogger(__name__)

# Emits the terminal event of an execution that was just claimed.
Ending = Callable[[Emitter], None]
# Writes an ending for (execution id, its metadata, the new fence, the last stored id).
Finish = Callable[[str, ExecutionMeta, str, int, Ending], None]


def cancelled(emitter: Emitter) -> None:
    emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})


def worker_lost(emitter: Emitter) -> None:
    error = {"code": "worker_lost", "message": "the process running the execution stopped"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


def approval_timeout(emitter: Emitter) -> None:
    error = {"code": "approval_timeout", "message": "nobody answered the approval in time"}
    emitter.emit(EXECUTION_FAILED, {"error": error})


class Janitor:
    """Watches the expired leases and the due approval deadlines."""

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        control: Control,
        lease_seconds: float,
        is_local: Callable[[str], bool],
        new_fence: Callable[[], str],
        finish: Finish,
    ) -> None:
        self._buffer = buffer
        self._control = control
        self._lease_seconds = lease_seconds
        self._is_local = is_local
        self._new_fence = new_fence
        self._finish = finish

    async def run(self) -> None:
        """Sweep every half lease (jittered) until cancelled."""
        healthy_since = time.monotonic()
        while True:
            await asyncio.sleep(self._lease_seconds / 2 * random.uniform(0.8, 1.2))
            try:
                await self.sweep(healthy_since)
            except FlowcastError as exc:
                # After an outage every owner needs a full lease to renew before anyone
                # may call its lease expired.
                healthy_since = time.monotonic()
                log.warning("janitor pass failed", extra={"error": str(exc)})

    async def sweep(self, healthy_since: float) -> None:
        if time.monotonic() - healthy_since >= self._lease_seconds:
            for execution_id in await self._control.due(self._control.leases_key):
                if not self._is_local(execution_id):
                    await self._claim_and_end(execution_id, "takeover")
        for execution_id in await self._control.due(self._control.deadlines_key):
            await self._claim_and_end(execution_id, "expire")

    async def _claim_and_end(self, execution_id: str, mode: str) -> None:
        key = self._control.leases_key if mode == "takeover" else self._control.deadlines_key
        fence = self._new_fence()
        try:
            claim = await self._control.claim(execution_id, mode, fence)
        except NotFound:
            await self._control.forget(key, execution_id)
            return
        except Conflict as exc:
            if exc.code not in ("lease", "notdue"):
                await self._control.forget(key, execution_id)  # finished or moved on
            return
        await self._control.forget(self._control.deadlines_key, execution_id)
        meta = await self._buffer.meta(execution_id)
        if mode == "expire":
            ending = approval_timeout
        elif meta.cancel_requested:
            ending = cancelled
        else:
            ending = worker_lost
        log.warning("ending an execution", extra={"executionId": execution_id, "mode": mode})
        await self._control.hold(execution_id)
        self._finish(execution_id, meta, fence, claim.last_id, ending)
