"""Breaking the step-11 fixes, round 2: faults on real processes around the five fixes
(run state at start, write-back after a store loss, recovery numbering, retry budget,
tenant admission) and the shutdown of the control loop.

Replicas share one Valkey (lease 1 s, grace 1 s). Faults: SIGKILL / SIGTERM of replicas,
Valkey restarted from an older snapshot, empty, or down for a while. Every stored log
goes through tests/support/logcheck.py; every client view through ``check_view``; and
what a client saw live is compared, id by id, with what is stored at the end (SPEC §4:
"an id is never given to two different events").
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.e2e.recovery.test_break_step11 import (
    DEADLINE,
    _dropped_ranges,
    chain,
    check_recovered,
    execute,
    finished,
    follow,
    has_event,
    http_for,
    running,
    settled_store,
    until,
)
from tests.support.api import all_events, put
from tests.support.faults import (
    FaultyValkey,
    crash_and_restore,
    crash_and_wipe,
    kill_replica,
    pause_writes,
    replica,
    take_snapshot,
    terminate_replica,
    wait_store_settled,
)
from tests.support.logcheck import check_log, check_lossy_log, check_view, same_ids_same_events
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
async def valkey(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FaultyValkey]:
    server = FaultyValkey(data_dir=tmp_path_factory.mktemp("break11r2-valkey"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(autouse=True)
async def settled(valkey: FaultyValkey) -> None:
    """Each test on a running, empty, settled store."""
    if valkey._process is None:  # a test left it down
        await valkey.start()
    await wait_store_settled(valkey, timeout=DEADLINE, flush=True)


async def meta_field(valkey: FaultyValkey, eid: str, field: str) -> bytes | None:
    redis = Redis.from_url(valkey.url)
    try:
        value: bytes | None = await redis.hget(f"fc:{{{eid}}}:meta", field)
        return value
    finally:
        await redis.aclose()


class LiveReader:
    """A client following one execution on one replica: keeps every frame it got, even
    when the replica dies under it (the stream is then cut)."""

    def __init__(self, server: FlowcastServer, eid: str) -> None:
        self.frames: list[Frame] = []
        self._client = httpx.AsyncClient(base_url=server.url, timeout=60)
        self._task = asyncio.create_task(self._read(eid))

    async def _read(self, eid: str) -> None:
        url = f"/api/executions/{eid}/stream"
        with contextlib.suppress(httpx.HTTPError, AssertionError):
            async with self._client.stream("GET", url) as response:
                async for frame in events(response):
                    self.frames.append(frame)

    def last_id(self) -> int:
        ids = [int(frame.id) for frame in self.frames if frame.id is not None]
        return max(ids, default=0)

    def seen(self) -> list[dict[str, Any]]:
        return check_view(self.frames)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


def long_tail(workflow_id: str, *, long_ms: int = 20_000) -> dict[str, Any]:
    """s0 → s1 (short) → long (a long delay) → end: an owner idle in ``long``."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "s0", "type": "delay", "config": {"ms": 200}},
            {"id": "s1", "type": "delay", "config": {"ms": 200}},
            {"id": "long", "type": "delay", "config": {"ms": long_ms}},
            {"id": "end", "type": "transform", "config": {"value": "{{ blocks.s0.output }}"}},
        ],
        "edges": [
            {"from": "s0", "to": "s1"},
            {"from": "s1", "to": "long"},
            {"from": "long", "to": "end"},
        ],
    }


# -- 1. the store comes back from an older snapshot while the owner sits in a block -----


