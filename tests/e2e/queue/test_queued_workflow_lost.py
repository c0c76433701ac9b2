"""A queued execution whose workflow version the store lost (on a cluster, the node of
that key restarted empty) is never left queued for good: it runs from the tenant's
stored workflow while that still has the same digest, else it ends failed
(``workflow_lost``) with a log that begins as every log does."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.support.api import put, quick_workflow, wait_finished
from tests.support.servers import FlowcastServer, ValkeyServer, authed, env_on


@pytest.mark.timeout(90)
@pytest.mark.parametrize("changed", [False, True], ids=["workflow-unchanged", "changed"])
async def test_a_queued_execution_whose_workflow_version_was_lost_runs_or_ends(
    valkey: ValkeyServer, tmp_path: Path, changed: bool
) -> None:
    env = env_on(valkey)
    keys = Keys(env["FLOWCAST_REDIS_PREFIX"])
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
    await api.start()
    redis = Redis.from_url(valkey.url)
    try:
        async with authed(api) as client:
            await put(client, quick_workflow("lost"))
            answer = await client.post("/api/workflows/lost/execute", json={"input": {"n": 1}})
            assert answer.json()["status"] == "queued", answer.text
            eid = answer.json()["executionId"]
            versions = [key async for key in redis.scan_iter(match=keys.workflow_version("*"))]
            assert versions
            await redis.delete(*versions)
            if changed:
                changed_workflow = quick_workflow("lost")
                changed_workflow["blocks"][0]["config"]["value"] = 2
                await put(client, changed_workflow)
            await worker.start()
            ended = await wait_finished(client, eid, timeout=30)
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
    finally:
        await redis.aclose()
        await worker.stop()
        await api.stop()
    kinds = [event["type"] for event in log]
    if changed:
        assert ended["status"] == "failed", ended
        assert ended["error"]["code"] == "workflow_lost", ended
        assert kinds == ["execution:started", "execution:failed"], kinds
        assert log[0]["data"]["input"] == {"n": 1}
    else:
        assert ended["status"] == "completed", ended
        assert ended["output"] == {"only": 1}, ended
