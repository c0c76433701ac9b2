"""``flowcast demo-model``: every ``llm`` example runs offline against it (issue 26).

Real processes: the documented command on a free loopback port, a Flowcast server
pointed at it with ``FLOWCAST_LLM_BASE_URL`` (the README's one extra setting), and the
examples run as a reader would run them: the shipped ``examples/*.json`` and every
workflow with an ``llm`` block shown in ``docs/*.md``, each run to its end with its
chunks read from the stream. A provider nobody listens on fails with an error that
names the provider and the URL it tried.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import execute, until, wait_finished
from tests.support.ports import own_port
from tests.support.servers import FlowcastServer, ValkeyServer, flowcast_on
from tests.support.sse import collect, frames

ROOT = Path(__file__).resolve().parents[3]
FLOWCAST = Path(sys.executable).with_name("flowcast")
HEREDOC = re.compile(r"<<'EOF'\n(.*?)\nEOF\n", re.DOTALL)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def has_llm(workflow: Any) -> bool:
    blocks = workflow.get("blocks") if isinstance(workflow, dict) else None
    return isinstance(blocks, list) and any(block.get("type") == "llm" for block in blocks)


def shipped_examples() -> list[dict[str, Any]]:
    found = [json.loads(path.read_text()) for path in sorted((ROOT / "examples").glob("*.json"))]
    return [workflow for workflow in found if has_llm(workflow)]


def documented_examples() -> list[dict[str, Any]]:
    """Every workflow with an ``llm`` block that the docs store with a heredoc."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for body in HEREDOC.findall(path.read_text()):
            try:
                workflow = json.loads(body)
            except ValueError:
                continue
            if has_llm(workflow):
                found.append(workflow)
    return found


