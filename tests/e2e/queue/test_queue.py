"""The queue (SPEC §14): past a tenant's running cap an execute waits ``queued`` instead
of failing, its stream tells its place in line, it runs once a slot frees, a cancel
while queued ends it without running anything, and an API replica without worker slots
leaves the work to a worker."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import (
    approval_workflow,
    delay_workflow,
    put,
    quick_workflow,
    start_execution,
    wait_finished,
    wait_status,
)
from tests.support.live_list import live
from tests.support.servers import FlowcastServer, ValkeyServer, authed, env_on, serving
from tests.support.sse import Frame, events

SSE_ACCEPT = {"Accept": "text/event-stream"}


async def open_stream(client: httpx.AsyncClient, execution_id: str, into: list[Frame]) -> None:
    url = f"/api/executions/{execution_id}/stream"
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        async for frame in events(response):
            into.append(frame)


async def started(client: httpx.AsyncClient, workflow_id: str) -> dict[str, Any]:
    return await start_execution(client, workflow_id, {"n": 1})


@pytest.mark.timeout(60)
async def test_past_the_running_cap_an_execution_waits_queued_then_runs(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=1500))
            await put(client, quick_workflow("quick"))
            first = await started(client, "slow")
            assert first["status"] == "running"
            async with live(client, "workflowId=quick") as rows:
                assert await rows.rows() == []
                second = await started(client, "quick")
                assert second["status"] == "queued" and second["ahead"] == 0, second
                queued_id = second["executionId"]
                frames: list[Frame] = []
                reading = asyncio.create_task(open_stream(client, queued_id, frames))
                snapshot = (await client.get(f"/api/executions/{queued_id}")).json()
                assert snapshot["status"] == "queued" and snapshot["ahead"] == 0, snapshot
                listed = await client.get("/api/executions?status=queued")
                assert [row["id"] for row in listed.json()["executions"]] == [queued_id]
                # The live list shows it queued, then running (or straight completed).
                assert await rows.until(queued_id, "queued") == ["queued"]
                seen = await rows.until(queued_id, "completed")
                assert seen in (["running", "completed"], ["completed"]), seen
                await asyncio.wait_for(reading, 30)
            # Its place in line first, with no id; then its log from id 1.
            assert frames[0].event == "queue" and frames[0].id is None, frames[0]
            assert frames[0].json == {"state": "queued", "ahead": 0}
            logged = [frame for frame in frames if frame.id is not None]
            assert [f.id for f in logged] == [str(n) for n in range(1, len(logged) + 1)]
            assert logged[0].event == "execution:started"
            assert logged[0].json["data"]["queuedMs"] > 0
            assert logged[-1].event == "execution:completed"
            assert (await wait_finished(client, first["executionId"]))["status"] == "completed"


@pytest.mark.timeout(60)
async def test_a_queued_execution_cancelled_never_runs(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=30_000))
            running = await started(client, "slow")
            queued = await started(client, "slow")
            assert queued["status"] == "queued"
            eid = queued["executionId"]
            answer = await client.post(f"/api/executions/{eid}/cancel")
            assert answer.status_code == 202, answer.text
            assert (await wait_finished(client, eid))["status"] == "cancelled"
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
            assert [e["type"] for e in log] == ["execution:started", "execution:cancelled"]
            assert log[0]["data"]["input"] == {"n": 1}
            # Cancelled again: 409 with the status that won.
            again = await client.post(f"/api/executions/{eid}/cancel")
            assert again.status_code == 409 and again.json()["error"]["status"] == "cancelled"
            cancel = await client.post(f"/api/executions/{running['executionId']}/cancel")
            assert cancel.status_code == 202


@pytest.mark.timeout(90)
async def test_an_api_replica_without_slots_leaves_the_work_to_a_worker(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey)
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    await api.start()
    worker: FlowcastServer | None = None
    try:
        async with authed(api) as client:
            await put(client, quick_workflow("quick"))
            answer = await started(client, "quick")
            assert answer["status"] == "queued"
            eid = answer["executionId"]
            await wait_status(client, eid, "queued")
            # Nobody runs it until a process with slots comes.
            worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
            await worker.start()
            assert (await wait_finished(client, eid, timeout=30))["status"] == "completed"
    finally:
        if worker is not None:
            await worker.stop()
        await api.stop()


LEASE = 20  # seconds: a start given back by the dispatcher's reclaim waits about this


@pytest.mark.timeout(120)
async def test_a_start_taken_by_a_worker_as_it_is_queued_does_not_wait_a_lease(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Starts one after the other through an API replica with no slots, each the moment
    the last one's stream ended: the worker frees its slot (and looks at the queue) just
    as the next start is queued. Each one starts in well under a lease."""
    env = env_on(valkey, lease_seconds=str(LEASE))
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
    await asyncio.gather(api.start(), worker.start())
    try:
        async with authed(api) as client:
            await put(client, quick_workflow("quick"))
            for attempt in range(150):
                url = "/api/workflows/quick/execute"
                seen: list[str | None] = []
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LEASE / 4):
                        async with client.stream(
                            "POST", url, json={"input": {}}, headers=SSE_ACCEPT
                        ) as response:
                            seen += [frame.event async for frame in events(response)]
                assert "execution:completed" in seen, (attempt, seen)
    finally:
        await asyncio.gather(api.stop(), worker.stop())


