"""Secrets: write-only per tenant, encrypted at rest, usable in http and llm blocks, and
never seen again in an event, a snapshot, a stored run state, an error or a log line."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, wait_finished
from tests.support.llm import FakeLLM, Reply, llm
from tests.support.servers import ALPHA, BETA, FlowcastServer, ValkeyServer

__all__ = ["llm"]  # the module's fake provider (tests/support/llm.py)

# Two words, so the fake model echoes it over two chunks.
SECRET = "sk-live-7Hq2 ZpX9w4"
PREFIX = f"sec{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
async def keyed(
    llm: FakeLLM, valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("secrets"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": PREFIX,
            "FLOWCAST_API_KEYS": f"{ALPHA},{BETA}",
            "FLOWCAST_HTTP_ALLOW_PRIVATE": "true",
            "FLOWCAST_LLM_BASE_URL": llm.url,
        },
        access_log=True,
    )
    await server.start()
    yield server
    await server.stop()


async def _as(server: FlowcastServer, key: str) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture
async def alpha(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async for client in _as(keyed, ALPHA):
        yield client


@pytest.fixture
async def beta(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async for client in _as(keyed, BETA):
        yield client


def echo_workflow(workflow_id: str) -> dict[str, Any]:
    """An llm block told the secret (the fake model says it back), then an http block
    that sends it in a URL that refuses the connection, so the error carries the URL."""
    return {
        "id": workflow_id,
        "blocks": [
            {
                "id": "ask",
                "type": "llm",
                "config": {
                    "model": "m",
                    "messages": [{"role": "user", "content": "{{ secrets.API_TOKEN }}"}],
                },
            },
            {
                "id": "call",
                "type": "http",
                "config": {
                    "url": "http://127.0.0.1:1/hook?key={{ secrets.API_TOKEN }}",
                    "headers": {"Authorization": "Bearer {{ secrets['API_TOKEN'] }}"},
                    "timeoutMs": 2000,
                },
            },
        ],
        "edges": [{"from": "ask", "to": "call"}],
    }


async def test_values_are_write_only_and_names_are_listed(alpha: httpx.AsyncClient) -> None:
    created = await alpha.put("/api/secrets/LISTED", json={"value": "first-value"})
    assert created.status_code == 201
    assert created.json()["name"] == "LISTED" and "value" not in created.json()
    replaced = await alpha.put("/api/secrets/LISTED", json={"value": "second-value"})
    assert replaced.status_code == 200
    listed = (await alpha.get("/api/secrets")).json()["secrets"]
    assert [entry["name"] for entry in listed if entry["name"] == "LISTED"] == ["LISTED"]
    assert "second-value" not in json.dumps(listed) and "first-value" not in json.dumps(listed)
    assert (await alpha.get("/api/secrets/LISTED")).status_code in (404, 405)
    assert (await alpha.delete("/api/secrets/LISTED")).status_code == 204
    assert (await alpha.delete("/api/secrets/LISTED")).status_code == 404


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("1starts-with-digit", {"value": "x"}),
        ("has-dash", {"value": "x"}),
        ("OK", {"value": ""}),
        ("OK", {"value": "seven.."}),
        ("OK", {"value": 12}),
        ("OK", {"value": "x", "extra": 1}),
        ("OK", {"value": "x" * (8 * 1024 + 1)}),
    ],
)
async def test_bad_secrets_are_refused_with_422_and_change_nothing(
    alpha: httpx.AsyncClient, name: str, body: dict[str, Any]
) -> None:
    answer = await alpha.put(f"/api/secrets/{name}", json=body)
    assert answer.status_code == 422, answer.text
    assert "x" * 100 not in answer.text
    names = [entry["name"] for entry in (await alpha.get("/api/secrets")).json()["secrets"]]
    assert name not in names


async def test_values_are_encrypted_at_rest(alpha: httpx.AsyncClient, redis: Redis) -> None:
    await alpha.put("/api/secrets/AT_REST", json={"value": "plain-text-at-rest"})
    stored = b""
    async for key in redis.scan_iter(match=f"{PREFIX}:secrets:*"):
        stored += b"".join((await redis.hgetall(key)).values())
    assert stored and b"plain-text-at-rest" not in stored


async def test_another_tenant_can_neither_see_nor_use_a_secret(
    alpha: httpx.AsyncClient, beta: httpx.AsyncClient, llm: FakeLLM
) -> None:
    await alpha.put("/api/secrets/API_TOKEN", json={"value": SECRET})
    names = [entry["name"] for entry in (await beta.get("/api/secrets")).json()["secrets"]]
    assert "API_TOKEN" not in names
    assert (await beta.delete("/api/secrets/API_TOKEN")).status_code == 404
    workflow = echo_workflow(f"steal-{uuid.uuid4().hex[:6]}")
    assert (await beta.put(f"/api/workflows/{workflow['id']}", json=workflow)).status_code == 201
    started = await beta.post(f"/api/workflows/{workflow['id']}/execute", json={})
    snapshot = await wait_finished(beta, started.json()["executionId"])
    assert snapshot["status"] == "failed"
    assert snapshot["error"]["code"] == "secret_missing"
    assert all(SECRET not in json.dumps(seen.body) for seen in llm.requests)


async def test_a_secret_is_used_by_the_blocks_but_masked_everywhere_it_would_show(
    alpha: httpx.AsyncClient, llm: FakeLLM, redis: Redis, keyed: FlowcastServer
) -> None:
    await alpha.put("/api/secrets/API_TOKEN", json={"value": SECRET})
    llm.reset()
    llm.script(Reply(echo=True))
    workflow = echo_workflow(f"echo-{uuid.uuid4().hex[:6]}")
    assert (await alpha.put(f"/api/workflows/{workflow['id']}", json=workflow)).status_code == 201
    started = await alpha.post(f"/api/workflows/{workflow['id']}/execute", json={})
    execution_id = started.json()["executionId"]
    snapshot = await wait_finished(alpha, execution_id)
    # The model got the real value...
    assert llm.requests[-1].body["messages"][0]["content"] == SECRET
    # ...and every place a client can read shows *** instead: the chunks (the value was
    # split over two), the output, the http block's error carrying the URL.
    events = await all_events(alpha, execution_id)
    chunks = "".join(e["data"]["text"] for e in events if e["type"] == "block:chunk")
    assert chunks == "***"
    completed = next(e for e in events if e["type"] == "block:completed")
    assert completed["data"]["output"]["text"] == "***"
    failed = [e for e in events if e["type"] == "block:failed"]
    assert failed and "key=***" in failed[0]["data"]["error"]["message"]
    assert snapshot["status"] == "failed" and "***" in snapshot["error"]["message"]
    visible = json.dumps(events) + json.dumps(snapshot)
    stream = await alpha.get(f"/api/executions/{execution_id}/stream")
    visible += stream.text
    # Nothing Redis holds for the execution (events, metadata, run state, checkpoint).
    async for key in redis.scan_iter(match=f"{PREFIX}:{{{execution_id}}}:*"):
        kind = await redis.type(key)
        if kind == b"hash":
            visible += repr(await redis.hgetall(key))
        elif kind == b"stream":
            visible += repr(await redis.xrange(key))
        elif kind == b"string":
            visible += repr(await redis.get(key))
    for part in SECRET.split():
        assert part not in visible
    assert "sk-live" not in keyed.logs()


@pytest.mark.parametrize(
    ("block", "where", "message"),
    [
        (
            {"type": "transform", "config": {"value": "{{ secrets.API_TOKEN }}"}},
            "$.blocks[0].config",
            "only http, llm blocks may read secrets",
        ),
        (
            {"type": "http", "config": {"url": "http://x.test/{{ secrets | list }}"}},
            "$.blocks[0].config.url",
            "read a secret by its name only: {{ secrets.NAME }}",
        ),
        (
            {"type": "http", "config": {"url": "http://x.test/{{ secrets[input.k] }}"}},
            "$.blocks[0].config.url",
            "read a secret by its name only: {{ secrets.NAME }}",
        ),
    ],
)
async def test_only_http_and_llm_blocks_read_secrets_and_only_by_name(
    alpha: httpx.AsyncClient, block: dict[str, Any], where: str, message: str
) -> None:
    workflow = {"id": "reader", "blocks": [{"id": "b", **block}], "edges": []}
    answer = await alpha.put("/api/workflows/reader", json=workflow)
    assert answer.status_code == 422
    assert {"path": where, "message": message} in answer.json()["error"]["problems"]


async def test_a_condition_cannot_read_secrets(alpha: httpx.AsyncClient) -> None:
    workflow = {
        "id": "peek",
        "blocks": [
            {"id": "a", "type": "transform", "config": {"value": 1}},
            {"id": "b", "type": "transform", "config": {"value": 2}},
        ],
        "edges": [{"from": "a", "to": "b", "when": "secrets.API_TOKEN == 'x'"}],
    }
    answer = await alpha.put("/api/workflows/peek", json=workflow)
    assert answer.status_code == 422
    assert answer.json()["error"]["problems"] == [
        {"path": "$.edges[0].when", "message": "a condition may not read secrets"}
    ]
