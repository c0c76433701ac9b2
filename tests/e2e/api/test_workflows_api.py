"""The workflow routes: create, replace, read, list, delete, and validation errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import put
from tests.support.servers import FlowcastServer, ValkeyServer, authed, serving_pair
from tests.support.sse import collect


def simple(workflow_id: str) -> dict[str, object]:
    return {"id": workflow_id, "blocks": [{"id": "a", "type": "transform", "config": {"value": 1}}]}


async def test_put_creates_then_replaces_and_get_returns_it(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"crud-{unique}"
    created = await client.put(f"/api/workflows/{workflow_id}", json=simple(workflow_id))
    assert created.status_code == 201
    assert created.json()["blocks"][0]["id"] == "a"
    replaced = await client.put(
        f"/api/workflows/{workflow_id}", json={**simple(workflow_id), "name": "Renamed"}
    )
    assert replaced.status_code == 200
    fetched = (await client.get(f"/api/workflows/{workflow_id}")).json()
    assert fetched["name"] == "Renamed"
    assert fetched["source"] == "api"
    listed = (await client.get("/api/workflows")).json()["workflows"]
    assert workflow_id in {item["id"] for item in listed}
    assert (await client.delete(f"/api/workflows/{workflow_id}")).status_code == 204
    assert (await client.get(f"/api/workflows/{workflow_id}")).status_code == 404
    assert (await client.delete(f"/api/workflows/{workflow_id}")).status_code == 404


async def test_put_without_id_takes_the_id_from_the_url(
    client: httpx.AsyncClient, unique: str
) -> None:
    body = simple("x")
    del body["id"]
    response = await client.put(f"/api/workflows/noid-{unique}", json=body)
    assert response.status_code == 201
    assert response.json()["id"] == f"noid-{unique}"


async def test_id_mismatch_is_422(client: httpx.AsyncClient, unique: str) -> None:
    response = await client.put(f"/api/workflows/one-{unique}", json=simple(f"two-{unique}"))
    assert response.status_code == 422
    assert response.json()["error"]["problems"][0]["path"] == "$.id"


async def test_invalid_workflow_lists_every_problem_with_its_path(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"bad-{unique}"
    body = {
        "id": workflow_id,
        "surprise": True,
        "blocks": [
            {"id": "a", "type": "teleport", "config": {}},
            {"id": "b", "type": "delay", "config": {"ms": "soon"}},
            {"id": "b", "type": "transform", "config": {"value": "{{ unclosed "}},
            {"id": "c", "type": "transform", "config": {"value": 1}},
            {"id": "d", "type": "transform", "config": {"value": 1}},
        ],
        "edges": [
            {"from": "a", "to": "ghost"},
            {"from": "c", "to": "d"},
            {"from": "d", "to": "c"},
            {"from": "a", "to": "c", "when": "(("},
        ],
    }
    response = await client.put(f"/api/workflows/{workflow_id}", json=body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_workflow"
    paths = {problem["path"] for problem in error["problems"]}
    messages = " ".join(problem["message"] for problem in error["problems"]).lower()
    assert "$.surprise" in paths
    assert "$.blocks[0].type" in paths
    assert any(path.startswith("$.blocks[1].config") for path in paths)
    assert any(path.startswith("$.blocks[2]") for path in paths)  # duplicate id, template
    assert "$.edges[0].to" in paths
    assert any(path.startswith("$.edges[3].when") for path in paths)
    assert "cycle" in messages
    # Nothing was stored.
    assert (await client.get(f"/api/workflows/{workflow_id}")).status_code == 404


async def test_non_json_and_non_object_bodies_are_refused(
    client: httpx.AsyncClient, unique: str
) -> None:
    response = await client.put(
        f"/api/workflows/raw-{unique}",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 422
    assert "error" in response.json()
    response = await client.put(f"/api/workflows/list-{unique}", json=[1, 2])
    assert response.status_code == 422


async def test_example_workflows_are_loaded_from_files(client: httpx.AsyncClient) -> None:
    listed = {item["id"]: item for item in (await client.get("/api/workflows")).json()["workflows"]}
    for name in ("parallel-report", "stream-story", "route-ticket", "approve-refund"):
        assert listed[name]["source"] == "file"
    response = await client.delete("/api/workflows/stream-story")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "workflow_from_file"


async def test_bad_workflow_file_is_reported_and_does_not_stop_the_server(
    valkey_url: str, tmp_path: object
) -> None:
    from pathlib import Path

    assert isinstance(tmp_path, Path)
    workflows = tmp_path / "workflows"
    workflows.mkdir()
    (workflows / "good.json").write_text(
        '{"id": "good", "blocks": [{"id": "a", "type": "delay", "config": {"ms": 1}}]}'
    )
    (workflows / "broken.json").write_text("{ this is not json")
    (workflows / "invalid.json").write_text(
        '{"id": "invalid", "blocks": [{"id": "a", "type": "nope"}]}'
    )
    server = FlowcastServer(
        data_dir=tmp_path / "data",
        env={
            "FLOWCAST_REDIS_URL": valkey_url,
            "FLOWCAST_WORKFLOWS_DIR": str(workflows),
            "FLOWCAST_REDIS_PREFIX": "badfiles",
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            listed = (await http.get("/api/workflows")).json()["workflows"]
        assert [item["id"] for item in listed] == ["good"]
        logs = server.logs()
        assert "broken.json" in logs and "not valid JSON" in logs
        assert "invalid.json" in logs and "$.blocks[0].type" in logs
    finally:
        await server.stop()


def valued(workflow_id: str, value: int) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "a", "type": "transform", "config": {"value": value}}],
    }


async def output_of(client: httpx.AsyncClient, workflow_id: str, *, streamed: bool) -> Any:
    """Execute ``workflow_id`` (streamed, or answered 202 and read back) to its end."""
    if streamed:
        response, frames = await collect(
            client, f"/api/workflows/{workflow_id}/execute", method="POST", json={}
        )
        if response.status_code != 200:
            return response.status_code
        return frames[-1].json["data"]["output"]
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={})
    if response.status_code != 202:
        return response.status_code
    _, frames = await collect(client, response.json()["streamUrl"])
    return frames[-1].json["data"]["output"]


@pytest.fixture(scope="module")
async def pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Replicas A and B on one Redis prefix of their own."""
    async with serving_pair(valkey, tmp_path_factory.mktemp("pair")) as servers:
        yield servers


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "answered-202"])
async def test_an_execute_runs_the_workflow_stored_when_it_is_accepted_whoever_changed_it(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str, streamed: bool
) -> None:
    """A replica starts a workflow it read before without reading it again first, the
    store's copy confirmed in the start's own round trip (step 15, the event path's
    latency): replaced or deleted on another replica since, the execute still runs the
    stored version, or answers 404 and starts nothing."""
    a, b = pair
    workflow_id = f"versions-{unique}"
    async with authed(a) as on_a, authed(b) as on_b:
        await put(on_a, valued(workflow_id, 1))
        assert await output_of(on_a, workflow_id, streamed=streamed) == {"a": 1}
        await put(on_b, valued(workflow_id, 2))
        assert await output_of(on_a, workflow_id, streamed=streamed) == {"a": 2}
        assert await output_of(on_a, workflow_id, streamed=streamed) == {"a": 2}
        assert (await on_b.delete(f"/api/workflows/{workflow_id}")).status_code == 204
        assert await output_of(on_a, workflow_id, streamed=streamed) == 404
        await put(on_b, valued(workflow_id, 3))
        assert await output_of(on_a, workflow_id, streamed=streamed) == {"a": 3}
        listed = (await on_a.get("/api/executions", params={"workflowId": workflow_id})).json()
        assert len(listed["executions"]) == 4  # the 404 left no listing