async def paused(client: httpx.AsyncClient) -> str:
    answer = await started(client, "ask")
    eid = str(answer["executionId"])
    await wait_status(client, eid, "paused")
    return eid


@pytest.mark.timeout(60)
async def test_a_resume_past_the_running_cap_waits_in_line_then_runs_on(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A resume makes work runnable too: it goes through the same admission (SPEC §14),
    so at the cap it is accepted (202, its answer kept) and waits queued."""
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, approval_workflow("ask"))
            await put(client, delay_workflow("slow", ms=2000))
            asked = await paused(client)
            busy = await started(client, "slow")
            resumed = await client.post(
                f"/api/executions/{asked}/resume", json={"input": {"approved": True}}
            )
            assert resumed.status_code == 202, resumed.text
            assert resumed.json()["status"] == "queued", resumed.text
            assert (await client.get(f"/api/executions/{asked}")).json()["status"] == "queued"
            # A second answer finds it no longer paused: 409 with the status that won.
            again = await client.post(
                f"/api/executions/{asked}/resume", json={"input": {"approved": False}}
            )
            assert again.status_code == 409 and again.json()["error"]["status"] == "queued"
            assert (await wait_finished(client, asked))["status"] == "completed"
            assert (await wait_finished(client, busy["executionId"]))["status"] == "completed"
            log = (await client.get(f"/api/executions/{asked}/events")).json()["events"]
            types = [event["type"] for event in log]
            assert types.count("execution:started") == 1, types
            resumed_at = types.index("execution:resumed")
            assert types[resumed_at - 1] == "execution:paused", types
            assert log[resumed_at]["data"]["input"] == {"approved": True}
            assert [event["id"] for event in log] == list(range(1, len(log) + 1))


@pytest.mark.timeout(60)
async def test_a_resume_waiting_in_line_cancelled_only_ends(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, approval_workflow("ask"))
            await put(client, delay_workflow("slow", ms=30_000))
            asked = await paused(client)
            busy = await started(client, "slow")
            resumed = await client.post(
                f"/api/executions/{asked}/resume", json={"input": {"approved": True}}
            )
            assert resumed.json()["status"] == "queued", resumed.text
            cancel = await client.post(f"/api/executions/{asked}/cancel")
            assert cancel.status_code == 202, cancel.text
            assert (await wait_finished(client, asked))["status"] == "cancelled"
            log = (await client.get(f"/api/executions/{asked}/events")).json()["events"]
            types = [event["type"] for event in log]
            assert types[-2:] == ["execution:paused", "execution:cancelled"], types
            assert types.count("execution:started") == 1, types
            await client.post(f"/api/executions/{busy['executionId']}/cancel")


async def first_eight_to_start(
    gold: httpx.AsyncClient, plain: httpx.AsyncClient
) -> list[tuple[str, str]]:
    """Both tenants queue 8 quick runs behind gold's blocker (one worker slot); when
    each started, with whose it was, in the order they started."""
    for client in (gold, plain):
        await put(client, quick_workflow("quick"))
    await put(gold, delay_workflow("slow", ms=1500))
    blocker = await started(gold, "slow")
    assert blocker["status"] == "running"
    queued = {
        name: [(await started(client, "quick"))["executionId"] for _ in range(8)]
        for name, client in (("gold", gold), ("plain", plain))
    }
    began: list[tuple[str, str]] = []
    for name, client in (("gold", gold), ("plain", plain)):
        for eid in queued[name]:
            await wait_finished(client, eid)
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
            began.append((log[0]["ts"], name))
    return sorted(began)


@pytest.mark.timeout(90)
async def test_tenants_named_by_their_api_keys_share_the_slots_by_weight(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """``FLOWCAST_TENANT_WEIGHTS`` names tenants by their API keys: with weights 3 and 1
    and one worker slot, 6 of the first 8 queued executions to start are the heavier
    tenant's, although both queued 8 at once."""
    settings = {
        "api_keys": "gold-key,plain-key",
        "tenant_weights": '{"gold-key": 3}',
        "worker_slots": "1",
    }
    async with serving(valkey, tmp_path, **settings) as server:
        async with authed(server, "gold-key") as gold, authed(server, "plain-key") as plain:
            began = await first_eight_to_start(gold, plain)
            first = [name for _ts, name in began[:8]]
            assert first.count("gold") == 6, began


@pytest.mark.timeout(90)
async def test_a_weight_taken_out_of_the_settings_no_longer_counts(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """The weights live in Redis for every taker: a server restarted without the weight
    it was given before (the operator took it out) shares the slots evenly again, not
    by the old weight left behind."""
    settings = {"api_keys": "gold-key,plain-key", "worker_slots": "1"}
    before = env_on(valkey, **settings, tenant_weights='{"gold-key": 3}')
    server = FlowcastServer(data_dir=tmp_path / "before", env=before)
    await server.start()
    await server.stop()
    after = {k: v for k, v in before.items() if k != "FLOWCAST_TENANT_WEIGHTS"}
    server = FlowcastServer(data_dir=tmp_path / "after", env=after)
    await server.start()
    try:
        async with authed(server, "gold-key") as gold, authed(server, "plain-key") as plain:
            began = await first_eight_to_start(gold, plain)
            first = [name for _ts, name in began[:8]]
            assert first.count("gold") <= 5, began
    finally:
        await server.stop()
