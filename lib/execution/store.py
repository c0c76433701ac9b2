"""Which Redis server answers, and the short settle after it changed (store.lua).

When another Redis server starts answering (a restart, a replica promoted), it may have
forgotten recent transitions: every process notices within ``check_seconds`` and
re-asserts what it holds at once, and no ownership moves until a short settle
(``settle_seconds``) has let them; a request that would move one waits it out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from lib.backend import register, translated
from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer

# After another Redis server starts answering, how long ownership waits for the owners
# to re-assert what it may have forgotten (store.lua). Every process looks at which
# server answers four times within it and re-asserts at once when it changed, so a
# short wait covers them; it is also what an approval deadline may be late by.
SETTLE_SECONDS = 1.0
# What a request that moves ownership (a resume, a cancel) waits of a settle, beyond
# the settle itself, before it answers 503 (the store keeps changing servers).
SETTLE_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class Store:
    """The Redis server that answers, and how long ownership must still wait."""

    identity: str
    settling_seconds: float


class StoreIdentity:
    """Asks which server answers, and waits out a settle, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float) -> None:
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.settle_seconds = min(SETTLE_SECONDS, 2 * lease_seconds)
        # How often each process asks which server answers (and looks at deadlines).
        self.check_seconds = self.settle_seconds / 4
        self._store = register(self.redis, __package__, "store.lua")

    @translated
    async def check(self) -> Store:
        """Which Redis server answers, and how long ownership must still wait after its
        data changed servers (store.lua)."""
        info: Any = await self.redis.info("server")
        nodes = [info] if "run_id" in info else list(info.values())
        identity = ",".join(sorted(str(node.get("run_id", "")) for node in nodes))
        settle_ms = int(self.settle_seconds * 1000)
        remaining = await self._store(keys=[self.keys.store], args=[identity, settle_ms])
        return Store(identity, int(remaining) / 1000)

    async def wait_settled(self) -> None:
        """Wait out the rest of a settle before moving ownership; BufferUnavailable only
        if it lasts past the settle and a grace (the store keeps changing servers).

        Data that now answers from another server (a restart, a replica promoted) may
        have forgotten recent transitions; until every process had a chance to
        re-assert what it knows (``settle_seconds``), a claim could hand out ids that
        clients already saw. The wait is short, so a request waits, not the client.
        """
        deadline = time.monotonic() + self.settle_seconds + SETTLE_GRACE_SECONDS
        while (remaining := (await self.check()).settling_seconds) > 0:
            if time.monotonic() + remaining > deadline:
                raise BufferUnavailable(
                    "the event store restarted just now and is still being checked; "
                    "try again in a second"
                )
            await asyncio.sleep(remaining)
