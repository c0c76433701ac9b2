"""The reconciler on a real three-node Valkey Cluster (SPEC §14 "A queued execution
survives every process dying ... It all works on Redis Cluster"): the node that holds
the lines (the ``{queue}`` hash tag) restarts empty while the records, in their own
slots on the other nodes, still say ``queued``; the worker notices another server
answers (store.py asks every primary) and puts them back in line, also those whose
tenant's unfinished index was lost with the lines (it looks at every record), and each
runs once."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.api import delay_workflow, put, quick_workflow, wait_finished, wait_status
from tests.support.cluster import ValkeyCluster
from tests.support.logcheck import check_log
from tests.support.servers import FlowcastServer, prefix


@pytest.mark.timeout(120)
async def test_queued_executions_survive_the_restart_of_the_node_of_the_lines(
    tmp_path: Path,
) -> None:
    async with ValkeyCluster(data_dir=tmp_path / "cluster") as cluster:
        named = prefix()
        env = {
            "FLOWCAST_REDIS_URL": cluster.url,
            "FLOWCAST_REDIS_PREFIX": named,
            "FLOWCAST_MAX_RUNNING_PER_TENANT": "1",
            "FLOWCAST_LEASE_SECONDS": "2",
        }
        api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
        worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
        await api.start()
        await worker.start()
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=20) as client:
                await put(client, delay_workflow("slow", ms=2000))
                await put(client, quick_workflow("quick"))
                first = (await client.post("/api/workflows/slow/execute", json={})).json()
                await wait_status(client, first["executionId"], "running")
                queued = []
                for _ in range(6):
                    answered = await client.post("/api/workflows/quick/execute", json={})
                    assert answered.status_code == 202, answered.text
                    answer = answered.json()
                    assert answer["status"] == "queued", answer
                    queued.append(answer["executionId"])
                lines = await cluster.node_of(f"{named}:{{queue}}:tenants")
                # Only the executions whose records live on another node survive it.
                kept = [
                    eid
                    for eid in queued
                    if await cluster.node_of(f"{named}:{{{eid}}}:meta") != lines
                ]
                assert kept, "every record on the node of the lines: try again"
                # The workflow is lost with that node only if its stored definition went
                # too: then each kept execution ends failed (workflow_lost), never stuck.
                lost = await cluster.node_of(f"{named}:workflows:default") == lines
                survivors = kept
                if await cluster.node_of(f"{named}:{{{first['executionId']}}}:meta") != lines:
                    survivors = [first["executionId"], *kept]
                await cluster.restart_node(lines)
                for eid in survivors:
                    ended = await wait_finished(client, eid, timeout=12)
                    if lost and eid != first["executionId"]:
                        assert ended["status"] in ("completed", "failed"), ended
                        if ended["status"] == "failed":
                            assert ended["error"]["code"] == "workflow_lost", ended
                        continue
                    assert ended["status"] == "completed", ended
                    log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
                    check_log(log)
                    kinds = [e["type"] for e in log]
                    assert kinds.count("execution:started") == 1, kinds
        finally:
            await worker.stop()
            await api.stop()
