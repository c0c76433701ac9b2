"""The janitor reports what is due on a real Valkey; its owner (the runner) acts on it."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from lib.execution.buffer import EventBuffer
from lib.execution.ownership import Ownership
from lib.execution.record import Takeover
from lib.workflows.janitor import Due, Janitor

LEASE_SECONDS = 0.2


async def test_a_pass_reports_ended_leases_and_due_deadlines_once_the_store_is_trusted(
    redis: Redis,
) -> None:
    buffer = EventBuffer(redis=redis, prefix=f"jn{uuid.uuid4().hex[:6]}")
    ownership = Ownership(buffer=buffer, lease_seconds=LEASE_SECONDS)
    crashed, paused = f"ex_{uuid.uuid4().hex}", f"ex_{uuid.uuid4().hex}"
    await ownership.hold(crashed, "node-a:1")
    await ownership.watch_deadline(paused, await ownership.now_ms() - 1)
    while not await ownership.due_leases():
        pass  # the lease entry ends on Redis's clock, a lease from now

    passes = Janitor(ownership=ownership, lease_seconds=LEASE_SECONDS).passes()
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
