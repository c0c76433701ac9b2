"""A run that paused or completed on a replica that has since left (a rolling restart:
SIGTERM, nothing to hand off), then Valkey comes back from a snapshot taken while the
run was still running (a failover to a lagging replica): the snapshot says "running"
under an owner whose lease has long ended, and nobody is left to re-assert how the run
ended (finals.py keeps that only in the process that ended it). The run must not end a
second time under ids a client already saw (SPEC §4 "Ids": "not after a Redis restarted
from an older snapshot, a failover to a lagging replica"; SPEC §7 "exactly one terminal
event").

Found by the step 15 fault review.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, execute, put, until
from tests.support.faults import (
    FaultyValkey,
    crash_and_restore,
    replica,
    take_snapshot,
    terminate_replica,
)
from tests.support.recovery import (
    approval_flow,
    chain,
    follow_on,
    has_event,
    http_for,
    running,
    settled,
    settled_store,
    valkey,
)
from tests.support.s3 import MotoServer, shared_bucket
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(120)


def seen_events(frames: list[Frame]) -> list[dict[str, Any]]:
    return [frame.json for frame in frames if frame.id is not None]


@pytest.mark.parametrize("ending", ["completed", "paused"])
async def test_a_run_that_ended_on_a_replica_since_gone_does_not_end_again_after_a_restore(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer, ending: str
) -> None:
    """The run's end is recorded outside Redis, in the value store the replicas share,
    before the run is let go (finals.py): B, taking over the run the restore brought
    back running, finds it and stores the end again under its id, the ids between
    reported dropped, instead of running the run a second time."""
    shared = await shared_bucket(moto)
    a, b = replica(valkey, tmp_path, "a", **shared), replica(valkey, tmp_path, "b", **shared)
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        if ending == "completed":
            wf = chain("ended", blocks=3, ms=400)
            first = "s0"
        else:
            wf = approval_flow("ended", before_ms=800)
            first = "wait"
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "block:started", first), "running")
        snap = await take_snapshot(valkey, tmp_path / "running.rdb")
        if ending == "completed":
            seen = seen_events(await follow_on(a, eid))  # to its terminal event
        else:
            await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
            seen = await all_events(http_for(http, a), eid)
        assert seen[-1]["type"] == f"execution:{ending}", seen[-1]
        await terminate_replica(a)  # it leaves: nothing of its own is running
        alive.remove(a)
        await crash_and_restore(valkey, snap)
        await put(http_for(http, b), wf)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)

        async def ended_again_or_settled() -> bool:
            log = await all_events(http_for(http, b), eid)
            return bool(log) and log[-1]["type"] in (
                "execution:completed",
                "execution:paused",
                "execution:failed",
                "execution:cancelled",
            )

        await until(ended_again_or_settled, "the restored run is no longer running")
        stored = await all_events(http_for(http, b), eid)
    by_id = {event["id"]: event for event in stored}
    clashes = [
        (event["id"], event["type"], by_id[event["id"]]["type"])
        for event in seen
        if event["id"] in by_id and by_id[event["id"]] != event
    ]
    assert not clashes, (
        f"ids a client saw name other events now (id, seen, stored): {clashes}; stored "
        f"{[(e['id'], e['type']) for e in stored]}"
    )
    assert stored[-1] == seen[-1], ("the run ended again", stored[-1], seen[-1])


@dataclass
class Restored:
    """A run restored paused after it completed (``restored_paused_after_completing``)."""

    http: httpx.AsyncClient
    b: FlowcastServer  # the replica left
    eid: str
    seen: list[dict[str, Any]]  # the events a client saw on A
    start_another: Callable[[str], Awaitable[FlowcastServer]]  # a replica started now


@contextlib.asynccontextmanager
async def restored_paused_after_completing(
    valkey: FaultyValkey,
    tmp_path: Path,
    moto: MotoServer,
    wf: dict[str, Any],
    *,
    witness: bool = True,
) -> AsyncIterator[Restored]:
    """Run ``wf`` (an approval flow) on A to its pause, snapshot Valkey, resume it to
    completion on A, let A leave, and bring Valkey back from the snapshot: the run is
    paused again in the store, with B the only replica. ``witness``: B runs all along
    (it sees the store come back behind); else B starts after the restore, and no live
    process saw the store before it."""
    shared = await shared_bucket(moto)
    a = replica(valkey, tmp_path, "a", **shared)
    first = [a, replica(valkey, tmp_path, "b", **shared)] if witness else [a]
    async with running(*first) as alive, httpx.AsyncClient(timeout=30) as http:

        async def start_another(name: str) -> FlowcastServer:
            server = replica(valkey, tmp_path, name, **shared)
            alive.append(server)
            await server.start()
            return server

        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        snap = await take_snapshot(valkey, tmp_path / "paused.rdb")
        resumed = await http_for(http, a).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert resumed.status_code == 202, resumed.text
        seen = seen_events(await follow_on(a, eid))  # to its terminal event
        assert seen[-1]["type"] == "execution:completed", seen[-1]
        await terminate_replica(a)
        alive.remove(a)
        await crash_and_restore(valkey, snap)
        b = first[1] if witness else await start_another("b")
        await put(http_for(http, b), wf)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        yield Restored(http, b, eid, seen, start_another)


def assert_ended_once(seen: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
    """No id a client saw names another event now, and the run ended as it was seen to."""
    by_id = {event["id"]: event for event in stored}
    clashes = [(e["id"], e["type"]) for e in seen if e["id"] in by_id and by_id[e["id"]] != e]
    assert not clashes, (clashes, [(e["id"], e["type"]) for e in stored])
    assert stored[-1] == seen[-1], ("the run ended again", stored[-1], seen[-1])


@pytest.mark.parametrize("witness", [True, False], ids=["seen", "unseen"])
@pytest.mark.parametrize("asked", ["cancel", "resume"])
async def test_a_run_restored_paused_after_it_completed_meets_its_end_when_cancelled_or_resumed(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer, asked: str, witness: bool
) -> None:
    """Found by the fault storm (step 16 session): a run paused, was resumed and
    completed on A, which then left; Valkey came back from a snapshot taken while it was
    paused. A cancel through B claimed the pause and stored ``execution:cancelled`` under
    an id a client had seen as another event: only takeovers read the records owners
    keep outside Redis. Every claim now asks first (takeovers.py ``recall``): B stores
    the run's end again and answers 409 with the status that won.

    "unseen": B starts after the restore, so no live process saw the store before it
    and none can tell it came back behind. A resume was answered 202 so (the restore
    came 170 ms after the snapshot, within one check of B's: one run in five of this
    test): how a run ended is now asked at every resume, cancel, expiry and takeover."""
    wf = approval_flow("paused-then-done")
    async with restored_paused_after_completing(
        valkey, tmp_path, moto, wf, witness=witness
    ) as restored:
        http, b, eid = restored.http, restored.b, restored.eid
        body = {"input": {"ok": False}} if asked == "resume" else None
        answer = await http_for(http, b).post(f"/api/executions/{eid}/{asked}", json=body)
        assert answer.status_code == 409, answer.text
        assert "completed" in answer.text, answer.text
        stored = await all_events(http_for(http, b), eid)
    assert_ended_once(restored.seen, stored)


async def test_a_run_restored_paused_after_it_completed_meets_its_end_however_long_after(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer
) -> None:
    """The same cancel, through a replica started after the restore: it never saw the
    store behind, as none does once the while after seeing it is over (10 leases; a
    busy CI machine outlasted it between the restore and the cancel, and the cancel of
    the completed run was answered 202). The store keeps when it was found behind and
    each run when an owner last wrote it: a run nobody wrote since is asked about
    (takeovers.py ``recall``), however long after."""
    wf = approval_flow("paused-then-done-later")
    async with restored_paused_after_completing(valkey, tmp_path, moto, wf) as restored:
        c = await restored.start_another("c")
        http, eid = restored.http, restored.eid
        answer = await http_for(http, c).post(f"/api/executions/{eid}/cancel")
        assert answer.status_code == 409, answer.text
        assert "completed" in answer.text, answer.text
        stored = await all_events(http_for(http, c), eid)
    assert_ended_once(restored.seen, stored)


async def test_a_run_restored_paused_after_it_completed_is_not_expired_at_its_deadline(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer
) -> None:
    """The expiry's side of the case above: a run paused on an approval with a 3 s
    deadline, was resumed and completed on A, which left; Valkey came back from a
    snapshot taken while it was paused. When the restored pause's deadline passes, B's
    janitor claims it to expire it: it must find the run's end and store it again, not
    end the run a second time (failed, approval timeout) under ids a client saw."""
    wf = approval_flow("paused-with-deadline")
    wf["blocks"][1]["config"]["timeoutSeconds"] = 3
    async with restored_paused_after_completing(valkey, tmp_path, moto, wf) as restored:
        http, b, eid = restored.http, restored.b, restored.eid

        async def no_longer_paused() -> bool:
            log = await all_events(http_for(http, b), eid)
            return bool(log) and log[-1]["type"] != "execution:paused"

        await until(no_longer_paused, "the restored pause met its deadline", timeout=30)
        stored = await all_events(http_for(http, b), eid)
    assert_ended_once(restored.seen, stored)
