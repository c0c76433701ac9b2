"""The http block against a real server on 127.0.0.1 (uvicorn in a thread)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from email.utils import formatdate
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from lib.workflows.blocks import BlockServices, BlockTypes
from lib.workflows.blocks.http import idempotency_key, is_refused_address, parse_retry_after
from lib.workflows.executor import BlockFailed, Executor
from lib.workflows.model import Workflow

from .conftest import Recorder, RunWorkflow, workflow


@dataclass
class Seen:
    """What the test server received, per path."""

    requests: dict[str, list[tuple[float, dict[str, str], bytes]]] = field(default_factory=dict)

    def of(self, path: str) -> list[tuple[float, dict[str, str], bytes]]:
        return self.requests.get(path, [])


def build_app(seen: Seen) -> Starlette:
    async def record(request: Request) -> int:
        body = await request.body()
        entries = seen.requests.setdefault(request.url.path, [])
        entries.append((time.monotonic(), dict(request.headers), body))
        return len(entries)

    async def echo(request: Request) -> Response:
        await record(request)
        body = await request.json() if request.method == "POST" else None
        return JSONResponse({"method": request.method, "got": body}, headers={"X-Echo": "yes"})

    async def text(request: Request) -> Response:
        await record(request)
        return PlainTextResponse("plain words", status_code=201)

    async def throttled(request: Request) -> Response:
        count = await record(request)
        if count == 1:
            return Response(status_code=429, headers={"Retry-After": "1"})
        return JSONResponse({"attempt": count})

    async def broken(request: Request) -> Response:
        await record(request)
        return Response("down", status_code=503)

    async def redirect(request: Request) -> Response:
        await record(request)
        return Response(status_code=302, headers={"Location": "http://169.254.169.254/"})

    return Starlette(
        routes=[
            Route("/echo", echo, methods=["GET", "POST"]),
            Route("/text", text),
            Route("/throttled/{case}", throttled),
            Route("/broken", broken),
            Route("/redirect", redirect),
        ]
    )


@dataclass
class LiveServer:
    url: str
    seen: Seen


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    seen = Seen()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(seen), lifespan="off", log_level="warning", ws="none", http="h11", loop="asyncio"
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)  # polling the real readiness flag
    yield LiveServer(f"http://127.0.0.1:{port}", seen)
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def http_block(url: str, **config: Any) -> dict[str, Any]:
    retry = config.pop("retry", None)
    block: dict[str, Any] = {"id": "call", "type": "http", "config": {"url": url, **config}}
    if retry:
        block["retry"] = retry
    return block


async def test_json_body_is_sent_and_parsed(run_workflow: RunWorkflow, server: LiveServer) -> None:
    block = http_block(f"{server.url}/echo", method="post", json={"n": "{{ input.n }}"})
    output, _ = await run_workflow(workflow([block]), input={"n": 5})
    result = output["call"]
    assert result["status"] == 200
    assert result["body"] == {"method": "POST", "got": {"n": 5}}
    assert result["headers"]["x-echo"] == "yes"
    assert result["headers"]["content-type"] == "application/json"


async def test_text_body_is_returned_as_text(run_workflow: RunWorkflow, server: LiveServer) -> None:
    output, _ = await run_workflow(workflow([http_block(f"{server.url}/text")]))
    assert output["call"]["status"] == 201
    assert output["call"]["body"] == "plain words"


async def test_retry_after_is_honoured_with_the_same_idempotency_key(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    url = f"{server.url}/throttled/once"
    block = http_block(url, retry={"attempts": 3, "backoffMs": 0})
    output, recorder = await run_workflow(workflow([block]))
    assert output["call"]["body"] == {"attempt": 2}
    failure = recorder.of("block:failed")[0]
    assert failure["error"]["code"] == "http_status"
    assert failure["willRetry"] is True
    (first_at, first_headers, _), (second_at, second_headers, _) = server.seen.of("/throttled/once")
    assert second_at - first_at >= 0.95
    assert first_headers["idempotency-key"] == second_headers["idempotency-key"]
    assert first_headers["idempotency-key"] == idempotency_key("ex_test", "call")


async def test_server_errors_are_retried_then_fail(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    block = http_block(f"{server.url}/broken", retry={"attempts": 2, "backoffMs": 1})
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]))
    assert caught.value.code == "http_status"
    assert len(server.seen.of("/broken")) == 2


async def test_redirects_are_not_followed(run_workflow: RunWorkflow, server: LiveServer) -> None:
    output, _ = await run_workflow(workflow([http_block(f"{server.url}/redirect")]))
    assert output["call"]["status"] == 302
    assert output["call"]["headers"]["location"] == "http://169.254.169.254/"


async def test_network_errors_are_retryable(run_workflow: RunWorkflow) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port now
    block = http_block(f"http://127.0.0.1:{port}/", retry={"attempts": 2, "backoffMs": 0})
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]))
    assert caught.value.code == "http_error"


async def test_private_address_is_refused_unless_allowed(
    services: BlockServices, server: LiveServer
) -> None:
    strict = Executor(BlockTypes.builtin(), replace(services, http_allow_private=False))
    port = server.url.rsplit(":", 1)[1]
    for url in (f"{server.url}/echo", f"http://localhost:{port}/echo", "http://[::1]:1/"):
        before = len(server.seen.of("/echo"))
        recorder = Recorder()
        definition = Workflow.model_validate(workflow([http_block(url, retry={"attempts": 3})]))
        with pytest.raises(BlockFailed) as caught:
            await strict.run(definition, execution_id="ex", input=None, emit=recorder)
        assert caught.value.code == "address_refused"
        assert [f["willRetry"] for f in recorder.of("block:failed")] == [False]
        assert len(server.seen.of("/echo")) == before


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("192.168.0.1", True),
        ("169.254.169.254", True),
        ("100.100.100.200", True),
        ("0.0.0.0", True),
        ("224.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("fe80::1", True),
        ("fd00:ec2::254", True),
        ("8.8.8.8", False),
        ("2606:4700:4700::1111", False),
    ],
)
def test_address_policy(address: str, refused: bool) -> None:
    assert is_refused_address(ipaddress.ip_address(address)) is refused


def test_retry_after_parses_seconds_and_http_dates() -> None:
    now = time.time()
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    in_ten = formatdate(now + 10, usegmt=True)
    assert 8.0 <= (parse_retry_after(in_ten, now=now) or 0) <= 10.0
    assert parse_retry_after(formatdate(now - 100, usegmt=True), now=now) == 0.0


def test_idempotency_key_differs_per_block_and_execution() -> None:
    keys = {idempotency_key(e, b) for e in ("e1", "e2") for b in ("a", "b")}
    assert len(keys) == 4
