"""The store lost under running replicas (SPEC §4, §5, §7): Valkey restarted empty or
from an older snapshot, its writes paused or the server down, around a hand-off or a
takeover; no id names two events and no execution is stuck.

Replicas share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of
replicas and Valkey restarted from an older snapshot, empty, paused or down. Every stored
log goes through tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, execute, put, talking_workflow, until
from tests.support.faults import (
    LEASE_SECONDS,
    FaultyValkey,
    crash_and_restore,
    crash_and_wipe,
    fresh_replica,
    kill_replica,
    pause_writes,
    replica,
    take_snapshot,
    terminate_replica,
)
from tests.support.logcheck import check_lossy_log, check_view, same_ids_same_events
from tests.support.recovery import (
    LiveReader,
    approval_flow,
    chain,
    check_recovered,
    dropped_ranges,
    finished,
    follow_on,
    has_event,
    http_for,
    long_tail,
    meta_field,
    running,
    settled,
    settled_store,
    valkey,
)
from tests.support.servers import FlowcastServer
from tests.support.sse import follow
from tests.support.timing import assert_below_timer, hold_for

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


async def _saw(reader: LiveReader, kind: str, block: str) -> bool:
    return any(
        frame.event == kind and frame.json["data"].get("blockId") == block
        for frame in reader.frames
    )


async def _recoveries_at_least(client: httpx.AsyncClient, eid: str, n: int) -> bool:
    """A hand-off recovery is stored (C took over from B)."""
    with contextlib.suppress(httpx.TransportError, KeyError):
        stored = await all_events(client, eid)
        return any(
            e["type"] == "execution:recovered" and e["data"]["reason"] == "handoff" for e in stored
        )
    return False


def _async(check: Any) -> Any:
    async def wrapped() -> bool:
        return bool(check())

    return wrapped


# -- the store loses the checkpoint of a running execution, then it is handed off ---


@pytest.mark.timeout(150)
async def test_a_handoff_after_redis_came_back_empty_does_not_fail_the_execution(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Redis restarts empty while A runs an execution; A recreates its log and carries on
    (step 9). Then A is SIGTERMed: a shutdown hands work off, it does not fail it; A
    still holds everything the run needs in memory (workflow, input, outputs).
    Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = chain("wiped", blocks=8, ms=400)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "wiped", {"who": "x"})
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s1"), "s1")
        await crash_and_wipe(valkey)
        await put(http_for(http, a), wf)
        # A recreates the execution in the empty store as it goes on.
        await until(lambda: has_event(http_for(http, a), eid, "block:completed"), "recreated")
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", (snapshot.get("error"), [e["type"] for e in stored])
    check_lossy_log(stored, dropped=[(1, max(e["id"] for e in stored))])


@pytest.mark.timeout(150)
async def test_blocks_completed_after_an_older_snapshot_are_not_run_again_after_a_handoff(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Redis comes back from an older snapshot while A runs: the checkpoint loses the
    outputs of the blocks that completed since (clients saw their block:completed). A
    goes on with them in memory. Then A hands the execution off: B must not run again a
    block whose completion clients saw (SPEC §7: completed blocks are not run again).
    Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # Long enough to be running still when A is stopped, after the store settled.
        wf = chain("older", blocks=16, ms=500)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "older")
        live = asyncio.create_task(follow_on(a, eid))
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s0"), "s0")
        snap = await take_snapshot(valkey, tmp_path / "older.rdb")
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s2"), "s2")
        await crash_and_restore(valkey, snap)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(live, 2)
    assert snapshot["status"] == "completed", snapshot
    seen = check_view(live.result()) if live.done() and not live.exception() else []
    seen_completed = {e["data"]["blockId"] for e in seen if e["type"] == "block:completed"} | {
        "s0",
        "s1",
        "s2",
    }
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert len(recovered) == 1, recovered
    rerun_after = [
        e["data"]["blockId"]
        for e in stored
        if e["type"] == "block:started" and e["id"] > recovered[0]["id"]
    ]
    again = sorted(set(rerun_after) & {"s1", "s2"})
    assert not again, (
        f"blocks whose block:completed clients saw (and A kept) ran again after the "
        f"hand-off: {again}; recovered data {recovered[0]['data']}; "
        f"seen completed live {sorted(seen_completed)}"
    )


# -- the store forgets a recovery -----------------------------------------------------


@pytest.mark.timeout(150)
async def test_a_store_restored_from_before_a_recovery_does_not_number_recoveries_again(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A runs; a snapshot is taken; A is SIGKILLed and B recovers it (recovery 1, stored
    and seen live). Redis then comes back from the snapshot, from before the recovery:
    B takes its execution back (epoch above the stored one). B is later SIGTERMed and a
    third replica recovers it: that is recovery 2, never a second "recovery 1"; and no
    id a client saw names another event. Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("forgot", blocks=12, ms=400))
        eid = await execute(http_for(http, a), "forgot")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        snap = await take_snapshot(valkey, tmp_path / "before-recovery.rdb")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            live = asyncio.create_task(follow(on_b, eid))
            await until(lambda: has_event(on_b, eid, "execution:recovered"), "B recovered")
            await until(lambda: has_event(on_b, eid, "block:completed", "s3"), "s3 on B")
            await crash_and_restore(valkey, snap)
            await put(on_b, chain("forgot", blocks=12, ms=400))
            await until(lambda: settled_store(valkey), "the store settled", timeout=20)
            await until(lambda: has_event(on_b, eid, "block:completed", "s6"), "s6 on B")
            c = await fresh_replica(a)
            alive.append(c)
            await terminate_replica(b)
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as on_c:
            snapshot = await finished(on_c, eid)
            stored = await all_events(on_c, eid)
            replay = await follow(on_c, eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(live, 2)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored[-1])
    check_lossy_log(stored, dropped=dropped_ranges(replay))
    check_view(replay)
    if live.done() and not live.exception():
        seen = check_view(live.result())
        by_id = {e["id"]: e for e in stored}
        for envelope in seen:
            if envelope["id"] in by_id:
                assert by_id[envelope["id"]] == envelope, (envelope, by_id[envelope["id"]])
        seen_recoveries = [e["data"] for e in seen if e["type"] == "execution:recovered"]
    else:
        seen_recoveries = []
    recoveries = [e["data"] for e in stored if e["type"] == "execution:recovered"]
    numbers = [r["recovery"] for r in seen_recoveries] + [
        r["recovery"] for r in recoveries if r not in seen_recoveries
    ]
    assert len(numbers) == len(set(numbers)), (
        f"two recoveries with the same number: seen live {seen_recoveries}, stored {recoveries}"
    )


@pytest.mark.timeout(150)
async def test_redis_restarted_empty_right_after_a_takeover_still_completes(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = chain("wiperec", blocks=6, ms=500)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "wiperec")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            live = asyncio.create_task(follow(on_b, eid))
            await until(lambda: has_event(on_b, eid, "execution:recovered"), "B recovered")
            await crash_and_wipe(valkey)
            await put(on_b, wf)
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
            seen = check_view(await live)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored)
    assert seen[-1]["type"] == "execution:completed"
    by_id = {e["id"]: e for e in stored}
    for envelope in seen:
        if envelope["id"] in by_id:
            assert by_id[envelope["id"]] == envelope


@pytest.mark.timeout(150)
async def test_writes_paused_across_a_handoff_still_hand_off_and_complete(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """CLIENT PAUSE WRITE (2 s) lands as A is SIGTERMed: A's drain, hand-off claim and
    renewals all wait. It is still a hand-off (not a crash): with recovery from crashes
    turned off (FLOWCAST_MAX_RECOVERIES=0) it must complete, not end worker_lost.
    Found by the step 11 review."""
    env = {"FLOWCAST_MAX_RECOVERIES": "0"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("pausedho", blocks=6, ms=500))
        eid = await execute(http_for(http, a), "pausedho")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        stopping = asyncio.create_task(terminate_replica(a))
        await pause_writes(valkey, 2000)
        await stopping
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", (snapshot.get("error"), [e["type"] for e in stored])
    check_recovered(stored, moves=1)


# -- the store comes back from an older snapshot while the owner sits in a block -----


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["sigkill", "sigterm"])
async def test_older_snapshot_while_the_owner_is_idle_then_it_goes_numbers_above_what_was_seen(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """A runs s0, s1, then sits in a 20 s block (its writer is idle). Redis comes back
    from a snapshot taken right after s0 completed: s1's events, the start of ``long``
    and s1's checkpoint are lost, though a client saw them. A's renewals go on (same
    owner); nothing writes the lost part back while A writes no event. Once the store
    settled, A is SIGKILLed (or SIGTERMed: a hand-off). B takes over: it must number
    above every id the client saw (SPEC §4) and must not run s1 again (SPEC §7).
    Found by the step 11 review (round 2)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = long_tail(f"idle{fault}")
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:
            await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s0"), "s0")
            snap = await take_snapshot(valkey, tmp_path / "after-s0.rdb")
            await until(lambda: has_event(http_for(http, a), eid, "block:started", "long"), "long")
            await until(lambda: _saw(live, "block:started", "long"), "client saw long start")
            await crash_and_restore(valkey, snap)
            await put(http_for(http, a), wf)
            await until(lambda: settled_store(valkey), "the store settled", timeout=20)
            await hold_for(1.5, "one more lease: every owner had all the time it is given")
            if fault == "sigkill":
                await kill_replica(a)
            else:
                await terminate_replica(a)
            await until(lambda: has_event(http_for(http, b), eid, "execution:recovered"), "B")
            seen = live.seen()
        finally:
            await live.close()
        stored_now = await all_events(http_for(http, b), eid)
    types = [(e["id"], e["type"], e["data"].get("blockId")) for e in stored_now]
    same_ids_same_events(seen, stored_now)
    recovered = next(e for e in stored_now if e["type"] == "execution:recovered")
    assert recovered["id"] > max(e["id"] for e in seen), (recovered, seen[-1], types)
    assert "s1" in recovered["data"]["completed"], (
        f"s1's completion was seen by a client but the recovery runs it again: {recovered['data']}"
    )


