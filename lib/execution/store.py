"""Which Redis server answers, and the short settle after it changed (store.lua).

When another Redis server starts answering (a restart, a replica promoted), it may have
forgotten recent transitions: every process notices within ``check_seconds`` and
re-asserts what it holds at once, and no ownership moves until a short settle
(``settle_seconds``) has let them; a request that would move one waits it out.

Whether it did forget is known too: each answer carries a mark (the store's time of its
latest call), and each process remembers the highest it was given. A store whose mark
is below one a process remembers lost writes that process saw acknowledged (an older
snapshot, a lagging replica promoted); for about a lease after that is found
(``Store.behind_seconds``), the approval deadlines it held then do not expire
(janitor.py), so an owner stalled across the settle still has a fair chance to
re-assert a pause it resumed. A restart that lost nothing keeps its mark, and deadlines
fire at once after it. For ``RESTORED_LEASES`` leases after a process last saw the store
behind, its takeovers number above the durable ceiling (ceiling.py): an owner dead or
stalled across the restore could not re-assert the ids it showed. And however long
after, an execution no owner wrote since the store was last found behind (``predates``)
is as the store brought it back: the claim that moves it first asks what its owners
recorded outside the store (takeovers.py ``recall``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

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
# How long after a store was last seen behind a takeover trusts its reservations no more
# (takeovers.py): a dead owner's lease expires and is taken over within a few leases
# of the restore (the settle, a lease of trust, a sweep), with room for a busy machine.
RESTORED_LEASES = 10


@dataclass(frozen=True)
class Store:
    """The Redis server that answers, and how long ownership must still wait."""

    identity: str
    settling_seconds: float
    # How long the approval deadlines a store found behind held must still wait: it was
    # found so (it lost writes a process saw acknowledged) less than about a lease ago.
    behind_seconds: float = 0.0
    # When (ms, Redis's clock) the store was last found behind; 0: never.
    restored_ms: int = 0


class StoreIdentity:
    """Asks which server answers, and waits out a settle, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float) -> None:
        self.redis = buffer.redis
        self.keys = buffer.keys
        self.settle_seconds = min(SETTLE_SECONDS, 2 * lease_seconds)
        # How long the deadlines a store found behind held wait: a lease, the time an
        # owner has to renew (and so re-assert) before anyone may call it gone.
        self.behind_seconds = lease_seconds
        # The highest mark the store gave this process (store.lua): a store that comes
        # back with a lower one lost writes this process saw acknowledged.
        self._mark = 0
        # When (monotonic) this process last saw the store behind; None: never.
        self._behind_seen: float | None = None
        # When (ms, Redis's clock) any process last found the store behind (store.lua).
        self._restored_ms = 0
        self.restored_seconds = RESTORED_LEASES * lease_seconds
        # How often each process asks which server answers (and looks at deadlines).
        self.check_seconds = self.settle_seconds / 4
        self._store = register(self.redis, __package__, "store.lua")

    @translated
    async def check(self) -> Store:
        """Which Redis server answers, how long ownership must still wait after its
        data changed servers, and how long deadlines must wait after it was found
        behind (store.lua)."""
        identity, nodes = await self._identities()
        settle_ms = int(self.settle_seconds * 1000)
        behind_ms = int(self.behind_seconds * 1000)
        settle, behind, mark, restored = await self._store(
            keys=[self.keys.store], args=[identity, settle_ms, self._mark, behind_ms, nodes]
        )
        self._mark = max(self._mark, int(mark))
        self._restored_ms = int(restored)
        if int(behind) > 0:
            self._behind_seen = time.monotonic()
        # On a cluster every primary's run id, and not the default node's: the client
        # picks its default again each time it reads the slots (after a CLUSTERDOWN),
        # and that is no other server answering.
        return Store(nodes or identity, int(settle) / 1000, int(behind) / 1000, int(restored))

    async def _identities(self) -> tuple[str, str]:
        """The run id of the server that answers (on a cluster, the client's default
        node, as processes of earlier versions read it: a rolling deploy must not see
        it change back and forth), and on a cluster the run ids of every primary, so
        that a restart of any node is noticed ("" on a single server). On a cluster the
        primaries decide (store.lua): processes whose clients chose other default
        nodes send other run ids for the same servers."""
        if not isinstance(self.redis, RedisCluster):
            info: Any = await self.redis.info("server")
            return str(info.get("run_id", "")), ""
        default = self.redis.get_default_node()
        every: Any = await self.redis.info("server", target_nodes=RedisCluster.PRIMARIES)
        ids = {name: str(node.get("run_id", "")) for name, node in every.items()}
        identity = ids.get(default.name, "") if default is not None else ""
        return identity, ",".join(sorted(ids.values()))

    def came_back_behind(self) -> bool:
        """True while the store was seen behind less than ``restored_seconds`` ago: the
        reservations it holds may be below ids an owner that is gone showed."""
        seen = self._behind_seen
        return seen is not None and time.monotonic() - seen < self.restored_seconds

    def predates(self, written_ms: int) -> bool:
        """True for an execution last written (``writtenAt``, append.lua) before the
        store was last found behind: no owner wrote it since, so it is as the store
        brought it back, and may have ended since in a way the store forgot (a
        completed run back paused, however long ago that restore was)."""
        return written_ms < self._restored_ms

    def still_behind(self) -> None:
        """Keep ``came_back_behind`` true for another ``restored_seconds``: a takeover
        could not learn what the owners recorded outside the store (the value store did
        not answer), and the window must not run out before one does, or that takeover
        would number from the store's reservations after all."""
        self._behind_seen = time.monotonic()

    async def wait_settled(self) -> Store:
        """Wait out the rest of a settle before moving ownership (the store as it
        answers then); BufferUnavailable only if it lasts past the settle and a grace
        (the store keeps changing servers).

        Data that now answers from another server (a restart, a replica promoted) may
        have forgotten recent transitions; until every process had a chance to
        re-assert what it knows (``settle_seconds``), a claim could hand out ids that
        clients already saw. The wait is short, so a request waits, not the client.
        """
        deadline = time.monotonic() + self.settle_seconds + SETTLE_GRACE_SECONDS
        while (store := await self.check()).settling_seconds > 0:
            remaining = store.settling_seconds
            if time.monotonic() + remaining > deadline:
                raise BufferUnavailable(
                    "the event store restarted just now and is still being checked; "
                    "try again in a second"
                )
            await asyncio.sleep(remaining)
        return store
