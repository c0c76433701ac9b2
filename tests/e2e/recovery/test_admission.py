"""Tenant admission across a crash and a store loss (SPEC §8): an execution counts for
its tenant until it really ended, whether its owner died or the store forgot it.

Replicas share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of
replicas and Valkey restarted from an older snapshot, empty, paused or down. Every stored
log goes through tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, execute, put, until
from tests.support.faults import (
    FaultyValkey,
    crash_and_restore,
    crash_and_wipe,
    kill_replica,
    replica,
    take_snapshot,
)
from tests.support.recovery import (
    chain,
    check_recovered,
    finished,
    has_event,
    http_for,
    running,
    settled,
    settled_store,
    valkey,
)
from tests.support.timing import hold_for

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


async def _status(client: httpx.AsyncClient, eid: str, status: str) -> bool:
    with contextlib.suppress(httpx.TransportError, KeyError):
        return bool((await client.get(f"/api/executions/{eid}")).json()["status"] == status)
    return False


# -- tenant admission around a recovery and a store loss ---------------------------


@pytest.mark.timeout(180)
async def test_a_crashed_execution_still_counts_for_its_tenant_until_recovered(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1. X runs on A; A is SIGKILLed. X is still
    unfinished (running, about to be recovered): the tenant may start nothing else
    meanwhile (SPEC §8), neither between A's lease end and B's takeover nor after it;
    and once X completed, a new execution is admitted (no permanent 429).
    Found by the step 11 review (round 2)."""
    env = {"FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "1"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # The cap is probed until s1 completed on B (A's lease end, B's takeover and 3 s
        # after it), while s2 still runs: probed up to X's last block, a request sent
        # just after X ended was admitted, rightly, and read as a breach.
        await put(http_for(http, a), chain("capx", blocks=3, ms=1500))
        await put(http_for(http, a), chain("capy", blocks=1, ms=10))
        x = await execute(http_for(http, a), "capx")
        await until(lambda: has_event(http_for(http, b), x, "block:started"), "x started")
        await kill_replica(a)
        accepted: list[tuple[str, float]] = []
        killed_at = time.monotonic()
        on_b = http_for(http, b)

        async def probed_until_x_moved_on() -> bool:
            if await has_event(on_b, x, "block:completed", "s1"):
                return True
            response = await on_b.post("/api/workflows/capy/execute", json={"input": None})
            if response.status_code == 202:
                accepted.append((response.json()["executionId"], time.monotonic() - killed_at))
            else:
                assert response.status_code == 429, response.text
            return False

        await until(probed_until_x_moved_on, "X recovered past s1", None)
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["wipe", "older"])
async def test_a_running_execution_still_counts_for_its_tenant_after_the_store_lost_it(
    valkey: FaultyValkey, tmp_path: Path, fault: str
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1. X runs on A. Redis comes back empty (or from
    a snapshot from before X started): A recreates X and carries on, but X's entry in
    the tenant's running set is gone and renewals only refresh listed entries (watch.lua
    "refresh", ZADD XX). X is running: a second execution must be refused 429.
    Found by the step 11 review (round 2)."""
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
        await hold_for(1.0, "a few renewals of X's lease, none of which may uncount it")
        second = await http_for(http, a).post("/api/workflows/capone/execute", json={"input": 1})
        status_of_x = (await http_for(http, a).get(f"/api/executions/{x}")).json()["status"]
    assert status_of_x == "running"
    assert second.status_code == 429, (
        f"X is running but the tenant (cap 1) got {second.status_code} for a second "
        f"execution: {second.text}"
    )


@pytest.mark.timeout(180)
async def test_a_pause_restored_after_the_store_lost_it_still_counts_for_its_tenant(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """FLOWCAST_MAX_EXECUTIONS_PER_TENANT=1, paused ones included (SPEC §8). X pauses on
    A; Redis comes back empty; A re-asserts the pause (finals.py) so X can be resumed.
    X is unfinished: another execution must be refused 429; the resume still works.
    Found by the step 11 review (round 2)."""
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
