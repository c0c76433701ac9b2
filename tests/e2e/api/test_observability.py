"""Metrics after real executions, and structured logs that carry no secret."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.api import put, streaming_workflow, wait_finished
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import collect, events

KEY = "observability-key-" + "k" * 16
SECRET = "observability-secret-" + "s" * 16


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
async def observed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("observed"),
        access_log=True,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"obs{uuid.uuid4().hex[:6]}",
            "FLOWCAST_API_KEYS": KEY,
            "FLOWCAST_SECRET_KEY": SECRET,
            "FLOWCAST_EVENT_LIMIT": "20",
            "FLOWCAST_LARGE_VALUE_BYTES": "2000",
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(observed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=observed.url, headers=headers, timeout=20) as http:
        yield http


async def test_metrics_count_real_executions_events_offloads_gaps_and_latency(
    client: httpx.AsyncClient,
) -> None:
    await put(client, streaming_workflow("talk", words=40))
    big = {"id": "big", "blocks": [{"id": "p", "type": "payload", "config": {"bytes": 5000}}]}
    await put(client, big)
    response, frames = await collect(client, "/api/workflows/talk/execute", method="POST", json={})
    assert response.status_code == 200
    execution_id = response.headers["x-execution-id"]
    # The ring keeps 20 events: a replay from the start begins with an evicted gap.
    _, replayed = await collect(client, f"/api/executions/{execution_id}/stream")
    assert replayed[0].event == "replay:gap"
    started = (await client.post("/api/workflows/big/execute", json={})).json()
    await wait_finished(client, started["executionId"])
    text = (await client.get("/metrics")).text
    assert metric(text, "flowcast_executions_total", 'status="started"') >= 2
    assert metric(text, "flowcast_executions_total", 'status="completed"') >= 2
    assert metric(text, "flowcast_events_written_total") >= len(frames)
    assert metric(text, "flowcast_bytes_offloaded_total") >= 5000
    assert metric(text, "flowcast_replay_gaps_total", 'reason="evicted"') >= 1
    assert metric(text, "flowcast_stream_latency_seconds_count") >= len(frames) - 1
    assert metric(text, "flowcast_buffer_write_failures_total") == 0
    assert metric(text, "flowcast_offload_failures_total") == 0
    assert "flowcast_pending_events" in text


async def test_the_sse_clients_gauge_counts_open_streams(client: httpx.AsyncClient) -> None:
    slow = streaming_workflow("slow", words=30, tps=20)
    await put(client, slow)
    started = (await client.post("/api/workflows/slow/execute", json={})).json()
    async with client.stream("GET", started["streamUrl"]) as response:
        async for _ in events(response):
            text = (await client.get("/metrics")).text
            assert metric(text, "flowcast_sse_clients") >= 1
            break
    await wait_finished(client, started["executionId"])


async def test_logs_are_json_lines_with_execution_ids_and_no_secrets(
    observed: FlowcastServer, client: httpx.AsyncClient
) -> None:
    await put(
        client, {"id": "boom", "blocks": [{"id": "f", "type": "fail", "config": {"message": "x"}}]}
    )
    started = (await client.post("/api/workflows/boom/execute", json={})).json()
    token = started["streamToken"]
    async with httpx.AsyncClient(base_url=observed.url, timeout=20) as anonymous:
        _, frames = await collect(anonymous, f"{started['streamUrl']}?token={token}")
        assert frames[-1].event == "execution:failed"
        await anonymous.get("/api/workflows", headers={"Authorization": "Bearer wrong-" + KEY})
    lines = [line for line in observed.logs().splitlines() if line.strip()]
    records = [orjson.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines), "every log line is one JSON object"
    assert all({"ts", "level", "logger", "message"} <= record.keys() for record in records)
    about = [r for r in records if r.get("executionId") == started["executionId"]]
    assert about, "the failed execution is logged with its executionId"
    text = observed.logs()
    for secret in (KEY, SECRET, token, token.split(".", 1)[1]):
        assert secret not in text
    assert "token=[redacted]" in text


async def test_a_token_in_any_spelling_of_its_name_never_reaches_a_log_line(
    observed: FlowcastServer, client: httpx.AsyncClient
) -> None:
    await put(client, {"id": "spelled", "blocks": [{"id": "t", "type": "transform", "config": {}}]})
    started = (await client.post("/api/workflows/spelled/execute", json={})).json()
    token = started["streamToken"]
    async with httpx.AsyncClient(base_url=observed.url, timeout=20) as anonymous:
        for name in ("%74oken", "to%6Ben", "%74%6F%6B%65%6E"):
            url = f"{started['streamUrl']}?{name}={token}"
            response, frames = await collect(anonymous, url)
            assert response.status_code == 200, (name, response.status_code)
            assert frames[-1].event == "execution:completed"
    text = observed.logs()
    assert token not in text and token.split(".", 1)[1] not in text
    assert "%74oken=[redacted]" in text


@pytest.mark.parametrize(
    ("access_log", "level", "logged"),
    [(False, "info", False), (True, "warning", False), (True, "info", True)],
)
async def test_the_access_log_follows_no_access_log_and_the_log_level(
    tmp_path: Path, valkey: ValkeyServer, access_log: bool, level: str, logged: bool
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        access_log=access_log,
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_LOG_LEVEL": level},
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            assert (await http.get("/api/workflows")).status_code == 200
    finally:
        await server.stop()
    assert ("GET /api/workflows HTTP/1.1" in server.logs()) is logged
