"""Replicas SIGKILLed or SIGTERMed mid-run (SPEC §7): whoever is left, or a new
replica, finishes every execution, each recovery numbered once and no completed block
run again.

Replicas share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of
replicas and Valkey restarted from an older snapshot, empty, paused or down. Every stored
log goes through tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, execute, put, until
from tests.support.faults import (
    FaultyValkey,
    fresh_replica,
    kill_replica,
    replica,
    terminate_replica,
)
from tests.support.logcheck import check_log, check_lossy_log, check_view
from tests.support.recovery import (
    DEADLINE,
    chain,
    check_recovered,
    finished,
    follow_on,
    has_event,
    http_for,
    running,
    settled,
    valkey,
)
from tests.support.sse import follow

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


# -- two replicas SIGTERMed at once, then a new one --------------------------------


@pytest.mark.timeout(150)
async def test_both_replicas_sigtermed_at_once_then_a_new_one_finishes_everything(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A rolling restart gone wrong: both replicas get SIGTERM together. Each hands its
    executions off; the other is shutting down and must not take them (or must hand them
    off again). A replica started afterwards must finish every one, none failed.
    Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        # The drain starts no new block: every run is handed off with blocks left.
        wf = chain("both", blocks=4, ms=500)
        await put(http_for(http, a), wf)
        started = [await execute(http_for(http, a), "both") for _ in range(4)]
        started += [await execute(http_for(http, b), "both") for _ in range(4)]

        async def all_running() -> bool:
            return all(
                [await has_event(http_for(http, a), eid, "block:started") for eid in started]
            )

        await until(all_running, "every execution runs a block")
        codes = await asyncio.gather(terminate_replica(a), terminate_replica(b))
        assert all(code in (0, -signal.SIGTERM) for code in codes), codes
        c = await fresh_replica(a)
        alive.append(c)
        statuses = [(await finished(http_for(http, c), eid))["status"] for eid in started]
        logs = [await all_events(http_for(http, c), eid) for eid in started]
    assert statuses == ["completed"] * len(started), statuses
    for stored in logs:
        check_recovered(stored)
        assert stored[-1]["data"]["output"] == {"end": {"waitedMs": 500}}


# -- double crash: the replica that just took over is SIGKILLed too ----------------


@pytest.mark.timeout(150)
async def test_the_replica_that_took_over_is_killed_too_and_a_third_finishes(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("dbl", blocks=4, ms=600))  # B dies within s1
        eid = await execute(http_for(http, a), "dbl")
        reader = asyncio.create_task(follow_on(b, eid))
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        await kill_replica(a)
        await until(lambda: has_event(http_for(http, b), eid, "execution:recovered"), "B took over")
        await kill_replica(b)
        c = await fresh_replica(a)
        alive.append(c)
        snapshot = await finished(http_for(http, c), eid)
        stored = await all_events(http_for(http, c), eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader, 1)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=2)


@pytest.mark.timeout(150)
async def test_the_new_owner_killed_right_after_its_claim_still_numbers_recoveries_1_2(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Kill the replica that took over the instant its claim is in Redis (before it
    stored its execution:recovered). The next recovery must still be told apart: each
    recovery emits exactly one execution:recovered, numbered 1, 2, … Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    redis = Redis.from_url(valkey.url)
    try:
        async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
            await put(http_for(http, a), chain("claimkill", blocks=2, ms=600))
            eid = await execute(http_for(http, a), "claimkill")
            await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
            await kill_replica(a)

            async def claimed() -> bool:
                return await redis.hget(f"fc:{{{eid}}}:meta", "recoveries") == b"1"

            async with asyncio.timeout(DEADLINE):
                while not await claimed():
                    pass  # as tight as a loop can: kill B right after its claim
            await kill_replica(b)
            c = await fresh_replica(a)
            alive.append(c)
            snapshot = await finished(http_for(http, c), eid)
            stored = await all_events(http_for(http, c), eid)
    finally:
        await redis.aclose()
    assert snapshot["status"] == "completed", snapshot
    recovered = [e["data"]["recovery"] for e in stored if e["type"] == "execution:recovered"]
    check_log(stored)
    assert recovered == list(range(1, len(recovered) + 1)), (
        f"recovery numbers in the log: {recovered}"
    )


# -- retries across a recovery ------------------------------------------------------


@pytest.mark.timeout(150)
async def test_retries_across_a_recovery_continue_the_attempts_and_keep_the_budget(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A block with retry.attempts = 3 fails attempt 1 and waits its backoff; the owner
    dies meanwhile. The recovery runs the next attempt (2): numbers continue, no
    attempt number is used twice, and the block is not given a fresh budget of 3.
    Found by the step 11 review."""
    env = {"FLOWCAST_PLUGINS": "tests.support.plugins"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    workflow = {
        "id": "retries",
        "blocks": [
            {
                "id": "talk",
                "type": "python",
                "config": {"name": "flaky", "args": {"words": 2, "succeedOn": 9}},
                "retry": {"attempts": 3, "backoffMs": 2500},
            }
        ],
        "edges": [],
    }
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "retries")
        await until(lambda: has_event(http_for(http, b), eid, "block:failed"), "attempt 1 failed")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    check_log(stored)
    starts = [e["data"]["attempt"] for e in stored if e["type"] == "block:started"]
    failures = [
        (e["data"]["attempt"], e["data"]["willRetry"])
        for e in stored
        if e["type"] == "block:failed"
    ]
    assert starts == sorted(set(starts)) and starts[0] == 1, starts
    assert snapshot["status"] == "failed", snapshot
    assert len(starts) <= 3, (
        f"retry.attempts is 3 but the block ran {len(starts)} attempts {starts}; "
        f"failures {failures}"
    )


