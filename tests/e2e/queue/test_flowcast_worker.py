"""``flowcast worker`` (SPEC §14): a process that only runs work. It runs what an API
replica without worker slots queued, serves ``/healthz``, ``/readyz`` and ``/metrics``
and no API, and leaves cleanly on SIGTERM, handing its runs off to another worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.api.test_observability import metric
from tests.support.api import (
    approval_workflow,
    delay_workflow,
    figures_where,
    paused_execution,
    put,
    quick_workflow,
    until,
    wait_finished,
    wait_status,
)
from tests.support.logcheck import check_log
from tests.support.servers import (
    FlowcastServer,
    FlowcastWorker,
    ValkeyServer,
    authed,
    env_on,
)


async def execute(client: httpx.AsyncClient, workflow_id: str) -> dict[str, str]:
    answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert answer.status_code == 202, answer.text
    body: dict[str, str] = answer.json()
    return body


@pytest.mark.timeout(120)
async def test_a_worker_runs_what_an_api_replica_without_slots_queued_and_serves_no_api(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey)
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    await api.start()
    worker = FlowcastWorker(data_dir=tmp_path / "worker", env={**env, "FLOWCAST_WORKER_SLOTS": "4"})
    try:
        async with authed(api) as client:
            await put(client, quick_workflow("quick"))
            eid = (await execute(client, "quick"))["executionId"]
            await wait_status(client, eid, "queued")
            # The API replica sees the line (it runs nothing itself).
            figures = await figures_where(
                client,
                lambda t: metric(t, "flowcast_queue_depth", 'state="queued"') == 1,
                "the one queued",
            )
            assert metric(figures, "flowcast_queue_oldest_seconds") > 0
            assert metric(figures, "flowcast_worker_slots") == 0

            await worker.start()
            assert (await wait_finished(client, eid, timeout=30))["status"] == "completed"
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
            assert log[0]["type"] == "execution:started" and log[0]["data"]["queuedMs"] > 0

        async with authed(worker) as at_worker:
            assert (await at_worker.get("/healthz")).status_code == 200
            assert (await at_worker.get("/readyz")).status_code == 200
            for path in ("/api/workflows", f"/api/executions/{eid}", "/", "/openapi.json"):
                assert (await at_worker.get(path)).status_code == 404, path
            execute_there = await at_worker.post("/api/workflows/quick/execute", json={})
            assert execute_there.status_code == 404
            figures = await figures_where(
                at_worker,
                lambda t: metric(t, "flowcast_queue_depth", 'state="queued"') == 0,
                "none queued",
            )
            assert metric(figures, "flowcast_worker_slots") == 4
            assert metric(figures, "flowcast_queue_wait_seconds_count") == 1
            assert metric(figures, "flowcast_queue_wait_seconds_sum") > 0
            assert metric(figures, "flowcast_queue_depth", 'state="queued"') == 0
    finally:
        code = await worker.stop(signal.SIGTERM)
        await api.stop()
    assert_left_cleanly(code, worker)
    assert '"message":"worker: runs queued executions' in worker.logs()


def assert_left_cleanly(code: int, worker: FlowcastWorker) -> None:
    """Its shutdown completed with no error; uvicorn then ends by the signal it was
    given (as a shell expects of a process stopped by one), or 0."""
    assert code in (0, -signal.SIGTERM), worker.logs()
    assert "Application shutdown complete" in worker.logs()
    assert '"level":"error"' not in worker.logs()


@pytest.mark.timeout(120)
async def test_a_worker_stopped_with_sigterm_hands_its_run_to_another_worker(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey, shutdown_grace_seconds="0.2", lease_seconds="3")
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    first = FlowcastWorker(data_dir=tmp_path / "first", env=env)
    second = FlowcastWorker(data_dir=tmp_path / "second", env=env)
    await asyncio.gather(api.start(), first.start(), second.start())
    try:
        async with authed(api) as client:
            await put(client, delay_workflow("slow", ms=4000))
            eid = (await execute(client, "slow"))["executionId"]
            await wait_status(client, eid, "running")
            holder = await until(lambda: running_one(first, second), "a worker running it", 10)
            assert_left_cleanly(await holder.stop(signal.SIGTERM), holder)
            finished = await wait_finished(client, eid, timeout=30)
            assert finished["status"] == "completed", finished
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
            recovered = [e for e in log if e["type"] == "execution:recovered"]
            assert [e["data"]["reason"] for e in recovered] == ["handoff"], log
    finally:
        await asyncio.gather(first.stop(), second.stop())
        await api.stop()


@pytest.mark.timeout(120)
async def test_an_api_replica_without_slots_takes_no_hand_off(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey, shutdown_grace_seconds="0.2", lease_seconds="3")
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    first = FlowcastWorker(data_dir=tmp_path / "first", env=env)
    second = FlowcastWorker(data_dir=tmp_path / "second", env=env)
    await asyncio.gather(api.start(), first.start())
    try:
        async with authed(api) as client:
            await put(client, delay_workflow("slow", ms=1000))
            eid = (await execute(client, "slow"))["executionId"]
            await wait_status(client, eid, "running")
            assert_left_cleanly(await first.stop(signal.SIGTERM), first)
            await second.start()
            assert (await wait_finished(client, eid, timeout=30))["status"] == "completed"
            figures = (await client.get("/metrics")).text
            assert metric(figures, "flowcast_executions_total", 'status="recovered"') == 0
        async with authed(second) as at_second:
            figures = (await at_second.get("/metrics")).text
            assert metric(figures, "flowcast_executions_total", 'status="recovered"') == 1
    finally:
        await asyncio.gather(first.stop(), second.stop())
        await api.stop()


async def running_one(*workers: FlowcastWorker) -> FlowcastWorker | None:
    """The worker whose one slot is filled now, if any."""
    for worker in workers:
        async with authed(worker) as client:
            figures = (await client.get("/metrics")).text
        if metric(figures, "flowcast_worker_slots_used") == 1:
            return worker
    return None


@pytest.mark.timeout(30)
def test_a_worker_without_slots_refuses_to_start(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    flowcast = Path(sys.executable).with_name("flowcast")
    result = subprocess.run(
        [str(flowcast), "worker"],
        cwd=tmp_path,
        env={**base, "FLOWCAST_WORKER_SLOTS": "0"},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2
    assert "FLOWCAST_WORKER_SLOTS=0" in result.stderr


@pytest.mark.timeout(120)
async def test_a_worker_stopped_with_sigterm_leaves_its_queued_work_to_the_next(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A lone worker with one slot runs one execution while two more wait in line (one
    a resume): SIGTERM hands the run off and takes nothing more while it drains; the
    next worker takes the hand-off and the line over, each run once, nothing stuck."""
    env = env_on(valkey, shutdown_grace_seconds="0.2", lease_seconds="3")
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    one = {**env, "FLOWCAST_WORKER_SLOTS": "1"}
    first = FlowcastWorker(data_dir=tmp_path / "first", env=one)
    second = FlowcastWorker(data_dir=tmp_path / "second", env=one)
    await asyncio.gather(api.start(), first.start())
    try:
        async with authed(api) as client:
            await put(client, delay_workflow("slow", ms=3000))
            await put(client, quick_workflow("quick"))
            await put(client, approval_workflow("review"))
            asked = await paused_execution(client, "review")
            running = (await execute(client, "slow"))["executionId"]
            await wait_status(client, running, "running")
            waiting = await execute(client, "quick")
            assert waiting["status"] == "queued", waiting
            queued = waiting["executionId"]
            answer = await client.post(
                f"/api/executions/{asked}/resume", json={"input": {"approved": True}}
            )
            assert answer.json()["status"] == "queued", answer.text
            assert_left_cleanly(await first.stop(signal.SIGTERM), first)
            for eid in (queued, asked):
                seen = (await client.get(f"/api/executions/{eid}")).json()
                assert seen["status"] == "queued", (eid == queued, seen, first.logs()[-3000:])
            await second.start()
            for eid in (running, queued, asked):
                finished = await wait_finished(client, eid, timeout=30)
                assert finished["status"] == "completed", finished
                log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
                check_log(log)
                kinds = [e["type"] for e in log]
                assert kinds.count("execution:started") == 1, (eid, kinds)
                assert kinds.count("execution:completed") == 1, (eid, kinds)
            log = (await client.get(f"/api/executions/{running}/events")).json()["events"]
            recovered = [e for e in log if e["type"] == "execution:recovered"]
            assert [e["data"]["reason"] for e in recovered] == ["handoff"], log
            log = (await client.get(f"/api/executions/{asked}/events")).json()["events"]
            assert [e["type"] for e in log].count("execution:resumed") == 1, log
            assert "execution:recovered" not in [e["type"] for e in log], log
    finally:
        await asyncio.gather(first.stop(), second.stop())
        await api.stop()
