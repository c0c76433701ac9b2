"""The workflow routes: create, replace, read, list, delete, and validation errors."""

from __future__ import annotations

import httpx

from tests.support.servers import FlowcastServer


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
