"""An owner stalled (SIGSTOP) or killed across a Valkey restart from an older snapshot:
the store forgot the events stored and the ids reserved since the snapshot, and the
owner cannot re-assert them within the settle, so the next owner must still never number
an event a client saw (SPEC §4: "not after a Redis restarted from an older snapshot ...
not after the execution moved to another process").

Found by the step 15 fault review.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from itertools import takewhile
from pathlib import Path
from typing import Any

import httpx
import pytest

from lib.execution.store import RESTORED_LEASES
from tests.support.api import all_events, execute, put, talking_workflow, until
from tests.support.faults import (
    LEASE_SECONDS,
    FaultyValkey,
    crash_and_restore,
    kill_replica,
    replica,
    take_snapshot,
)
from tests.support.logcheck import same_ids_same_events
from tests.support.recovery import (
    LiveReader,
    finished,
    has_event,
    http_for,
    meta_field,
    running,
    settled,
    valkey,
)
from tests.support.s3 import MotoServer, shared_bucket

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(120)


def by_id(log: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {event["id"]: event for event in log}


async def _stored_last(valkey: FaultyValkey, eid: str) -> int:
    return int(await meta_field(valkey, eid, "lastId") or 0)


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
async def test_an_owner_lost_across_a_restore_from_an_older_snapshot_keeps_its_ids(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer, fault: str
) -> None:
    """A streams chunks (a client follows it on A). A snapshot is taken; A streams on,
    its client sees well over a hundred ids the snapshot does not hold. Then A cannot
    re-assert what it holds: it is stopped (SIGSTOP) until B took the run over, or it
    dies (SIGKILL) just before; Valkey comes back from the snapshot, and B takes the run
    over once the store settled and a lease passed. A stopped one is then let go
    (SIGCONT): it is fenced out. Every id A's client saw must name the same event in
    the stored log: B numbers above the durable ceiling A recorded in the value store
    the replicas share (ceiling.py), the ids between reported dropped."""
    shared = await shared_bucket(moto)
    a, b = replica(valkey, tmp_path, "a", **shared), replica(valkey, tmp_path, "b", **shared)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # Long enough that A is mid-block at the fault (it needs ~300 ids), short enough
        # that B's rerun of the block after the takeover is not 20 s of waiting.
        wf = talking_workflow("stallsnap", words=1200, tps=200)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:

            async def streamed(n: int) -> bool:
                return await _stored_last(valkey, eid) >= n

            await until(lambda: streamed(20), "A streams")
            snap = await take_snapshot(valkey, tmp_path / "early.rdb")
            in_snapshot = int(await meta_field(valkey, eid, "reserved") or 0)
            await until(lambda: streamed(in_snapshot + 150), "A streams on past the snapshot")

            async def client_saw_past() -> bool:
                return live.last_id() > in_snapshot + 100

            await until(client_saw_past, "the client saw ids the snapshot lacks")
            pid = a.pid
            if fault == "sigkill":
                await kill_replica(a)
            else:
                os.kill(pid, signal.SIGSTOP)
            try:
                await crash_and_restore(valkey, snap)
                await put(http_for(http, b), wf)
                await until(
                    lambda: has_event(http_for(http, b), eid, "execution:recovered"),
                    "B took the run over",
                    timeout=40,
                )
            finally:
                if fault == "sigstop":
                    os.kill(pid, signal.SIGCONT)
            await finished(http_for(http, b), eid)
            seen = live.seen()
        finally:
            await live.close()
        stored = await all_events(http_for(http, b), eid)
    recovered = next(e for e in stored if e["type"] == "execution:recovered")
    print(
        f"\nreserved just after the snapshot {in_snapshot}, client saw up to "
        f"{max(e['id'] for e in seen)}, B's recovered event is id {recovered['id']}"
    )
    clashes = [e["id"] for e in seen if e["id"] in by_id(stored) and by_id(stored)[e["id"]] != e]
    assert not clashes, (
        f"ids {clashes[0]}..{clashes[-1]} ({len(clashes)}) A's client saw name other events now"
    )
    same_ids_same_events(seen, stored)
    # A stopped A's client follows on to B's events once A is fenced: what A showed is
    # what the client saw before B's recovered event.
    shown_by_a = list(takewhile(lambda e: e["type"] != "execution:recovered", seen))
    assert recovered["id"] > max(e["id"] for e in shown_by_a), (recovered["id"], shown_by_a[-1])


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a takeover numbers above the durable ceiling only in a process that saw the store "
        "behind (StoreIdentity.came_back_behind); a process started after the restore has "
        "no earlier mark, so B renumbers ids A's client saw (29..178 of 191 in one run). "
        "Reading the records on every takeover is not the fix: a plain hand-off then jumps "
        "a block (test_cancel_during_moves: ids 1,2,3,4099..). Left to the lead"
    ),
)
async def test_a_replica_started_after_the_restore_numbers_above_the_dead_owners_ids(
    valkey: FaultyValkey, tmp_path: Path, moto: MotoServer
) -> None:
    """The lone replica A streams; a snapshot is taken; A's client sees well over a
    hundred ids the snapshot lacks; A dies (SIGKILL) and Valkey comes back from the
    snapshot. Only then does B start (a restarted deployment): no process alive saw the
    store behind, yet B's takeover must still number above what A's client saw (the
    durable ceiling A recorded in the value store). Found by the h1 fresh-eyes review:
    takeovers read the durable records only in a process that saw the store behind, and
    a process's mark of the store lives only in its memory."""
    shared = await shared_bucket(moto)
    a, b = replica(valkey, tmp_path, "a", **shared), replica(valkey, tmp_path, "b", **shared)
    async with running(a) as alive, httpx.AsyncClient(timeout=30) as http:
        wf = talking_workflow("freshsnap", words=1200, tps=200)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:

            async def streamed(n: int) -> bool:
                return await _stored_last(valkey, eid) >= n

            await until(lambda: streamed(20), "A streams")
            snap = await take_snapshot(valkey, tmp_path / "early.rdb")
            in_snapshot = int(await meta_field(valkey, eid, "reserved") or 0)
            await until(lambda: streamed(in_snapshot + 150), "A streams on past the snapshot")

            async def client_saw_past() -> bool:
                return live.last_id() > in_snapshot + 100

            await until(client_saw_past, "the client saw ids the snapshot lacks")
            await kill_replica(a)
            seen = live.seen()
        finally:
            await live.close()
        await crash_and_restore(valkey, snap)
        await b.start()
        alive.append(b)
        await until(
            lambda: has_event(http_for(http, b), eid, "execution:recovered"),
            "B took the run over",
            timeout=40,
        )
        await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    recovered = next(e for e in stored if e["type"] == "execution:recovered")
    print(
        f"\nreserved just after the snapshot {in_snapshot}, client saw up to "
        f"{max(e['id'] for e in seen)}, B's recovered event is id {recovered['id']}"
    )
    clashes = [e["id"] for e in seen if e["id"] in by_id(stored) and by_id(stored)[e["id"]] != e]
    assert not clashes, (
        f"ids {clashes[0]}..{clashes[-1]} ({len(clashes)}) A's client saw name other events now"
    )
    same_ids_same_events(seen, stored)
    highest_seen = max(e["id"] for e in seen)
    assert recovered["id"] > highest_seen, (recovered["id"], highest_seen)


