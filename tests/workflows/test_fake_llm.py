"""The fake LLM speaks the OpenAI chat-completions protocol, driven by a real HTTP client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.support.llm import FakeLLM, Reply


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    with FakeLLM(api_key="sk-test") as fake:
        yield fake


def request(content: str = "Say hello", **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": content}], **extra}


AUTH = {"Authorization": "Bearer sk-test"}


async def test_streamed_reply_arrives_piece_by_piece_then_usage_and_done(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    llm.script(Reply(text="Hello there, world", piece_delay=0.01))
    body = request(stream=True, stream_options={"include_usage": True})
    async with aconnect_sse(
        http_client, "POST", f"{llm.url}/chat/completions", json=body, headers=AUTH
    ) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        data = [sse.data async for sse in source.aiter_sse()]

    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert {chunk["model"] for chunk in chunks} == {"gpt-test"}
    *content, finish, usage = chunks
    deltas = [chunk["choices"][0]["delta"] for chunk in content]
    assert deltas == [
        {"role": "assistant", "content": "Hello "},
        {"content": "there, "},
        {"content": "world"},
    ]
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    [seen] = llm.requests
    assert seen.body == body
    assert seen.headers["authorization"] == "Bearer sk-test"


async def test_plain_reply_echoes_the_last_message_once_the_key_is_right(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    llm.script(Reply(echo=True, finish_reason="length"))
    url = f"{llm.url}/chat/completions"

    refused = await http_client.post(url, json=request("Repeat after me"))
    answered = await http_client.post(url, json=request("Repeat after me"), headers=AUTH)

    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert answered.status_code == 200
    completion = answered.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Repeat after me",
    }
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_rate_limited_reply_carries_retry_after_then_the_default_answers(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    llm.script(Reply(status=429, headers={"Retry-After": "1"}))
    url = f"{llm.url}/chat/completions"

    limited = await http_client.post(url, json=request(stream=True), headers=AUTH)
    allowed = await http_client.post(url, json=request(), headers=AUTH)

    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "1"
    assert limited.headers["content-type"] == "application/json"
    assert limited.json()["error"]["type"] == "requests"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert allowed.status_code == 200
    assert allowed.json()["choices"][0]["message"]["content"] == "Hello from the fake model."


async def test_break_after_cuts_the_stream_mid_body(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    llm.script(Reply(text="one two three four", break_after=2))
    pieces: list[str] = []

    with pytest.raises(httpx.RemoteProtocolError):
        async with aconnect_sse(
            http_client,
            "POST",
            f"{llm.url}/chat/completions",
            json=request(stream=True),
            headers=AUTH,
        ) as source:
            async for sse in source.aiter_sse():
                pieces.append(json.loads(sse.data)["choices"][0]["delta"]["content"])

    assert pieces == ["one ", "two "]
    await llm.wait_idle()
    assert llm.in_flight == 0


async def test_a_request_in_flight_keeps_its_reply_when_the_default_changes(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    """A test waits for a request in flight, then sets the reply of the next one: the
    request counted already has its reply. It was counted on arrival, before the reply
    was taken, so a slot holder got the quick reply meant for its waiter on a busy
    machine. Found by the step 15 flake review (issue 23, point 6)."""
    llm.default = Reply(text="first", delay=0.3)
    call = asyncio.create_task(
        http_client.post(f"{llm.url}/chat/completions", json=request(), headers=AUTH)
    )
    await llm.wait_in_flight(1)
    llm.default = Reply(text="second")
    answer = (await call).json()
    assert answer["choices"][0]["message"]["content"] == "first"


async def test_max_in_flight_counts_concurrent_slow_requests(
    llm: FakeLLM, http_client: httpx.AsyncClient
) -> None:
    llm.default = Reply(delay=0.3)
    url = f"{llm.url}/chat/completions"

    async with asyncio.TaskGroup() as group:
        calls = [
            group.create_task(http_client.post(url, json=request(), headers=AUTH)) for _ in "ab"
        ]
        await llm.wait_in_flight(2)

    assert [call.result().status_code for call in calls] == [200, 200]
    assert llm.max_in_flight == 2
    await llm.wait_idle()
    llm.reset()
    assert (llm.requests, llm.max_in_flight) == ([], 0)
