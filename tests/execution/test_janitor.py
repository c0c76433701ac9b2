"""The janitor reports what is due on a real Valkey; its owner (the runner) acts on it."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.record import Takeover
from lib.workflows.janitor import Due, Janitor
from tests.support.ownership import ownership_parts

LEASE_SECONDS = 0.2


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
