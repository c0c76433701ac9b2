"""The queue on a real three-node Valkey Cluster (SPEC §14 "It all works on Redis
Cluster"): the admission, the lines and the deliveries share one hash tag, the records
live in their own slots, and the wake-ups ride the control streams' tag. An API replica
with no worker slots queues, a worker runs; a queued execution cancelled never runs; a
resume at the running cap waits in line, and goes before the starts queued before it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.api.test_observability import metric
from tests.support.api import approval_workflow, delay_workflow, put, wait_finished, wait_status
from tests.support.cluster import ValkeyCluster
from tests.support.servers import FlowcastServer, prefix


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ValkeyCluster]:
    async with ValkeyCluster(data_dir=tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


@pytest.mark.timeout(120)
async def test_the_queue_runs_on_a_cluster(cluster: ValkeyCluster, tmp_path: Path) -> None:
    env = {
        "FLOWCAST_REDIS_URL": cluster.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        "FLOWCAST_MAX_RUNNING_PER_TENANT": "1",
    }
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
    await api.start()
    await worker.start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=20) as client:
            await put(client, delay_workflow("slow", ms=1500))
            await put(client, approval_workflow("ask"))

            async def execute(workflow_id: str) -> dict[str, object]:
                answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={})
                assert answer.status_code == 202, answer.text
                body: dict[str, object] = answer.json()
                return body

            asked = str((await execute("ask"))["executionId"])
            await wait_status(client, asked, "paused")
            first = str((await execute("slow"))["executionId"])
            await wait_status(client, first, "running")
            cancelled = str((await execute("slow"))["executionId"])
            later = str((await execute("slow"))["executionId"])
            assert (await client.get(f"/api/executions/{later}")).json()["status"] == "queued"
            # /metrics reads the lines (one hash tag) in one pipeline, also on a cluster.
            figures = (await client.get("/metrics")).text
            assert metric(figures, "flowcast_queue_depth", 'state="queued"') >= 1
            resumed = await client.post(f"/api/executions/{asked}/resume", json={"input": 1})
            assert resumed.status_code == 202 and resumed.json()["status"] == "queued"
            cancel = await client.post(f"/api/executions/{cancelled}/cancel")
            assert cancel.status_code == 202, cancel.text

            ended = {eid: await wait_finished(client, eid) for eid in (first, later, asked)}
            assert {eid: view["status"] for eid, view in ended.items()} == dict.fromkeys(
                (first, later, asked), "completed"
            )
            log = (await client.get(f"/api/executions/{cancelled}/events")).json()["events"]
            assert [e["type"] for e in log] == ["execution:started", "execution:cancelled"]
            # The resume, queued after the start, went before it (continuations first).
            resumed_at = (await client.get(f"/api/executions/{asked}/events")).json()["events"]
            later_log = (await client.get(f"/api/executions/{later}/events")).json()["events"]
            resumed_ts = next(e["ts"] for e in resumed_at if e["type"] == "execution:resumed")
            assert resumed_ts <= later_log[0]["ts"]
    finally:
        await worker.stop()
        await api.stop()
