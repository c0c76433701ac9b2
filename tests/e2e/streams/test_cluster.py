"""Flowcast on a real three-node Valkey Cluster: executions, replay and live tails.

Two Flowcast processes share one cluster (``redis+cluster://``); every execution's keys
share a hash tag, so each execution lives in one slot on one node while different
executions spread over the nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.connections import connect
from lib.backend import Keys
from lib.errors import BufferUnavailable
from lib.execution.buffer import EXECUTION_OVERHEAD_BYTES, EventBuffer
from lib.workflows.store import WorkflowStore
from tests.support.api import all_events, put, streaming_workflow, until, wait_finished
from tests.support.cluster import ValkeyCluster
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, collect, events


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ValkeyCluster]:
    async with ValkeyCluster(data_dir=tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


async def _flowcast(cluster: ValkeyCluster, data_dir: Path) -> FlowcastServer:
    server = FlowcastServer(
        data_dir=data_dir,
        env={"FLOWCAST_REDIS_URL": cluster.url, "FLOWCAST_SSE_PING_SECONDS": "1"},
    )
    await server.start()
    return server


@pytest.fixture(scope="module")
async def first(
    cluster: ValkeyCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    server = await _flowcast(cluster, tmp_path_factory.mktemp("first"))
    yield server
    await server.stop()


@pytest.fixture(scope="module")
async def second(
    cluster: ValkeyCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    server = await _flowcast(cluster, tmp_path_factory.mktemp("second"))
    yield server
    await server.stop()


@pytest.fixture
async def client(first: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=first.url, timeout=20) as http:
        yield http


@pytest.fixture
async def other_client(second: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=second.url, timeout=20) as http:
        yield http


@pytest.fixture
async def nodes(cluster: ValkeyCluster) -> AsyncIterator[dict[int, Redis]]:
    """A plain client per node, by port: each sees only the keys of its own slots."""
    clients = {port: Redis.from_url(cluster.node_url(port)) for port in cluster.ports}
    yield clients
    for node in clients.values():
        await node.aclose()


def execution_keys(execution_id: str) -> list[str]:
    return [f"fc:{{{execution_id}}}:{name}" for name in ("events", "meta", "state", "dropped")]


async def holders(nodes: dict[int, Redis], execution_id: str) -> dict[int, list[Any]]:
    """The nodes that hold any key of the execution, with those keys."""
    found: dict[int, list[Any]] = {}
    for port, node in nodes.items():
        keys = sorted(await node.keys(f"fc:{{{execution_id}}}:*"))
        if keys:
            found[port] = keys
    return found


async def test_workflows_put_through_a_cluster_are_listed_and_read_back(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"clustered-{unique}", words=3))
    for http in (client, other_client):
        listed = (await http.get("/api/workflows")).json()["workflows"]
        assert f"clustered-{unique}" in [workflow["id"] for workflow in listed]
        stored = (await http.get(f"/api/workflows/clustered-{unique}")).json()
        assert stored["source"] == "api"
        assert [block["id"] for block in stored["blocks"]] == ["intro", "talk", "done"]


async def test_concurrent_executions_stream_to_their_terminal_event(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"many-{unique}", words=20, tps=200))

    async def run(name: str) -> tuple[str, list[dict[str, Any]]]:
        response, frames = await collect(
            client,
            f"/api/workflows/many-{unique}/execute",
            method="POST",
            json={"input": {"name": name}},
        )
        assert response.status_code == 200
        envelopes = check_view(frames)
        check_log(envelopes)
        return response.headers["x-execution-id"], envelopes

    runs = await asyncio.gather(*(run(f"n{i}") for i in range(6)))
    assert len({execution_id for execution_id, _ in runs}) == 6
    for i, (execution_id, envelopes) in enumerate(runs):
        assert envelopes[-1]["type"] == "execution:completed"
        assert envelopes[-1]["data"]["output"] == {"done": {"who": f"n{i}"}}
        assert {envelope["executionId"] for envelope in envelopes} == {execution_id}
        # The stored log is exactly what the live stream carried.
        assert await all_events(client, execution_id) == envelopes


async def test_a_keyed_execute_repeated_through_both_processes_starts_one_execution(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    """The key's record and the execution it names are in different slots: written one
    after the other, and a repeat on either process answers the one execution."""
    workflow_id = f"keyed-{unique}"
    await put(client, streaming_workflow(workflow_id, words=5, tps=100))
    url = f"/api/workflows/{workflow_id}/execute"
    headers = {"Idempotency-Key": f"key-{unique}"}
    answers = await asyncio.gather(
        *(
            (client if i % 2 else other_client).post(url, json={"input": {}}, headers=headers)
            for i in range(8)
        )
    )
    assert [answer.status_code for answer in answers] == [202] * 8, [a.text for a in answers]
    (execution_id,) = {answer.json()["executionId"] for answer in answers}
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    check_log(await all_events(client, execution_id))
    listed = await other_client.get(f"/api/executions?workflowId={workflow_id}")
    assert [execution["id"] for execution in listed.json()["executions"]] == [execution_id]


async def test_each_execution_lives_in_one_slot_and_executions_spread_over_the_nodes(
    client: httpx.AsyncClient, nodes: dict[int, Redis], unique: str
) -> None:
    await put(client, streaming_workflow(f"spread-{unique}", words=2))
    any_node = next(iter(nodes.values()))
    owners: set[int] = set()
    # Ids are random, so start executions until every node holds one; 40 misses a node
    # with a probability far below one in a million.
    for _ in range(40):
        started = (await client.post(f"/api/workflows/spread-{unique}/execute", json={})).json()
        execution_id = started["executionId"]
        await wait_finished(client, execution_id)
        slots = {
            await any_node.execute_command("CLUSTER", "KEYSLOT", key)
            for key in execution_keys(execution_id)
        }
        assert len(slots) == 1, f"keys of {execution_id} span slots {slots}"
        held = await holders(nodes, execution_id)
        assert len(held) == 1, f"keys of {execution_id} are on several nodes: {held}"
        [(port, keys)] = held.items()
        assert keys == sorted(k.encode() for k in execution_keys(execution_id)[:3])
        (slot,) = slots
        assert await nodes[port].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 3
        owners.add(port)
        if len(owners) == len(nodes):
            break
    assert owners == set(nodes)


async def test_an_execution_is_counted_in_its_tenants_ledger_in_another_slot(
    client: httpx.AsyncClient, cluster: ValkeyCluster, unique: str
) -> None:
    """The tenant's storage ledger (``{t:<tenant>}``) lives in another slot than the
    execution (``{<eid>}``): the start counts it in its own round trip, and its final
    figure is set by a command of its own after its last batch, equal to what its
    metadata says it handed over."""
    await put(client, streaming_workflow(f"ledger-{unique}", words=5))
    started = (await client.post(f"/api/workflows/ledger-{unique}/execute", json={})).json()
    execution_id = started["executionId"]
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    keys, member = Keys(), f"e:{execution_id}"
    sizes = keys.quota("default")[1]
    redis = connect(cluster.url, socket_timeout=5, max_connections=8)
    try:

        async def counted() -> bool:
            handed = await redis.hget(keys.meta(execution_id), "quotaRecorded")
            return handed is not None and await redis.hget(sizes, member) == handed

        await until(counted, "the final figure in the tenant's ledger", 10)
        assert int(await redis.hget(sizes, member)) > EXECUTION_OVERHEAD_BYTES
        slots = {
            await redis.execute_command("CLUSTER KEYSLOT", key)
            for key in (sizes, keys.meta(execution_id))
        }
        assert len(slots) == 2
    finally:
        await redis.aclose()


async def test_reconnecting_mid_stream_with_last_event_id_gets_exactly_the_rest(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"resume-{unique}", words=40, tps=100))
    started = (await client.post(f"/api/workflows/resume-{unique}/execute", json={})).json()
    url = started["streamUrl"]
    seen: list[Frame] = []
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        async for frame in events(response):
            seen.append(frame)
            if len(seen) == 7:
                break
    # The same process, then the other one, each resume from the cursor.
    _, rest = await collect(client, url, headers={"Last-Event-ID": seen[-1].id or ""})
    envelopes = check_view(seen + rest)
    check_log(envelopes)
    _, elsewhere = await collect(other_client, url, headers={"Last-Event-ID": "5"})
    assert check_view(elsewhere, after=5) == envelopes[5:]


async def test_events_page_snapshot_and_listing_read_through_the_cluster(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"page-{unique}", words=25))
    ids = []
    for name in ("a", "b", "c"):
        url = f"/api/workflows/page-{unique}/execute"
        started = (await client.post(url, json={"input": {"name": name}})).json()
        ids.append(started["executionId"])
    for execution_id in ids:
        snapshot = await wait_finished(client, execution_id)
        assert snapshot["status"] == "completed"
        assert snapshot["workflowId"] == f"page-{unique}"
        assert snapshot["firstRetainedEventId"] == 1
        assert (await other_client.get(f"/api/executions/{execution_id}")).json() == snapshot
        page = (await client.get(f"/api/executions/{execution_id}/events?after=2&limit=5")).json()
        assert [event["id"] for event in page["events"]] == [3, 4, 5, 6, 7]
        assert page["nextAfter"] == 7
        assert page["lastEventId"] == snapshot["lastEventId"]
        assert page["status"] == "completed"
        check_log(await all_events(client, execution_id))
    for http in (client, other_client):
        listed = (await http.get(f"/api/executions?workflowId=page-{unique}")).json()
        assert [execution["id"] for execution in listed["executions"]] == ids[::-1]
        limited = (await http.get(f"/api/executions?workflowId=page-{unique}&limit=2")).json()
        assert [execution["id"] for execution in limited["executions"]] == ids[:0:-1]
        # The workflow's and the status bucket's indexes, on whichever node has their slot.
        done = f"/api/executions?workflowId=page-{unique}&status=completed"
        assert [
            execution["id"] for execution in (await http.get(done)).json()["executions"]
        ] == ids[::-1]
        running = f"/api/executions?workflowId=page-{unique}&status=running"
        assert (await http.get(running)).json()["executions"] == []


async def test_a_second_process_follows_an_execution_of_the_first_live_to_the_end(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"follow-{unique}", words=40, tps=20))
    started = (await client.post(f"/api/workflows/follow-{unique}/execute", json={})).json()
    execution_id = started["executionId"]
    frames: list[Frame] = []
    live_at: dict[str, Any] | None = None
    headers = {"Accept": "text/event-stream"}
    async with other_client.stream("GET", started["streamUrl"], headers=headers) as response:
        assert response.status_code == 200
        async for frame in events(response):
            frames.append(frame)
            if live_at is None and frame.event == "block:chunk":
                # The execution is still running in the first process: everything after
                # this point reaches the second one through its blocking read of the stream.
                live_at = (await client.get(f"/api/executions/{execution_id}")).json()
    assert live_at is not None
    assert live_at["status"] == "running"
    envelopes = check_view(frames)
    check_log(envelopes)
    assert envelopes[-1]["type"] == "execution:completed"
    assert envelopes[-1]["id"] > live_at["lastEventId"]
    assert envelopes == await all_events(client, execution_id)


async def test_the_live_list_of_one_process_shows_the_others_runs_start_and_finish(
    client: httpx.AsyncClient, other_client: httpx.AsyncClient, unique: str
) -> None:
    # start.lua and append.lua publish from the node of the execution's slot; the
    # second process hears it on its one pub/sub connection.
    workflow_id = f"live-{unique}"
    await put(client, streaming_workflow(workflow_id, words=5))
    url = f"/api/executions/live?workflowId={workflow_id}"
    async with other_client.stream("GET", url) as response:
        assert response.status_code == 200
        frames = events(response)
        first = await anext(frames)
        assert (first.event, first.json) == ("executions", {"executions": []})
        ids = []
        for name in ("a", "b"):
            body = {"input": {"name": name}}
            started = await client.post(f"/api/workflows/{workflow_id}/execute", json=body)
            ids.append(started.json()["executionId"])
        seen: dict[str, list[str]] = {execution_id: [] for execution_id in ids}
        async with asyncio.timeout(20):
            while any(statuses[-1:] != ["completed"] for statuses in seen.values()):
                frame = await anext(frames)
                assert frame.event == "execution"
                seen[frame.json["id"]].append(frame.json["status"])
    assert seen == {execution_id: ["running", "completed"] for execution_id in ids}


async def test_an_unreachable_cluster_is_buffer_unavailable_not_a_foreign_error(
    tmp_path: Path,
) -> None:
    # Nothing listens on these ports: the cluster client raises RedisClusterException,
    # which is not a RedisError, and it must still be translated at the boundary.
    redis = connect(ValkeyCluster(data_dir=tmp_path).url, socket_timeout=5, max_connections=8)
    try:
        buffer = EventBuffer(redis=redis)
        assert await buffer.ping() is False
        with pytest.raises(BufferUnavailable):
            await buffer.meta("ex_nowhere")
        with pytest.raises(BufferUnavailable):
            await buffer.after("ex_nowhere", after=0)
        with pytest.raises(BufferUnavailable):
            await WorkflowStore(redis=redis, validate=lambda body: body).list("default")
    finally:
        await redis.aclose()