@pytest.fixture
async def own_moto(tmp_path: Path) -> AsyncIterator[MotoServer]:
    """A moto server of the test's own, to stop (SIGSTOP) without touching others'."""
    server = MotoServer(log_path=tmp_path / "moto.log")
    await server.start()
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await server.stop()


async def test_a_value_store_out_past_the_restored_window_still_keeps_the_dead_owners_ids(
    valkey: FaultyValkey, tmp_path: Path, own_moto: MotoServer
) -> None:
    """As the SIGKILL case above, but the value store answers nothing (its S3 endpoint
    stopped) from just before the restore until well past the ten leases in which B
    trusts the store's reservations no more (store.RESTORED_LEASES). B's takeover waits
    for the records while the window lasts; it must go on waiting, not take the run over
    from the snapshot's ids once the window ends. Found by the h1 fresh-eyes review."""
    shared = await shared_bucket(own_moto)
    a, b = replica(valkey, tmp_path, "a", **shared), replica(valkey, tmp_path, "b", **shared)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = talking_workflow("s3gone", words=1200, tps=200)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:

            async def streamed(n: int) -> bool:
                return await _stored_last(valkey, eid) >= n

            await until(lambda: streamed(20), "A streams")
            snap = await take_snapshot(valkey, tmp_path / "early.rdb")
            in_snapshot = int(await meta_field(valkey, eid, "reserved") or 0)
            await until(lambda: streamed(in_snapshot + 150), "A streams on past the snapshot")

            async def client_saw_past() -> bool:
                return live.last_id() > in_snapshot + 100

            await until(client_saw_past, "the client saw ids the snapshot lacks")
            await kill_replica(a)
            seen = live.seen()
        finally:
            await live.close()
        os.kill(own_moto.pid, signal.SIGSTOP)
        try:
            await crash_and_restore(valkey, snap)
            # Past the window (lease + ten leases), while B cannot read the records.
            await asyncio.sleep((RESTORED_LEASES + 4) * LEASE_SECONDS)
        finally:
            os.kill(own_moto.pid, signal.SIGCONT)
        await put(http_for(http, b), wf)
        await until(
            lambda: has_event(http_for(http, b), eid, "execution:recovered"),
            "B took the run over",
            timeout=60,
        )
        await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    recovered = next(e for e in stored if e["type"] == "execution:recovered")
    print(
        f"\nreserved just after the snapshot {in_snapshot}, client saw up to "
        f"{max(e['id'] for e in seen)}, B's recovered event is id {recovered['id']}"
    )
    clashes = [e["id"] for e in seen if e["id"] in by_id(stored) and by_id(stored)[e["id"]] != e]
    assert not clashes, (
        f"ids {clashes[0]}..{clashes[-1]} ({len(clashes)}) A's client saw name other events now"
    )
    same_ids_same_events(seen, stored)