async def _at_once(*requests: Any) -> list[Any]:
    """Run the coroutines from one instant: each waits for the same signal first."""
    go = asyncio.Event()

    async def when_told(request: Any) -> Any:
        await go.wait()
        return await request

    tasks = [asyncio.create_task(when_told(request)) for request in requests]
    await asyncio.sleep(0)  # every task is waiting on ``go``
    go.set()
    return list(await asyncio.gather(*tasks))


@pytest.mark.timeout(120)
async def test_executes_racing_a_put_or_a_delete_on_another_replica_run_a_stored_version(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: ValkeyServer, unique: str
) -> None:
    """Rounds of an execute on A (which knows the stored version) fired at the same
    instant as a PUT of the next version, or a DELETE, on B. Each execute runs the
    version stored before or after the other request, or (deleted) answers 404; a later
    execute on A runs what is stored now; every execution answered 202 is listed, none
    refused is, and no admission is left behind once they ended. Found by nothing: the
    h1 fresh-eyes review tried to break the start's confirmed workflow (e37bbdb)."""
    a, b = pair
    workflow_id = f"raced-{unique}"
    started = 0
    async with authed(a) as on_a, authed(b) as on_b:
        for turn in range(12):
            await put(on_a, valued(workflow_id, turn * 10))  # A knows this version
            ran, replaced = await _at_once(
                output_of(on_a, workflow_id, streamed=turn % 2 == 0),
                on_b.put(f"/api/workflows/{workflow_id}", json=valued(workflow_id, turn * 10 + 1)),
            )
            assert replaced.status_code == 200, replaced.text
            assert ran in ({"a": turn * 10}, {"a": turn * 10 + 1}), (turn, ran)
            assert await output_of(on_a, workflow_id, streamed=False) == {"a": turn * 10 + 1}
            started += 2
            ran, deleted = await _at_once(
                output_of(on_a, workflow_id, streamed=turn % 2 == 1),
                on_b.delete(f"/api/workflows/{workflow_id}"),
            )
            assert deleted.status_code == 204, deleted.text
            assert ran in ({"a": turn * 10 + 1}, 404), (turn, ran)
            started += ran != 404
            assert await output_of(on_a, workflow_id, streamed=False) == 404
        listed = (
            await on_a.get("/api/executions", params={"workflowId": workflow_id, "limit": 200})
        ).json()
    assert len(listed["executions"]) == started
    redis = Redis.from_url(valkey.url)
    try:
        prefix = a.env["FLOWCAST_REDIS_PREFIX"]
        assert await redis.zcard(f"{prefix}:running:default") == 0
    finally:
        await redis.aclose()