@pytest.mark.parametrize("fault", ["sigkill", "sigterm"])
async def test_older_snapshot_while_the_owner_is_idle_then_it_goes_numbers_above_what_was_seen(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """A runs s0, s1, then sits in a 20 s block (its writer is idle). Redis comes back
    from a snapshot taken right after s0 completed: s1's events, the start of ``long``
    and s1's checkpoint are lost, though a client saw them. A's renewals go on (same
    owner); nothing writes the lost part back while A writes no event. Once the store
    settled, A is SIGKILLed (or SIGTERMed: a hand-off). B takes over: it must number
    above every id the client saw (SPEC §4) and must not run s1 again (SPEC §7)."""
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
            # One more lease: every owner had all the time the design gives it.
            await asyncio.sleep(1.5)
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


async def _saw(reader: LiveReader, kind: str, block: str) -> bool:
    return any(
        frame.event == kind and frame.json["data"].get("blockId") == block
        for frame in reader.frames
    )


async def test_older_snapshot_from_before_a_recovery_while_the_new_owner_is_idle(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A runs; a snapshot is taken; A is SIGKILLed and B recovers (recovery 1, stored,
    seen live) then sits in a long block. Redis comes back from the snapshot (from
    before the recovery). B's renewals take the execution back (epoch above) but write
    nothing else. B is SIGTERMed: C's recovery must be number 2, not a second 1, and
    no id a client saw may name another event."""
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
            await asyncio.sleep(1.5)
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


async def _recoveries_at_least(client: httpx.AsyncClient, eid: str, n: int) -> bool:
    """A hand-off recovery is stored (C took over from B)."""
    with contextlib.suppress(httpx.TransportError, KeyError):
        stored = await all_events(client, eid)
        return any(
            e["type"] == "execution:recovered" and e["data"]["reason"] == "handoff" for e in stored
        )
    return False


# -- 2. the owner dies while the store is down ----------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason=(
        "known limit: SPEC §5 has the owner show events live while Redis is down, above "
        "any id Redis reserved; if the owner then dies before Redis is back, nobody knows "
        "those ids and the next owner numbers from the reserved one"
    ),
)
async def test_owner_killed_while_valkey_is_down_its_live_ids_are_not_given_again(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Valkey goes down (then comes back from its AOF: nothing acknowledged is lost).
    Meanwhile the owner goes on and shows its events live (SPEC §5: clients attached to
    the owner keep receiving events); then it is SIGKILLed before Valkey is back. B
    takes over: the ids the client saw during the outage must not be given to B's
    events (SPEC §4)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = chain("downkill", blocks=20, ms=150)  # A dies around s5: 15 blocks to spare
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:
            await until(lambda: _saw(live, "block:completed", "s1"), "client saw s1")
            stored_before = int(await meta_field(valkey, eid, "lastId") or 0)
            valkey.kill()
            try:
                await until(
                    _async(lambda: live.last_id() >= stored_before + 6),
                    "the client saw events emitted during the outage",
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
    check_lossy_log(stored_now, dropped=_dropped_ranges(replay))
    same_ids_same_events(seen, stored_now)
    assert snapshot["status"] == "completed", snapshot


def _async(check: Any) -> Any:
    async def wrapped() -> bool:
        return bool(check())

    return wrapped


# -- 3. tenant admission around a recovery and a store loss ---------------------------


async def test_a_crashed_execution_still_counts_for_its_tenant_until_recovered(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1. X runs on A; A is SIGKILLed. X is still
    unfinished (running, about to be recovered): the tenant may start nothing else
    meanwhile (SPEC §8), neither between A's lease end and B's takeover nor after it;
    and once X completed, a new execution is admitted (no permanent 429)."""
    env = {"FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "1"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # The cap is probed until s1 completed on B (A's lease end, B's takeover and 3 s
        # after it); a longer chain only made the test wait for its end.
        await put(http_for(http, a), chain("capx", blocks=2, ms=1500))
        await put(http_for(http, a), chain("capy", blocks=1, ms=10))
        x = await execute(http_for(http, a), "capx")
        await until(lambda: has_event(http_for(http, b), x, "block:started"), "x started")
        await kill_replica(a)
        accepted: list[tuple[str, float]] = []
        killed_at = time.monotonic()
        on_b = http_for(http, b)
        while not await has_event(on_b, x, "block:completed", "s1"):
            response = await on_b.post("/api/workflows/capy/execute", json={"input": None})
            if response.status_code == 202:
                accepted.append((response.json()["executionId"], time.monotonic() - killed_at))
            else:
                assert response.status_code == 429, response.text
            await asyncio.sleep(0.02)
        snapshot = await finished(on_b, x)
        later = await on_b.post("/api/workflows/capy/execute", json={"input": None})
        stored = await all_events(on_b, x)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)
    assert later.status_code == 202, later.text
    assert not accepted, (
        f"with a cap of 1, executions were admitted while X (crashed, then recovered) was "
        f"unfinished: {accepted} (seconds after the kill)"
    )


@pytest.mark.parametrize("fault", ["wipe", "older"])
async def test_a_running_execution_still_counts_for_its_tenant_after_the_store_lost_it(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1. X runs on A. Redis comes back empty (or from
    a snapshot from before X started): A recreates X and carries on, but X's entry in
    the tenant's running set is gone and renewals only refresh listed entries (watch.lua
    "refresh", ZADD XX). X is running: a second execution must be refused 429."""
    env = {"FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "1"}
    a = replica(valkey, tmp_path, "a", **env)
    async with running(a), httpx.AsyncClient(timeout=30) as http:
        wf = chain("capwipe", blocks=30, ms=400)
        await put(http_for(http, a), wf)
        await put(http_for(http, a), chain("capone", blocks=1, ms=10))
        snap = await take_snapshot(valkey, tmp_path / "empty.rdb")
        x = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), x, "block:completed", "s0"), "s0")
        if fault == "wipe":
            await crash_and_wipe(valkey)
        else:
            await crash_and_restore(valkey, snap)
        await put(http_for(http, a), wf)
        await put(http_for(http, a), chain("capone", blocks=1, ms=10))
        await until(lambda: has_event(http_for(http, a), x, "block:started"), "X recreated")
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await asyncio.sleep(1.0)  # a few renewals of X's lease
        second = await http_for(http, a).post("/api/workflows/capone/execute", json={"input": 1})
        status_of_x = (await http_for(http, a).get(f"/api/executions/{x}")).json()["status"]
    assert status_of_x == "running"
    assert second.status_code == 429, (
        f"X is running but the tenant (cap 1) got {second.status_code} for a second "
        f"execution: {second.text}"
    )


async def test_a_pause_restored_after_the_store_lost_it_still_counts_for_its_tenant(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1, paused ones included (SPEC §8). X pauses on
    A; Redis comes back empty; A re-asserts the pause (finals.py) so X can be resumed.
    X is unfinished: another execution must be refused 429; the resume still works."""
    env = {"FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "1"}
    a = replica(valkey, tmp_path, "a", **env)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    wf = {
        "id": "cappause",
        "blocks": [
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": schema}},
            {"id": "echo", "type": "transform", "config": {"value": "{{ blocks.review.output }}"}},
        ],
        "edges": [{"from": "review", "to": "echo"}],
    }
    async with running(a), httpx.AsyncClient(timeout=30) as http:
        on_a = http_for(http, a)
        await put(on_a, wf)
        await put(on_a, chain("capother", blocks=1, ms=10))
        x = await execute(on_a, "cappause")
        await until(lambda: _status(on_a, x, "paused"), "X paused")
        await crash_and_wipe(valkey)
        await put(on_a, wf)
        await put(on_a, chain("capother", blocks=1, ms=10))
        await until(lambda: _status(on_a, x, "paused"), "X's pause re-asserted", timeout=20)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        other = await on_a.post("/api/workflows/capother/execute", json={"input": 1})
        assert other.status_code == 429, (
            f"X is paused (restored) but the tenant (cap 1) got {other.status_code}: {other.text}"
        )
        resume = await on_a.post(f"/api/executions/{x}/resume", json={"input": {"ok": True}})
        assert resume.status_code == 202, resume.text
        snapshot = await finished(on_a, x)
    assert snapshot["status"] == "completed", snapshot


async def _status(client: httpx.AsyncClient, eid: str, status: str) -> bool:
    with contextlib.suppress(httpx.TransportError, KeyError):
        return bool((await client.get(f"/api/executions/{eid}")).json()["status"] == status)
    return False


# -- 4. large input, owner killed at the 202 ------------------------------------------------


async def test_a_large_input_survives_an_owner_killed_at_its_202(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Input > 8 KiB (stored as a ref in the value store, shared by the replicas as the
    README requires). A is SIGKILLed right after the 202: B recovers with
    execution:started (carrying the input) then execution:recovered, and completes
    with the input intact."""
    env = {"FLOWCAST_DATA_DIR": str(tmp_path / "shared")}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    big = {"text": "x" * 20_000, "n": 7}
    wf = {
        "id": "bigin",
        "blocks": [
            {"id": "wait", "type": "delay", "config": {"ms": 300}},
            {"id": "echo", "type": "transform", "config": {"value": "{{ input.n }}"}},
        ],
        "edges": [{"from": "wait", "to": "echo"}],
    }
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        response = await http_for(http, a).post("/api/workflows/bigin/execute", json={"input": big})
        await kill_replica(a)
        assert response.status_code == 202, response.text
        eid = response.json()["executionId"]
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    check_log(stored)
    assert snapshot["status"] == "completed", (snapshot, [e["type"] for e in stored])
    started = stored[0]["data"]["input"]
    if isinstance(started, dict) and started.get("$ref") == "value":
        assert started["size"] > 8 * 1024
    else:
        assert started == big
    assert snapshot["output"] == {"echo": 7}, snapshot


# -- 5. shutdown with the store paused or down ------------------------------------------------


@pytest.mark.parametrize("fault", ["paused", "down"])
async def test_sigterm_with_the_store_paused_or_down_exits_promptly_and_nothing_is_stuck(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """SIGTERM A (running executions) while Valkey refuses writes for 4 s (CLIENT PAUSE
    WRITE: four leases, four graces) or is down until A has exited. A must exit within
    its grace plus a few seconds with no "tasks did not stop"; B must finish every
    execution (handed off, or recovered once A's lease expired), none failed."""
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
    assert took < 1 + 10 + 6, f"process {pid} took {took:.1f} s to exit after SIGTERM"
    for log in stored:
        check_recovered(log)
    assert statuses == ["completed"] * len(started), statuses
