"""The takeover and expire transitions of claim.lua, on a real Valkey server: what the
claim tells a new owner, and which owner it may replace.

Found by the step 15 fault review: F5 (a takeover learnt of an accepted cancel only from
its first write, after it had started a block again) and F6 (a lone server that
restarts waited a whole lease for its own dead process's runs; a deadline that passed
before its pause was stored was forgotten).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from lib.errors import Conflict
from lib.execution.buffer import EventBuffer
from lib.execution.ownership import Ownership
from lib.execution.record import Takeover
from lib.execution.values import LocalValueStore
from lib.execution.watchlists import WatchLists
from lib.workflows.runstate import RunStates
from tests.support.ownership import ownership_parts

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def buffer(redis: Redis) -> EventBuffer:
    return EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")


@pytest.fixture
def ownership(buffer: EventBuffer) -> Ownership:
    return ownership_parts(buffer, 15).ownership


@pytest.fixture
def watch(buffer: EventBuffer) -> WatchLists:
    return ownership_parts(buffer, 15).watch


async def running(ownership: Ownership, owner: str) -> str:
    """A running execution owned by ``owner``, its lease 15 s from now."""
    execution_id = f"ex_{uuid.uuid4().hex}"
    await ownership.start(
        execution_id,
        fence=owner,
        workflow_id="wf",
        tenant="t",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    return execution_id


async def expire_lease(ownership: Ownership, execution_id: str) -> None:
    await ownership.redis.hset(ownership.keys.meta(execution_id), "leaseUntil", 0)


async def test_a_takeover_claim_says_a_cancel_was_accepted(ownership: Ownership) -> None:
    execution_id = await running(ownership, "dead:1")
    cancel = await ownership.claim(execution_id, "cancel", "any:1")
    assert cancel.cancel_requested and cancel.owner == "dead:1"
    await expire_lease(ownership, execution_id)
    claim = await ownership.claim(execution_id, "takeover", "next:1", expected="dead:1")
    assert claim.cancel_requested
    assert (claim.owner, claim.reason, claim.recovery) == ("next:1", "worker_lost", 1)
    # Sent again (its first answer lost), it answers the same.
    again = await ownership.claim(execution_id, "takeover", "next:1", expected="dead:1")
    assert again.cancel_requested


async def test_a_takeover_claim_without_a_cancel_says_none(ownership: Ownership) -> None:
    execution_id = await running(ownership, "dead:2")
    await expire_lease(ownership, execution_id)
    claim = await ownership.claim(execution_id, "takeover", "next:2", expected="dead:2")
    assert not claim.cancel_requested


async def test_a_dead_owner_is_taken_over_before_its_lease_ends_and_only_it(
    ownership: Ownership,
) -> None:
    execution_id = await running(ownership, "node:old")
    with pytest.raises(Conflict) as lease:
        await ownership.claim(execution_id, "takeover", "node:new", expected="node:old")
    assert lease.value.code == "lease"
    for expected in ("node:other", ""):
        with pytest.raises(Conflict) as moved:
            await ownership.claim(
                execution_id, "takeover", "node:new", expected=expected, takeover=Takeover.DEAD
            )
        assert moved.value.code == "moved"
    claim = await ownership.claim(
        execution_id, "takeover", "node:new", expected="node:old", takeover=Takeover.DEAD
    )
    assert (claim.owner, claim.reason, claim.epoch) == ("node:new", "worker_lost", 2)


async def test_the_leases_of_dead_nodes_are_found_by_node(
    ownership: Ownership, watch: WatchLists
) -> None:
    mine = await running(ownership, "aaa:1")
    theirs = await running(ownership, "aaab:1")
    found = await watch.leases_of(("aaa",))
    assert (mine, "aaa:1") in found and all(fence.startswith("aaa:") for _, fence in found)
    assert (theirs, "aaab:1") not in found


async def test_a_deadline_of_a_pause_not_stored_yet_is_not_due(
    ownership: Ownership, buffer: EventBuffer, tmp_path: Path
) -> None:
    execution_id = await running(ownership, "owner:1")
    states = RunStates(buffer=buffer, values=LocalValueStore(root=tmp_path))
    await states.save(execution_id, {}, deadline_ms=1)  # long past
    with pytest.raises(Conflict) as refused:
        await ownership.claim(execution_id, "expire", "janitor:1")
    assert refused.value.code == "notdue"
