"""The embedded default reads its workflow files again when they change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import until, wait_finished
from tests.support.servers import FlowcastServer


def _document(workflow_id: str, value: Any) -> str:
    block = {"id": "t", "type": "transform", "config": {"value": value}}
    return json.dumps({"id": workflow_id, "blocks": [block], "edges": []})


async def _value(client: httpx.AsyncClient, workflow_id: str) -> Any:
    response = await client.get(f"/api/workflows/{workflow_id}")
    return response.json()["blocks"][0]["config"]["value"] if response.status_code == 200 else None


@pytest.mark.timeout(90)
async def test_an_edited_added_or_removed_file_is_seen_without_a_restart(tmp_path: Path) -> None:
    flows = tmp_path / "flows"
    flows.mkdir()
    (flows / "one.json").write_text(_document("one", "first"))
    # No FLOWCAST_REDIS_URL: the embedded default, with its own engine.
    server = FlowcastServer(data_dir=tmp_path / "data", env={"FLOWCAST_WORKFLOWS_DIR": str(flows)})
    await server.start(timeout=60)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            assert await _value(client, "one") == "first"

            (flows / "one.json").write_text(_document("one", "second, longer"))
            edited = lambda: _check(client, "one", "second, longer")  # noqa: E731
            await until(edited, "the edit is seen", 20, every=0.1)
            started = await client.post("/api/workflows/one/execute", json={"input": None})
            execution_id = started.json()["executionId"]
            snapshot = await wait_finished(client, execution_id)
            assert snapshot["output"] == {"t": "second, longer"}, "a new run runs the new file"

            (flows / "two.json").write_text(_document("two", 2))
            (flows / "one.json").unlink()
            (flows / "bad.json").write_text("{nope")
            await until(lambda: _check(client, "two", 2), "an added file is seen", 20, every=0.1)
            assert (await client.get("/api/workflows/one")).status_code == 404
            listed = (await client.get("/api/workflows")).json()["workflows"]
            assert [(w["id"], w["source"]) for w in listed] == [("two", "file")]
        logs = server.logs()
        assert "workflow files changed: read again" in logs
        assert "workflow file skipped" in logs and "bad.json" in logs
    finally:
        await server.stop()


async def _check(client: httpx.AsyncClient, workflow_id: str, value: Any) -> bool:
    return bool(await _value(client, workflow_id) == value)
