"""``llm`` blocks end to end: a Flowcast server streaming a fake OpenAI-compatible model.

The model is ``tests.support.llm.FakeLLM`` on 127.0.0.1: it speaks the real streaming
protocol (``data:`` chunks, a usage chunk, ``[DONE]``) and misbehaves on cue.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, execute, put, wait_finished
from tests.support.llm import FakeLLM, Reply
from tests.support.servers import FlowcastServer, ValkeyServer

API_KEY = "sk-provider-key-for-tests"


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM(api_key=API_KEY) as fake:
        yield fake


@pytest.fixture(autouse=True)
def fresh(llm: FakeLLM) -> None:
    llm.reset()


def providers(llm: FakeLLM, cap: int = 4) -> str:
    return json.dumps(
        {
            "default": {"baseUrl": llm.url, "apiKey": API_KEY, "maxConcurrency": cap},
            "spare": {"baseUrl": llm.url, "apiKey": API_KEY},
        }
    )


@pytest.fixture(scope="module")
async def llm_server(
    llm: FakeLLM, valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("llm"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"llm{uuid.uuid4().hex[:6]}",
            "FLOWCAST_LLM_PROVIDERS": providers(llm),
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(llm_server: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=llm_server.url, timeout=30) as http:
        yield http


def llm_workflow(workflow_id: str, **config: Any) -> dict[str, Any]:
    retry = config.pop("retry", {"attempts": 3, "backoffMs": 10})
    block = {
        "id": "draft",
        "type": "llm",
        "retry": retry,
        "config": {
            "model": "fake-1",
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Say hello to {{ input.name }}"},
            ],
            **config,
        },
    }
    return {"id": workflow_id, "blocks": [block], "edges": []}


async def run(client: httpx.AsyncClient, workflow: dict[str, Any], **input: Any) -> list[Any]:
    await put(client, workflow)
    execution_id = await execute(client, workflow["id"], input)
    await wait_finished(client, execution_id)
    return await all_events(client, execution_id)


def kinds(events: list[Any]) -> list[str]:
    return [event["type"] for event in events]


def chunks(events: list[Any]) -> list[str]:
    return [e["data"]["text"] for e in events if e["type"] == "block:chunk"]


async def test_each_text_delta_is_one_chunk_and_the_output_has_usage(
    client: httpx.AsyncClient, llm: FakeLLM
) -> None:
    llm.script(Reply(pieces=["Hel", "lo, ", "Ada", "!"], usage=(12, 4), model="fake-1-0613"))
    events = await run(client, llm_workflow(f"llm-{uuid.uuid4().hex[:6]}"), name="Ada")
    assert chunks(events) == ["Hel", "lo, ", "Ada", "!"]
    completed = next(e for e in events if e["type"] == "block:completed")["data"]["output"]
    assert completed == {
        "text": "Hello, Ada!",
        "finishReason": "stop",
        "model": "fake-1-0613",
        "usage": {"promptTokens": 12, "completionTokens": 4},
    }
    assert events[-1]["type"] == "execution:completed"
    (seen,) = llm.requests
    assert seen.headers["authorization"] == f"Bearer {API_KEY}"
    assert seen.body["stream"] is True
    assert seen.body["stream_options"] == {"include_usage": True}
    assert seen.body["messages"][1] == {"role": "user", "content": "Say hello to Ada"}


async def test_optional_settings_reach_the_provider(
    client: httpx.AsyncClient, llm: FakeLLM
) -> None:
    workflow = llm_workflow(
        f"llm-{uuid.uuid4().hex[:6]}", temperature=0.2, maxTokens=50, stop=["\n\n"]
    )
    await run(client, workflow, name="Bo")
    body = llm.requests[0].body
    assert (body["temperature"], body["max_tokens"], body["stop"]) == (0.2, 50, ["\n\n"])


@pytest.mark.parametrize(
    "headers",
    [
        {"Retry-After": "1"},
        {"retry-after-ms": "1000"},
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"},
    ],
    ids=["retry-after", "retry-after-ms", "x-ratelimit-reset"],
)
async def test_a_rate_limited_attempt_waits_what_the_provider_asks_then_starts_again(
    client: httpx.AsyncClient, llm: FakeLLM, headers: dict[str, str]
) -> None:
    llm.script(Reply(status=429, headers=headers), Reply(pieces=["fine"]))
    events = await run(client, llm_workflow(f"llm-{uuid.uuid4().hex[:6]}"), name="Cy")
    assert kinds(events) == [
        "execution:started",
        "block:started",
        "block:failed",
        "block:started",
        "block:chunk",
        "block:completed",
        "execution:completed",
    ]
    failed = events[2]["data"]
    assert failed["willRetry"] is True and failed["error"]["code"] == "llm_rate_limited"
    assert events[3]["data"]["attempt"] == 2
    first, second = llm.requests
    assert second.at - first.at >= 0.95  # the wait asked for, not the block's 10 ms backoff


async def test_a_stream_that_breaks_mid_reply_is_retried_from_its_first_token(
    client: httpx.AsyncClient, llm: FakeLLM
) -> None:
    llm.script(
        Reply(pieces=["one ", "two ", "three"], break_after=2), Reply(pieces=["uno ", "dos"])
    )
    events = await run(client, llm_workflow(f"llm-{uuid.uuid4().hex[:6]}"), name="Di")
    assert kinds(events)[1:-1] == [
        "block:started",
        "block:chunk",
        "block:chunk",
        "block:failed",
        "block:started",
        "block:chunk",
        "block:chunk",
        "block:completed",
    ]
    assert chunks(events) == ["one ", "two ", "uno ", "dos"]
    failed = events[4]["data"]
    assert failed["error"]["code"] == "llm_unreachable" and failed["willRetry"] is True
    assert "mid-reply" in failed["error"]["message"]
    assert events[-2]["data"]["output"]["text"] == "uno dos"


@pytest.mark.parametrize(
    "bad",
    [Reply(status=503), Reply(break_after=0), Reply(delay=3.0)],
    ids=["503", "cut-before-any-token", "timeout"],
)
async def test_server_errors_cut_connections_and_timeouts_are_retried(
    client: httpx.AsyncClient, llm: FakeLLM, bad: Reply
) -> None:
    llm.script(bad, Reply(pieces=["ok"]))
    workflow = llm_workflow(f"llm-{uuid.uuid4().hex[:6]}", retry={"attempts": 2, "backoffMs": 10})
    workflow["blocks"][0]["timeoutMs"] = 1500
    events = await run(client, workflow, name="Ed")
    failed = next(e for e in events if e["type"] == "block:failed")["data"]
    assert failed["willRetry"] is True
    assert events[-1]["type"] == "execution:completed"
    assert events[-2]["data"]["output"]["text"] == "ok"


async def test_a_refused_request_is_not_retried_and_says_why(
    client: httpx.AsyncClient, llm: FakeLLM
) -> None:
    llm.script(Reply(status=400))
    events = await run(client, llm_workflow(f"llm-{uuid.uuid4().hex[:6]}"), name="Fa")
    failed = next(e for e in events if e["type"] == "block:failed")["data"]
    assert failed["willRetry"] is False
    assert failed["error"] == {
        "code": "llm_status",
        "message": "provider 'default' answered 400: Invalid request.",
    }
    assert events[-1]["type"] == "execution:failed"
    assert len(llm.requests) == 1


async def test_a_json_reply_is_parsed_and_a_bad_one_fails_the_attempt(
    client: httpx.AsyncClient, llm: FakeLLM
) -> None:
    llm.script(
        Reply(pieces=['{"verdict": ', '"yes"']),  # cut short: not JSON
        Reply(pieces=["```json\n", '{"verdict": "yes", "score": 3}', "\n```"]),
    )
    events = await run(
        client, llm_workflow(f"llm-{uuid.uuid4().hex[:6]}", responseFormat="json"), name="Gu"
    )
    failed = next(e for e in events if e["type"] == "block:failed")["data"]
    assert failed["error"]["code"] == "llm_bad_json" and failed["willRetry"] is True
    output = events[-2]["data"]["output"]
    assert output["json"] == {"verdict": "yes", "score": 3}
    assert llm.requests[0].body["response_format"] == {"type": "json_object"}


async def test_an_unknown_provider_is_refused_when_the_workflow_is_stored(
    client: httpx.AsyncClient,
) -> None:
    for provider, message in [
        ("elsewhere", "unknown llm provider 'elsewhere' (configured: default, spare)"),
        ("{{ input.provider }}", "must be a provider's name, not a template"),
    ]:
        workflow = llm_workflow(f"llm-{uuid.uuid4().hex[:6]}", provider=provider)
        answer = await client.put(f"/api/workflows/{workflow['id']}", json=workflow)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["problems"] == [
            {"path": "$.blocks[0].config.provider", "message": message}
        ]
    named = llm_workflow(f"llm-{uuid.uuid4().hex[:6]}", provider="spare")
    assert (await client.put(f"/api/workflows/{named['id']}", json=named)).status_code == 201


async def test_without_a_provider_the_shipped_example_answers_a_clear_422(
    client: httpx.AsyncClient, server: FlowcastServer
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as plain:
        listed = (await plain.get("/api/workflows")).json()
        assert "draft-and-send" in {w["id"] for w in listed["workflows"]}
        answer = await plain.post(
            "/api/workflows/draft-and-send/execute", json={"input": {"question": "Hi?"}}
        )
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "llm_provider_unknown"
    assert "FLOWCAST_LLM_BASE_URL" in error["problems"][0]["message"]


async def test_calls_never_exceed_the_cap_across_two_replicas_and_every_run_completes(
    llm: FakeLLM, valkey: ValkeyServer, tmp_path: Path
) -> None:
    llm.default = Reply(pieces=["slow ", "reply"], delay=0.25)
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"cap{uuid.uuid4().hex[:6]}",
        "FLOWCAST_LLM_PROVIDERS": providers(llm, cap=3),
    }
    replicas = [FlowcastServer(data_dir=tmp_path / name, env=env) for name in ("a", "b")]
    await asyncio.gather(*(replica.start() for replica in replicas))
    clients = [httpx.AsyncClient(base_url=r.url, timeout=60) for r in replicas]
    try:
        workflow = llm_workflow("capped")
        await put(clients[0], workflow)
        started = await asyncio.gather(
            *(
                clients[i % 2].post("/api/workflows/capped/execute", json={"input": {"name": i}})
                for i in range(24)
            )
        )
        ids = [(i % 2, answer.json()["executionId"]) for i, answer in enumerate(started)]
        endings = await asyncio.gather(*(wait_finished(clients[c], eid) for c, eid in ids))
        assert {snapshot["status"] for snapshot in endings} == {"completed"}
        assert len(llm.requests) == 24
        assert llm.max_in_flight == 3  # the cap was reached, never passed
    finally:
        for client in clients:
            await client.aclose()
        await asyncio.gather(*(replica.stop() for replica in replicas))


async def test_a_killed_holder_frees_its_slot_and_its_run_is_recovered(
    llm: FakeLLM, valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"kill{uuid.uuid4().hex[:6]}",
        "FLOWCAST_LLM_PROVIDERS": providers(llm, cap=1),
        "FLOWCAST_LEASE_SECONDS": "1",
    }
    holder = FlowcastServer(data_dir=tmp_path / "holder", env=env)
    other = FlowcastServer(data_dir=tmp_path / "other", env=env)
    await asyncio.gather(holder.start(), other.start())
    try:
        async with (
            httpx.AsyncClient(base_url=holder.url, timeout=60) as first,
            httpx.AsyncClient(base_url=other.url, timeout=60) as second,
        ):
            await put(first, llm_workflow("held"))
            llm.script(Reply(pieces=["never"], delay=5))  # the holder's call hangs
            held = await first.post("/api/workflows/held/execute", json={"input": {"name": 1}})
            await llm.wait_in_flight(1)
            waiting = await second.post("/api/workflows/held/execute", json={"input": {"name": 2}})
            await holder.stop(signal.SIGKILL)
            # The slot's lease ends, the waiting call goes ahead, and the killed run is
            # taken over and completes too.
            for eid in (waiting.json()["executionId"], held.json()["executionId"]):
                assert (await wait_finished(second, eid))["status"] == "completed"
    finally:
        await asyncio.gather(holder.stop(), other.stop())
