"""The janitor reports what is due on a real Valkey; its owner (the runner) acts on it."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.record import Takeover
from lib.workflows.janitor import Due, Janitor
from tests.support.api import until
from tests.support.ownership import ownership_parts

LEASE_SECONDS = 0.2
# A store found behind holds its deadlines this long: room for a few passes meanwhile.
BEHIND_LEASE_SECONDS = 1.0


async def test_a_pass_reports_ended_leases_and_due_deadlines_once_the_store_is_trusted(
    redis: Redis,
) -> None:
    buffer = EventBuffer(redis=redis, prefix=f"jn{uuid.uuid4().hex[:6]}")
    parts = ownership_parts(buffer, LEASE_SECONDS)
    watch = parts.watch
    crashed, paused = f"ex_{uuid.uuid4().hex}", f"ex_{uuid.uuid4().hex}"
    await watch.hold(crashed, "node-a:1")
    await watch.watch_deadline(paused, await watch.now_ms() - 1)
    while not await watch.due_leases():
        pass  # the lease entry ends on Redis's clock, a lease from now

    passes = Janitor(store=parts.store, watch=watch, lease_seconds=LEASE_SECONDS).passes()
    first = await anext(passes)
    # A store not watched for a lease yet proves nothing about leases: only hand-offs
    # may be taken over. A deadline needs no such trust (the claim decides).
    assert first == Due(
        leases=((crashed, "node-a:1"),), takeover=Takeover.HANDOFF, deadlines=(paused,)
    )
    for _ in range(100):
        due = await anext(passes)
        if due.leases and due.takeover is Takeover.EXPIRED:
            break
    else:
        raise AssertionError("the store was never trusted")
    assert due.leases == ((crashed, "node-a:1"),) and due.deadlines == (paused,)
    await passes.aclose()


async def test_deadlines_wait_about_a_lease_once_the_store_is_found_behind(redis: Redis) -> None:
    """A store whose mark is below one this process was given lost acknowledged writes
    (an older snapshot): a pause it holds may have been resumed, its owner stalled, so
    its deadline is not reported until the wait store.lua sets (a lease) is over. A
    pause listed since is not restored state: its deadline is reported at once.

    Found by the step 15 fault review (an accepted resume lost to the approval deadline
    when, right after the settle, the owner was stalled across a restore)."""
    buffer = EventBuffer(redis=redis, prefix=f"jn{uuid.uuid4().hex[:6]}")
    parts = ownership_parts(buffer, BEHIND_LEASE_SECONDS)
    paused = f"ex_{uuid.uuid4().hex}"
    await parts.watch.watch_deadline(paused, await parts.watch.now_ms() - 1)
    janitor = Janitor(store=parts.store, watch=parts.watch, lease_seconds=BEHIND_LEASE_SECONDS)
    due = await janitor._look()
    assert due is not None and due.deadlines == (paused,)

    await redis.hset(buffer.keys.store, "mark", 1)  # back from an older snapshot
    behind = await janitor._look()
    assert behind is None or behind.deadlines == (), behind
    assert 0 < (await parts.store.check()).behind_seconds <= BEHIND_LEASE_SECONDS
    fresh = f"ex_{uuid.uuid4().hex}"
    await parts.watch.watch_deadline(fresh, await parts.watch.now_ms() - 1)
    due = await janitor._look()
    assert (await parts.store.check()).behind_seconds > 0, "the machine is too slow"
    assert due is not None and due.deadlines == (fresh,)
    await parts.watch.forget_deadline(fresh)

    async def waited_out() -> bool:
        return (await parts.store.check()).behind_seconds <= 0

    await until(waited_out, "the wait after a store found behind ended", every=0.01)
    due = await janitor._look()
    assert due is not None and due.deadlines == (paused,)