# -- large outputs across a recovery --------------------------------------------------


@pytest.mark.timeout(150)
async def test_recovered_outputs_kept_as_refs_feed_downstream_templates(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    # One value store for both (as S3 would be in production): a shared data dir.
    """Found by the step 11 review."""
    env = {
        "FLOWCAST_EVENT_BUDGET_BYTES": "200000",
        "FLOWCAST_EVENT_LIMIT": "50",
        "FLOWCAST_DATA_DIR": str(tmp_path / "shared"),
    }
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    workflow = {
        "id": "bigrec",
        "blocks": [
            {"id": "big", "type": "payload", "config": {"bytes": 150_000, "shape": "array"}},
            {"id": "mid", "type": "payload", "config": {"bytes": 30_000}},
            {"id": "obj", "type": "payload", "config": {"bytes": 60_000, "shape": "object"}},
            {"id": "wait", "type": "delay", "config": {"ms": 1500}},
            {
                "id": "use",
                "type": "transform",
                "config": {
                    "value": {
                        "n": "{{ blocks.big.output | length }}",
                        "m": "{{ blocks.mid.output | length }}",
                        "k": "{{ blocks.obj.output | length }}",
                        "head": "{{ blocks.mid.output[:5] }}",
                    }
                },
            },
        ],
        "edges": [
            {"from": "big", "to": "mid"},
            {"from": "mid", "to": "obj"},
            {"from": "obj", "to": "wait"},
            {"from": "wait", "to": "use"},
        ],
    }
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "bigrec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started", "wait"), "waiting")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        view = await follow(http_for(http, b), eid)
    check_lossy_log(stored)
    check_view(view)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored[-1])
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert len(recovered) == 1 and recovered[0]["data"]["completed"] == ["big", "mid", "obj"], (
        recovered
    )
    # The recovered checkpoint really held refs into the value store.
    outputs = [e["data"]["output"] for e in stored if e["type"] == "block:completed"]
    assert any(isinstance(o, dict) and o.get("$ref") == "value" for o in outputs), outputs
    assert snapshot["output"]["use"] == {
        "n": 146,
        "m": 29_998,
        "k": 58,
        "head": "abcde",
    }, snapshot["output"]


# -- MAX_RECOVERIES=0 and a SIGTERM ------------------------------------------------------


@pytest.mark.timeout(150)
async def test_recovery_off_still_hands_off_at_sigterm(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    env = {"FLOWCAST_MAX_RECOVERIES": "0"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("norec", blocks=4, ms=500))
        eid = await execute(http_for(http, a), "norec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)


# -- parallel branches killed mid-flight --------------------------------------------------


@pytest.mark.timeout(150)
async def test_parallel_branches_killed_mid_flight_rerun_only_the_unfinished(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    blocks: list[dict[str, Any]] = [{"id": "root", "type": "transform", "config": {"value": 1}}]
    edges = []
    for index in range(6):
        blocks.append({"id": f"p{index}", "type": "delay", "config": {"ms": 200 + 500 * index}})
        edges.append({"from": "root", "to": f"p{index}"})
    blocks.append(
        {"id": "join", "type": "transform", "config": {"value": "{{ blocks.p5.output }}"}}
    )
    edges += [{"from": f"p{index}", "to": "join"} for index in range(6)]
    workflow = {"id": "par", "blocks": blocks, "edges": edges}
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "par")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "p1"), "p1 done")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        view = await follow(http_for(http, b), eid)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)
    assert check_view(view) == stored
    recovered = next(e for e in stored if e["type"] == "execution:recovered")
    kept = set(recovered["data"]["completed"])
    rerun = set(recovered["data"]["rerun"])
    assert {"root", "p0", "p1"} <= kept, recovered["data"]
    assert not kept & rerun


# -- large input, owner killed at the 202 ------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_large_input_survives_an_owner_killed_at_its_202(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Input > 8 KiB (stored as a ref in the value store, shared by the replicas as the
    README requires). A is SIGKILLed right after the 202: B recovers with
    execution:started (carrying the input) then execution:recovered, and completes
    with the input intact. Found by the step 11 review (round 2)."""
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
