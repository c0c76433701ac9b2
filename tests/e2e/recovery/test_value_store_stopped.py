"""A value store that answers nothing (moto's S3 stopped with SIGSTOP: an endpoint
black-holed) holds up neither a start, nor a run's end, nor a replica's shutdown
(SPEC §5: "Buffer outages never fail, stall or slow the workflow's work"; §7 shutdown),
nor leaves a resume or a cancel unanswered after Valkey came back empty.

Since the durable records (ceiling.py, finals.py) an owner writes one to the value store
as its run ends; the replica's own moto server here, so stopping it touches no other test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lib.execution.store import SETTLE_GRACE_SECONDS, SETTLE_SECONDS
from lib.workflows.takeovers import RECALL_MUTE_SECONDS, RECALL_SECONDS, UNSEEN_RECALL_SECONDS
from tests.support.api import execute, put, until
from tests.support.faults import (
    LEASE_SECONDS,
    FaultyValkey,
    crash_and_wipe,
    replica,
    terminate_replica,
)
from tests.support.recovery import (
    approval_flow,
    chain,
    finished,
    has_event,
    http_for,
    running,
    settled,
    settled_store,
    valkey,
)
from tests.support.s3 import MotoServer, shared_bucket
from tests.support.timing import assert_below_timer

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


@pytest.fixture
async def own_moto(tmp_path: Path) -> AsyncIterator[MotoServer]:
    server = MotoServer(log_path=tmp_path / "moto.log")
    await server.start()
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await server.stop()


async def _run_then_terminate(
    valkey: FaultyValkey, root: Path, bucket: dict[str, str], moto: MotoServer, *, stop: bool
) -> tuple[str, float]:
    """One replica runs a short chain to its end (the value store stopped first if
    ``stop``), then is SIGTERMed: the run's status and how long the exit took."""
    one = replica(valkey, root, "stopped" if stop else "probe", **bucket)
    async with running(one), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, one), chain("short", blocks=2, ms=50))
        if stop:
            os.kill(moto.pid, signal.SIGSTOP)
        eid = await execute(http_for(http, one), "short")
        status = (await finished(http_for(http, one), eid))["status"]
        began = time.monotonic()
        await terminate_replica(one, timeout=120)
        return status, time.monotonic() - began


@pytest.mark.timeout(180)
async def test_a_stopped_value_store_does_not_hold_a_shutdown_after_the_runs_ended(
    valkey: FaultyValkey, tmp_path: Path, own_moto: MotoServer
) -> None:
    """A replica whose run ended while the value store answered nothing exits on
    SIGTERM within a few leases of a probe replica's exit with the store up: its run's
    task waited for the final record's PUT (boto3: 60 s timeouts, retried) and held
    the drain for the grace and 10 s more (11.5 s against a 0.22 s probe, 1 s grace).
    Found by the h1 fresh-eyes review."""
    bucket = await shared_bucket(own_moto)
    status, probe = await _run_then_terminate(valkey, tmp_path, bucket, own_moto, stop=False)
    assert status == "completed"
    status, stopped = await _run_then_terminate(valkey, tmp_path, bucket, own_moto, stop=True)
    assert status == "completed"  # the run's end does not wait on the value store
    print(f"\nSIGTERM to exit: {probe:.2f} s (probe), {stopped:.2f} s (value store stopped)")
    assert stopped < 3 * probe + 4 * LEASE_SECONDS, (probe, stopped)


async def _answered(client: httpx.AsyncClient, url: str, body: Any) -> tuple[int, float]:
    began = time.monotonic()
    response = await client.post(url, json=body)
    return response.status_code, time.monotonic() - began