@pytest.mark.timeout(180)
async def test_older_snapshot_from_before_a_recovery_while_the_new_owner_is_idle(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A runs; a snapshot is taken; A is SIGKILLed and B recovers (recovery 1, stored,
    seen live) then sits in a long block. Redis comes back from the snapshot (from
    before the recovery). B's renewals take the execution back (epoch above) but write
    nothing else. B is SIGTERMed: C's recovery must be number 2, not a second 1, and
    no id a client saw may name another event. Found by the step 11 review (round 2)."""
    a, b, c = (replica(valkey, tmp_path, n) for n in "abc")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        wf = long_tail("idlerec", long_ms=20_000)
        wf["blocks"][0]["config"]["ms"] = 1500  # A still in s0 at the kill
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, b), eid, "block:started", "s0"), "s0")
        snap = await take_snapshot(valkey, tmp_path / "before-recovery.rdb")
        await kill_replica(a)
        live = LiveReader(b, eid)
        try:
            await until(lambda: _saw(live, "block:started", "long"), "B runs long, seen live")
            await crash_and_restore(valkey, snap)
            await put(http_for(http, b), wf)
            await until(lambda: settled_store(valkey), "the store settled", timeout=20)
            await hold_for(1.5, "one more lease: every owner had all the time it is given")
            await c.start()
            alive.append(c)
            await terminate_replica(b)
            await until(lambda: _recoveries_at_least(http_for(http, c), eid, 1), "C recovered", 30)
            seen = live.seen()
        finally:
            await live.close()
        stored_now = await all_events(http_for(http, c), eid)
    recoveries = [
        *(("seen", e["id"], e["data"]) for e in seen if e["type"] == "execution:recovered"),
        *(("stored", e["id"], e["data"]) for e in stored_now if e["type"] == "execution:recovered"),
    ]
    numbers = [e["data"]["recovery"] for e in seen if e["type"] == "execution:recovered"]
    numbers += [
        e["data"]["recovery"]
        for e in stored_now
        if e["type"] == "execution:recovered" and e not in seen
    ]
    assert numbers == list(range(1, len(numbers) + 1)), (
        f"recoveries seen live then stored are numbered {numbers}: {recoveries}"
    )
    same_ids_same_events(seen, stored_now)


# -- the owner dies while the store is down ----------------------------------------


@pytest.mark.timeout(180)
async def test_owner_killed_while_valkey_is_down_its_live_ids_are_not_given_again(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """The owner shows events live ahead of the store, then Valkey goes down (it comes
    back from its AOF: nothing acknowledged is lost) and the owner is SIGKILLed before
    it is back. B takes over: the ids the client saw must not be given to B's events
    (SPEC §4). Shown ahead of the store means under ids Redis reserved for the owner
    (SPEC §5 as amended in step 15; this was a known limit, an xfail, while the owner
    showed events above any reserved id; fixed with F1 of the step 15 fault review).

    A reservation ahead comes with a burst: writes paused for 300 ms while the owner
    streams make one. Writes are then paused again: the owner goes on showing events
    under its reservation (its renewals wait, they do not fail), none stored; then
    Valkey is killed, and the owner with it. Found by the step 11 review (round 2)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = talking_workflow("downkill", words=6000, tps=1000)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:
            await until(_async(lambda: live.last_id() >= 50), "the client saw the stream")
            await pause_writes(valkey, 300)

            async def reserved_ahead() -> bool:
                reserved = int(await meta_field(valkey, eid, "reserved") or 0)
                return reserved > int(await meta_field(valkey, eid, "lastId") or 0) + 60

            await until(reserved_ahead, "the burst after the pause reserved ids ahead")
            await pause_writes(valkey, 20_000)
            stored_before = int(await meta_field(valkey, eid, "lastId") or 0)
            try:
                await until(
                    _async(lambda: live.last_id() >= stored_before + 6),
                    "the client saw events the store has not stored",
                    timeout=20,
                )
                valkey.kill()
                # Down for everyone now: A's renewals fail, and its gate must close.
                await until(
                    _async(lambda: "lease renewal failed" in a.logs()),
                    "A found it could not renew its lease",
                    timeout=20,
                )
                await kill_replica(a)
            finally:
                await valkey.start()
            await until(lambda: has_event(http_for(http, b), eid, "execution:recovered"), "B")
            seen = live.seen()
        finally:
            await live.close()
        snapshot = await finished(http_for(http, b), eid)
        stored_now = await all_events(http_for(http, b), eid)
        replay = await follow(http_for(http, b), eid)
    assert max(e["id"] for e in seen) > stored_before
    check_lossy_log(stored_now, dropped=dropped_ranges(replay))
    same_ids_same_events(seen, stored_now)
    assert snapshot["status"] == "completed", snapshot


# -- shutdown with the store paused or down ------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["paused", "down"])
async def test_sigterm_with_the_store_paused_or_down_exits_promptly_and_nothing_is_stuck(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """SIGTERM A (running executions) while Valkey refuses writes for 4 s (CLIENT PAUSE
    WRITE: four leases, four graces) or is down until A has exited. A must exit within
    its grace plus a few seconds with no "tasks did not stop"; B must finish every
    execution (handed off, or recovered once A's lease expired), none failed.
    Found by the step 11 review (round 2)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # Each run is in its first block or two at the signal and the drain starts no
        # other: B has blocks left to run whatever the timing.
        await put(http_for(http, a), chain("termstore", blocks=3, ms=500))
        started = [await execute(http_for(http, a), "termstore") for _ in range(3)]
        for eid in started:
            await until(lambda e=eid: has_event(http_for(http, a), e, "block:started"), "running")
        pid = a.pid
        if fault == "paused":
            await pause_writes(valkey, 4000)
        else:
            valkey.kill()
        began = time.monotonic()
        try:
            code = await terminate_replica(a, timeout=40)
        finally:
            took = time.monotonic() - began
            if fault == "down":
                await valkey.start()
        logs = a.logs()
        statuses = [(await finished(http_for(http, b), eid))["status"] for eid in started]
        stored = [await all_events(http_for(http, b), eid) for eid in started]
    assert code in (0, -signal.SIGTERM), code
    assert "tasks did not stop" not in logs, [
        line for line in logs.splitlines() if "tasks did not stop" in line
    ]
    assert_below_timer(
        took,
        bound=1 + 10 + 6,
        timer="the 1 s grace and the drain's own limits",
        what=f"process {pid}'s exit after SIGTERM",
    )
    for log in stored:
        check_recovered(log)
    assert statuses == ["completed"] * len(started), statuses


@pytest.mark.parametrize("stall", [0.6, 2.5], ids=["shorter-than-a-lease", "longer"])
async def test_a_pause_resumed_elsewhere_then_redis_came_back_empty_is_not_expired_under_seen_ids(
    valkey: FaultyValkey, tmp_path: Path, stall: float
) -> None:
    """Found by the fault storm (step 17 session): a pause with a deadline, paused on A
    and resumed on B just before it; past the deadline Valkey came back empty while B
    was stalled. A re-asserted the pause it kept (finals.py) into the empty store, and
    its janitor expired it at once: ``execution:failed`` stored under id 6, which B's
    client had seen as ``execution:resumed``, and B, fenced out, never ended its stream.
    A restored pause's deadline now waits a lease, the time B needs to take its run back
    (renew.lua lets the newer epoch in): the run completes as B's client saw it. Stalled
    longer, B loses it: the store that came back empty is behind (store.lua), so the
    expiry numbers above B's durable ceiling, and B's client gets that end."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    wf = approval_flow("wiped-resume", after_ms=4_000)
    wf["blocks"][1]["config"]["timeoutSeconds"] = 2
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        deadline_ms = int(await meta_field(valkey, eid, "pauseDeadline") or 0)
        resumed = await http_for(http, b).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert resumed.status_code == 202, resumed.text
        reader = LiveReader(b, eid)
        try:
            await until(
                lambda: has_event(http_for(http, b), eid, "block:started", "after"), "B runs on"
            )
            await until(_async(lambda: time.time() * 1000 > deadline_ms + 100), "past deadline")
            async with wiped_with_b_stalled(valkey, http, a, b, eid):
                # Longer than A's janitor takes to see a due deadline (half a lease).
                await hold_for(stall, "B stalled while A's janitor looks at the pause")
            snapshot = await finished(http_for(http, a), eid)
            stored = await all_events(http_for(http, a), eid)
            await until(_async(lambda: reader.done), "B's stream ended")
            seen = reader.seen()
        finally:
            await reader.close()
    same_ids_same_events(seen, stored)
    assert seen[-1] == stored[-1], (seen[-1], stored)  # the end B's client got is stored
    if stall < LEASE_SECONDS:
        assert snapshot["status"] == "completed", (snapshot.get("error"), stored)
    else:
        assert snapshot["status"] in ("completed", "failed"), snapshot


@pytest.mark.timeout(120)
async def test_a_pause_stored_again_then_ended_by_its_resumer_stops_counting_for_its_tenant(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Paused on A, resumed on B and completed there; Valkey came back empty while B was
    stalled. A stored again the pause it kept, which counts for the tenant as a paused
    execution does (finals.py); then B stored again the end it kept, above it. The
    execution is completed, yet it went on counting as paused for its tenant as long
    as a paused one's keys live (30 days): at a cap of one unfinished execution, the
    tenant's next execute was refused (429). Found by the fresh-eyes review of e37bdfa."""
    cap = {"FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "1"}
    a, b = replica(valkey, tmp_path, "a", **cap), replica(valkey, tmp_path, "b", **cap)
    wf = approval_flow("ended-elsewhere")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        resumed = await http_for(http, b).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert resumed.status_code == 202, resumed.text
        assert (await finished(http_for(http, b), eid))["status"] == "completed"
        async with wiped_with_b_stalled(valkey, http, a, b, eid):
            pass  # B goes on as soon as A stored the pause again
        await until(
            lambda: has_event(http_for(http, a), eid, "execution:completed"),
            "B stored again the end it kept",
        )
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await put(http_for(http, a), wf)
        answer = await http_for(http, a).post(f"/api/workflows/{wf['id']}/execute", json={})
        assert answer.status_code == 202, answer.text


@pytest.mark.timeout(120)
async def test_a_second_resume_right_after_redis_came_back_empty_meets_the_first(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Paused on A, resumed on B (202); Valkey came back empty while B was held across
    the restart for a moment. A stored again the pause it kept (finals.py), and a second
    resume sent to A at once was accepted too (202, 0.1-0.4 s after the restore, 5 runs
    in 6), ahead of B re-asserting its run: B's client saw its answer resumed, then the
    other's, and the run completed with the second answer. An emptied store now settles
    as a restarted one does (store.lua), so the second resume meets B's run: 409.
    Found by the fresh-eyes review of e37bdfa."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    wf = approval_flow("resumed-twice", after_ms=4_000)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        first = await http_for(http, b).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert first.status_code == 202, first.text
        reader = LiveReader(b, eid)
        try:
            await until(
                lambda: has_event(http_for(http, b), eid, "block:started", "after"), "B runs on"
            )
            # B's client saw its answer before the store lost it (a client that connects
            # only after the wipe is told of those ids by a gap, not shown them: under
            # load in one run of six its stream had not started yet).
            await until(
                lambda: any(frame.event == "execution:resumed" for frame in reader.frames),
                "B's client saw its answer",
            )
            async with wiped_with_b_stalled(valkey, http, a, b, eid):
                pass  # B goes on as soon as A stored the pause again
            second = await http_for(http, a).post(
                f"/api/executions/{eid}/resume", json={"input": {"ok": False}}
            )
            snapshot = await finished(http_for(http, a), eid)
            stored = await all_events(http_for(http, a), eid)
            await until(_async(lambda: reader.done), "B's stream ended")
            seen = reader.seen()
        finally:
            await reader.close()
    assert second.status_code == 409, (second.text, stored)
    assert snapshot["status"] == "completed", snapshot
    assert snapshot["output"] == {"echo": {"ok": True}}, snapshot
    same_ids_same_events(seen, stored)
    answers = [e["data"]["input"] for e in seen if e["type"] == "execution:resumed"]
    assert answers == [{"ok": True}], answers


@pytest.mark.timeout(120)
async def test_a_second_resume_after_the_settle_meets_a_resumer_stalled_less_than_a_lease(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """As the test above, but B is held across the restart until the second resume
    (sent to A at once) is answered: past the settle (1 s), well within B's lease (4 s
    here). A restored pause takes no resume for a lease (claim.lua HELD): the second
    is a 503 with Retry-After, and the run completes with B's answer. (Before the hold,
    it waited the settle only and was accepted: two 202s for one pause.)"""
    lease = {"FLOWCAST_LEASE_SECONDS": "4"}
    a, b = replica(valkey, tmp_path, "a", **lease), replica(valkey, tmp_path, "b", **lease)
    wf = approval_flow("resumed-twice-late", after_ms=6_000)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        first = await http_for(http, b).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert first.status_code == 202, first.text
        await until(
            lambda: has_event(http_for(http, b), eid, "block:started", "after"), "B runs on"
        )
        async with wiped_with_b_stalled(valkey, http, a, b, eid):
            second = await http_for(http, a).post(
                f"/api/executions/{eid}/resume", json={"input": {"ok": False}}
            )
        snapshot = await finished(http_for(http, a), eid)
    assert second.status_code == 503, second.text
    assert second.json()["error"]["code"] == "pause_held", second.text
    assert 1 <= int(second.headers["Retry-After"]) <= 4, second.headers
    assert snapshot["output"] == {"echo": {"ok": True}}, snapshot


@pytest.mark.timeout(120)
async def test_a_second_resume_after_an_older_snapshot_meets_a_resumer_stalled_less_than_a_lease(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """As the test above, but Valkey comes back from a snapshot taken while the run was
    paused (not empty): the store holds the pause itself, so nobody stores it again
    and nothing holds it (claim.lua HELD is set by finals.py only). A second resume
    sent to A past the settle, within B's lease, was accepted beside B's: two 202s
    for one pause, and the run completed with the second answer (B's never ran).
    While the store is behind (about a lease), a paused execution takes no resume or
    cancel: 503 pause_held, as its deadline does not expire (janitor.py).
    Found by the fresh-eyes review of 73d4c9d."""
    lease = {"FLOWCAST_LEASE_SECONDS": "4"}
    a, b = replica(valkey, tmp_path, "a", **lease), replica(valkey, tmp_path, "b", **lease)
    wf = approval_flow("resumed-twice-older", after_ms=6_000)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        snap = await take_snapshot(valkey, tmp_path / "paused.rdb")
        snap_mark = int(await _store_mark(valkey))
        first = await http_for(http, b).post(
            f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
        )
        assert first.status_code == 202, first.text
        await until(
            lambda: has_event(http_for(http, b), eid, "block:started", "after"), "B runs on"
        )
        # A snapshot older than the processes' last look at the store (every quarter of
        # a second), as any periodic one is: they remember a mark above its own.
        await until(
            _async_check(lambda: _store_mark(valkey), lambda mark: mark > snap_mark + 1000),
            "the processes looked at the store a second after the snapshot",
        )
        os.kill(b.pid, signal.SIGSTOP)
        try:
            await crash_and_restore(valkey, snap)
            second = await http_for(http, a).post(
                f"/api/executions/{eid}/resume", json={"input": {"ok": False}}
            )
        finally:
            os.kill(b.pid, signal.SIGCONT)
        snapshot = await finished(http_for(http, a), eid)
        stored = await all_events(http_for(http, a), eid)
    answers = [e["data"]["input"] for e in stored if e["type"] == "execution:resumed"]
    assert second.status_code == 503, (second.text, answers, snapshot)
    assert second.json()["error"]["code"] == "pause_held", second.text
    assert 1 <= int(second.headers["Retry-After"]) <= 4, second.headers
    assert snapshot["output"] == {"echo": {"ok": True}}, snapshot


async def _store_mark(valkey: FaultyValkey) -> int:
    """The store's mark (store.lua): its time at the latest look of a process."""
    redis = Redis.from_url(valkey.url)
    try:
        return int(await redis.hget("fc:store", "mark") or 0)
    finally:
        await redis.aclose()


def _async_check(read: Any, test: Any) -> Any:
    async def check() -> bool:
        return bool(test(await read()))

    return check


@contextlib.asynccontextmanager
async def wiped_with_b_stalled(
    valkey: FaultyValkey, http: httpx.AsyncClient, a: FlowcastServer, b: FlowcastServer, eid: str
) -> AsyncIterator[None]:
    """B stopped (SIGSTOP), Valkey restarted empty, and A stored again the pause of
    ``eid`` it kept (finals.py); B goes on (SIGCONT) when the block ends."""
    os.kill(b.pid, signal.SIGSTOP)
    try:
        await crash_and_wipe(valkey)
        await until(
            lambda: has_event(http_for(http, a), eid, "execution:paused"),
            "A stored again the pause it kept",
        )
        yield
    finally:
        os.kill(b.pid, signal.SIGCONT)