@pytest.fixture(scope="module")
def demo_model() -> Iterator[str]:
    """``flowcast demo-model`` on a free port (replies at once); its base URL."""
    port = own_port()
    process = subprocess.Popen(
        [str(FLOWCAST), "demo-model", "--port", str(port), "--words-per-second", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        with httpx.Client(timeout=2) as client:
            for _ in range(400):  # until it answers; each wait also notices an exit
                try:
                    if client.get(f"{url}/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                try:
                    code = process.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    continue
                assert process.stderr is not None
                raise AssertionError(f"demo-model exited {code}: {process.stderr.read()}")
            else:
                raise AssertionError("demo-model did not answer within 20 s")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


@pytest.fixture(scope="module")
async def demo_server(
    demo_model: str, valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    server = await flowcast_on(valkey, tmp_path_factory.mktemp("demo"), llm_base_url=demo_model)
    yield server
    await server.stop()


@pytest.fixture
async def client(demo_server: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=demo_server.url, timeout=30) as http:
        yield http


async def streamed_run(
    client: httpx.AsyncClient, workflow_id: str, input: Any
) -> tuple[str, list[dict[str, Any]]]:
    """Start a run that ends without a pause with its stream attached; its id and its
    events as they arrived."""
    response, sent = await collect(
        client, f"/api/workflows/{workflow_id}/execute", method="POST", json={"input": input}
    )
    assert response.status_code == 200, response.text
    return response.headers["x-execution-id"], [frame.json for frame in sent if frame.data]


async def settled(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    """The snapshot once the run paused or ended."""

    async def still() -> dict[str, Any] | None:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        return None if snapshot["status"] in ("queued", "running") else snapshot

    found: dict[str, Any] = await until(still, f"{execution_id} paused or ended", None)
    return found


def chunks_of(events: list[dict[str, Any]], block_id: str) -> list[str]:
    return [
        event["data"]["text"]
        for event in events
        if event["type"] == "block:chunk" and event["data"].get("blockId") == block_id
    ]


@pytest.mark.timeout(60)
async def test_the_demo_model_speaks_the_chat_completions_protocol(demo_model: str) -> None:
    """Plain and streamed replies are the same text, the same for the same messages;
    ``max_tokens`` cuts, ``json_object`` is valid JSON; ``/v1/models`` lists it."""
    body = {"model": "any", "messages": [{"role": "user", "content": "What is SSE?"}]}
    async with httpx.AsyncClient(base_url=demo_model, timeout=10) as model:
        models = (await model.get("/models")).json()
        assert [item["id"] for item in models["data"]] == ["demo"]
        first = (await model.post("/chat/completions", json=body)).json()
        again = (await model.post("/chat/completions", json=body)).json()
        text = first["choices"][0]["message"]["content"]
        assert text == again["choices"][0]["message"]["content"]
        assert "What is SSE?" in text
        other = {**body, "messages": [{"role": "user", "content": "Something else"}]}
        reply = (await model.post("/chat/completions", json=other)).json()
        assert reply["choices"][0]["message"]["content"] != text

        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with model.stream("POST", "/chat/completions", json=streamed) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            sent = [frame.data async for frame in frames(response)]
        assert sent[-1] == "[DONE]"
        chunks = [json.loads(data) for data in sent[:-1] if data]
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert "".join(deltas) == text
        assert len([delta for delta in deltas if delta]) > 10
        assert chunks[-1]["usage"]["completion_tokens"] > 10

        short = (await model.post("/chat/completions", json={**body, "max_tokens": 3})).json()
        assert len(short["choices"][0]["message"]["content"].split()) == 3
        assert short["choices"][0]["finish_reason"] == "length"

        as_json = {**body, "max_tokens": 2, "response_format": {"type": "json_object"}}
        parsed = json.loads(
            (await model.post("/chat/completions", json=as_json)).json()["choices"][0]["message"][
                "content"
            ]
        )
        assert parsed["question"] == "What is SSE?"


@pytest.mark.timeout(120)
async def test_every_shipped_and_documented_llm_example_runs_against_it(
    client: httpx.AsyncClient,
) -> None:
    """Each one streams its model's reply as chunks and completes (the shipped
    draft-and-send through its approval, answered with a rejection: its webhook is on
    the internet)."""
    shipped = shipped_examples()
    documented = documented_examples()
    assert shipped and documented, (shipped, documented)
    secret = {"value": "a-webhook-token-for-the-demo"}
    assert (await client.put("/api/secrets/WEBHOOK_TOKEN", json=secret)).status_code in (200, 201)
    for workflow in [*shipped, *documented]:
        workflow_id = workflow["id"]
        if workflow_id not in {item["id"] for item in shipped}:
            stored = await client.put(f"/api/workflows/{workflow_id}", json=workflow)
            assert stored.status_code in (200, 201), stored.text
        llm_blocks = [block["id"] for block in workflow["blocks"] if block["type"] == "llm"]
        input = workflow.get("exampleInput", {"question": "What are Server-Sent Events?"})
        if any(block["type"] == "approval" for block in workflow["blocks"]):
            execution_id = await execute(client, workflow_id, input)
            paused = await settled(client, execution_id)
            assert paused["status"] == "paused", (workflow_id, paused)
            answer = {"blockId": paused["pause"]["blockId"], "input": {"approved": False}}
            resumed = await client.post(f"/api/executions/{execution_id}/resume", json=answer)
            assert resumed.status_code == 202, resumed.text
        else:  # the chunks arrive on the stream the start opened
            execution_id, live = await streamed_run(client, workflow_id, input)
            for block_id in llm_blocks:
                assert len(chunks_of(live, block_id)) > 5, (workflow_id, live)
        ended = await wait_finished(client, execution_id)
        assert ended["status"] == "completed", (workflow_id, ended)
        snapshot_events = (
            await client.get(f"/api/executions/{execution_id}/events?limit=1000")
        ).json()["events"]
        for block_id in llm_blocks:
            chunks = chunks_of(snapshot_events, block_id)
            assert len(chunks) > 5, (workflow_id, block_id, chunks)
            done = [
                event["data"]
                for event in snapshot_events
                if event["type"] == "block:completed" and event["data"]["blockId"] == block_id
            ]
            assert done[-1]["output"]["text"] == "".join(chunks), (workflow_id, done)
            assert "demo model" in done[-1]["output"]["text"]


@pytest.mark.timeout(60)
async def test_a_json_reply_from_the_demo_model_parses(client: httpx.AsyncClient) -> None:
    block = {
        "id": "classify",
        "type": "llm",
        "config": {
            "model": "demo",
            "messages": [{"role": "user", "content": "Classify: {{ input.text }}"}],
            "responseFormat": "json",
        },
    }
    stored = await client.put(
        "/api/workflows/demo-json", json={"id": "demo-json", "blocks": [block]}
    )
    assert stored.status_code in (200, 201), stored.text
    execution_id, _events = await streamed_run(client, "demo-json", {"text": "the page is down"})
    ended = await wait_finished(client, execution_id)
    assert ended["status"] == "completed", ended
    assert ended["output"]["classify"]["json"]["question"] == "Classify: the page is down"


@pytest.mark.timeout(90)
async def test_an_unreachable_provider_is_named_with_the_url_it_tried(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    port = free_port()  # nobody listens there
    url = f"http://127.0.0.1:{port}/v1"
    server = await flowcast_on(valkey, tmp_path, llm_base_url=url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            block = {
                "id": "ask",
                "type": "llm",
                "config": {"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            }
            await client.put("/api/workflows/nobody", json={"id": "nobody", "blocks": [block]})
            execution_id, _events = await streamed_run(client, "nobody", {})
            ended = await wait_finished(client, execution_id)
        assert ended["status"] == "failed", ended
        message = ended["error"]["message"]
        assert "provider 'default'" in message, message
        assert f"{url}/chat/completions" in message, message
        assert "could not be reached" in message, message
    finally:
        await server.stop()