@pytest.mark.timeout(180)
async def test_a_resume_and_a_cancel_after_redis_came_back_empty_are_answered_s3_stopped(
    valkey: FaultyValkey, tmp_path: Path, own_moto: MotoServer
) -> None:
    """Valkey came back empty (a pause and a running execution stored again by their
    process), and the value store answers nothing. The store is behind (store.lua), so
    a claim first reads the owners' durable ceilings there; it read them unbounded, and
    a resume stayed unanswered for over 170 s (boto3's timeouts and retries; before
    e37bdfa an emptied store was not behind, and both answered 202 at once). Each is
    answered within RECALL_SECONDS (503: what the store forgot cannot be told yet),
    and once the value store is back, both are accepted and both executions end.
    Found by the fresh-eyes review of e37bdfa."""
    one = replica(valkey, tmp_path, "one", **await shared_bucket(own_moto))
    async with running(one), httpx.AsyncClient(timeout=120) as http:
        client = http_for(http, one)
        await put(client, approval_flow("ask"))
        await put(client, chain("steps", blocks=60, ms=300))
        paused = await execute(client, "ask")
        await until(lambda: has_event(client, paused, "execution:paused"), "paused")
        busy = await execute(client, "steps")
        await until(lambda: has_event(client, busy, "block:completed"), "running")
        os.kill(own_moto.pid, signal.SIGSTOP)
        try:
            await crash_and_wipe(valkey)
            await until(lambda: has_event(client, paused, "execution:paused"), "pause restored")
            await until(lambda: has_event(client, busy, "block:completed"), "run recreated")
            await until(lambda: settled_store(valkey), "the store settled", timeout=20)
            resume = (f"/api/executions/{paused}/resume", {"input": {"ok": True}})
            cancel = (f"/api/executions/{busy}/cancel", None)
            answers = [await _answered(client, *request) for request in (resume, cancel)]
        finally:
            os.kill(own_moto.pid, signal.SIGCONT)
        print(f"\nresume, cancel with the value store stopped: {answers}")
        bound = RECALL_SECONDS + SETTLE_SECONDS + SETTLE_GRACE_SECONDS + 5.0
        for (status, took), what in zip(answers, ("resume", "cancel"), strict=True):
            assert status in (202, 503), (what, status)
            assert_below_timer(took, bound=bound, timer="RECALL_SECONDS", what=what)
        # The value store back, each is accepted (or meets the state that won).
        for (status, _took), (url, body) in zip(answers, (resume, cancel), strict=True):
            if status == 503:

                async def accepted(url: str = url, body: Any = body) -> bool:
                    return (await client.post(url, json=body)).status_code != 503

                await until(accepted, f"{url} answered", timeout=60, every=0.5)
        outcomes = [(await finished(client, eid))["status"] for eid in (paused, busy)]
    assert outcomes == ["completed", "cancelled"], outcomes


@pytest.mark.timeout(120)
async def test_resumes_wait_on_a_stopped_value_store_once_and_briefly_while_the_store_is_whole(
    valkey: FaultyValkey, tmp_path: Path, own_moto: MotoServer
) -> None:
    """Every resume, cancel and takeover asks the value store how the run ended (a
    restore no live process saw may have brought it back paused after it completed).
    With the store whole that is a check only: with the value store answering nothing,
    the first resume waits UNSEEN_RECALL_SECONDS at most and the next ones within
    RECALL_MUTE_SECONDS do not ask. Before, each waited RECALL_SECONDS (5 s), and
    takeovers one after another (the fresh-eyes review of 5b82f0d)."""
    one = replica(valkey, tmp_path, "one", **await shared_bucket(own_moto))
    async with running(one), httpx.AsyncClient(timeout=60) as http:
        client = http_for(http, one)
        await put(client, approval_flow("ask"))
        paused = [await execute(client, "ask") for _ in range(4)]
        for eid in paused:
            await until(lambda eid=eid: has_event(client, eid, "execution:paused"), "paused")
        os.kill(own_moto.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            answers = [
                await _answered(client, f"/api/executions/{eid}/resume", {"input": {"ok": True}})
                for eid in paused
            ]
            took = time.monotonic() - began
        finally:
            os.kill(own_moto.pid, signal.SIGCONT)
        print(f"\nresumes with the value store stopped: {answers}")
        assert [status for status, _ in answers] == [202] * 4
        assert_below_timer(
            answers[0][1], bound=UNSEEN_RECALL_SECONDS + 2.0, timer="UNSEEN_RECALL_SECONDS",
            what="the first resume",
        )  # fmt: skip
        rest = sum(seconds for _, seconds in answers[1:])
        assert took < RECALL_MUTE_SECONDS, took
        assert_below_timer(
            rest, bound=UNSEEN_RECALL_SECONDS, timer="RECALL_MUTE_SECONDS",
            what="the next three resumes, asking nothing",
        )  # fmt: skip
        outcomes = [(await finished(client, eid))["status"] for eid in paused]
    assert outcomes == ["completed"] * 4, outcomes
