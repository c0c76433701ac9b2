"""A cancel that lands while its execution moves between replicas (SPEC §7): handed
off, crashed or waiting for a replica, it ends ``cancelled``.

Replicas share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of
replicas and Valkey restarted from an older snapshot, empty, paused or down. Every stored
log goes through tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, execute, put, until
from tests.support.faults import (
    LEASE_SECONDS,
    FaultyValkey,
    fresh_replica,
    kill_replica,
    replica,
    terminate_replica,
)
from tests.support.logcheck import check_log, check_view
from tests.support.recovery import (
    DEADLINE,
    chain,
    finished,
    has_event,
    http_for,
    running,
    settled,
    valkey,
)
from tests.support.sse import follow

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


# -- cancel racing a hand-off / a takeover ----------------------------------------


@pytest.mark.timeout(150)
async def test_a_cancel_accepted_while_the_execution_is_handed_off_ends_it_cancelled(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A hands off at SIGTERM; a cancel lands on B at the instant the execution has no
    owner (owner "", handoff set). The 202 must take effect: ends ``cancelled``.
    Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    redis = Redis.from_url(valkey.url)
    try:
        async with running(a, b), httpx.AsyncClient(timeout=30) as http:
            await put(http_for(http, a), chain("cxho", blocks=6, ms=500))
            eid = await execute(http_for(http, a), "cxho")
            await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
            stopping = asyncio.create_task(terminate_replica(a))

            async def handed() -> bool:
                return bool(await redis.hexists(f"fc:{{{eid}}}:meta", "handoff"))

            async with asyncio.timeout(DEADLINE):
                while not await handed():
                    pass
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
                cancel = await on_b.post(f"/api/executions/{eid}/cancel")
                await stopping
                snapshot = await finished(on_b, eid)
                stored = await all_events(on_b, eid)
                view = await follow(on_b, eid)
    finally:
        await redis.aclose()
    assert cancel.status_code == 202, cancel.text
    assert snapshot["status"] == "cancelled", (snapshot, [e["type"] for e in stored])
    check_log(stored)
    assert check_view(view) == stored


@pytest.mark.timeout(150)
async def test_a_cancel_of_a_crashed_execution_racing_its_takeover_ends_it_cancelled(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("cxto", blocks=6, ms=500))
        results = []
        for turn in range(3):
            eid = await execute(http_for(http, a), "cxto")
            await until(lambda e=eid: has_event(http_for(http, b), e, "block:started"), "started")
            await kill_replica(a)
            await asyncio.sleep(LEASE_SECONDS * 0.9)  # the fault timing: around lease end
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
                cancel = await on_b.post(f"/api/executions/{eid}/cancel")
                snapshot = await finished(on_b, eid)
                stored = await all_events(on_b, eid)
            results.append((cancel.status_code, snapshot["status"], [e["type"] for e in stored]))
            check_log(stored)
            if turn < 2:  # A again for the next turn
                await a.start()
    for code, status, types in results:
        assert code == 202, (code, status)
        assert status == "cancelled", (status, types)


# -- handed off with nobody left, then cancel on a new replica ----------------------------


@pytest.mark.timeout(150)
async def test_handed_off_with_nobody_alive_then_a_new_replica_and_a_cancel(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """The only replica is SIGTERMed: its execution waits handed off. A new replica
    starts and a cancel arrives at once: the 202 wins, the execution ends cancelled.
    Found by the step 11 review."""
    only = replica(valkey, tmp_path, "only")
    async with running(only) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, only), chain("alone", blocks=6, ms=800))
        eid = await execute(http_for(http, only), "alone")
        await until(lambda: has_event(http_for(http, only), eid, "block:started"), "started")
        await terminate_replica(only)
        again = await fresh_replica(only)
        alive.append(again)
        cancel = await http_for(http, again).post(f"/api/executions/{eid}/cancel")
        snapshot = await finished(http_for(http, again), eid)
        stored = await all_events(http_for(http, again), eid)
    assert cancel.status_code == 202, cancel.text
    assert snapshot["status"] == "cancelled", (snapshot, [e["type"] for e in stored])
    check_log(stored)
