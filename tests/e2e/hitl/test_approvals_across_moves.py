"""Approvals and resumes across a move of their execution (SPEC §7): a resume
accepted as its replica goes takes effect elsewhere, once, and an approval after a
recovery pauses once.

Replicas share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of
replicas and Valkey restarted from an older snapshot, empty, paused or down. Every stored
log goes through tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, execute, put, until
from tests.support.faults import (
    FaultyValkey,
    kill_replica,
    replica,
    terminate_replica,
)
from tests.support.recovery import (
    DEADLINE,
    approval_flow,
    check_recovered,
    finished,
    has_event,
    http_for,
    running,
    settled,
    snapshot_of,
    valkey,
)

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


async def _status_is(client: httpx.AsyncClient, execution_id: str, status: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return bool((await snapshot_of(client, execution_id))["status"] == status)
    return False


@pytest.mark.timeout(150)
async def test_a_resume_accepted_as_its_replica_gets_sigterm_takes_effect_elsewhere(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("rsterm", after_ms=1500))
        eid = await execute(http_for(http, a), "rsterm")
        await until(
            lambda: _status_is(http_for(http, a), eid, "paused"), "paused", timeout=DEADLINE
        )
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
            resume = await on_a.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
        code = await terminate_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202, resume.text
    assert code in (0, -signal.SIGTERM)
    assert snapshot["status"] == "completed", (snapshot, [e["type"] for e in stored])
    check_recovered(stored)
    assert snapshot["output"] == {"echo": {"ok": True}}
    review_starts = [
        e for e in stored if e["type"] == "block:started" and e["data"]["blockId"] == "review"
    ]
    assert [e["type"] for e in stored].count("execution:resumed") == 1
    assert len(review_starts) <= 2, review_starts


@pytest.mark.timeout(150)
async def test_an_approval_after_a_recovery_pauses_and_resumes_once(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("aprec", before_ms=1500))
        eid = await execute(http_for(http, a), "aprec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started", "wait"), "wait")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            await until(lambda: _status_is(on_b, eid, "paused"), "paused after recovery")
            resume = await on_b.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            again = await on_b.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202, resume.text
    assert again.status_code == 409, again.text
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)
    assert snapshot["output"] == {"echo": {"ok": True}}


@pytest.mark.timeout(150)
async def test_a_paused_execution_resumed_then_its_runner_killed_completes_and_answer_kept(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Resume (202) on A, A is SIGKILLed while the block after the approval runs: B
    recovers; the answered approval does not pause again and the answer reaches echo.
    Found by the step 11 review."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("rskill", after_ms=1500))
        eid = await execute(http_for(http, a), "rskill")
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
            await until(lambda: _status_is(on_a, eid, "paused"), "paused")
            resume = await on_a.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            await until(lambda: has_event(on_a, eid, "block:started", "after"), "after runs")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202
    assert snapshot["status"] == "completed", (snapshot, [e["type"] for e in stored])
    check_recovered(stored, moves=1)
    assert snapshot["output"] == {"echo": {"ok": True}}
    assert [e["type"] for e in stored].count("execution:paused") == 1
