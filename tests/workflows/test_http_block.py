"""The http block against a real server on 127.0.0.1 (uvicorn in a thread)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from email.utils import formatdate
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from lib.workflows.blocks import BlockServices, BlockTypes
from lib.workflows.blocks.base import idempotency_key
from lib.workflows.blocks.http import MAX_REDIRECTS, is_refused_address, parse_retry_after
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

    async def keys(request: Request) -> Response:
        # Every Idempotency-Key header line received, so a doubled header would show.
        count = await record(request)
        if request.path_params["case"].startswith("flaky") and count == 1:
            return Response("try again", status_code=503)
        return JSONResponse({"keys": request.headers.getlist("idempotency-key")})

    async def broken(request: Request) -> Response:
        await record(request)
        return Response("down", status_code=503)

    async def hop(request: Request) -> Response:
        # /hop/3 -> /hop/2 -> /hop/1 -> /hop/0 -> /echo, every hop a relative redirect.
        await record(request)
        left = int(request.path_params["left"])
        location = f"/hop/{left - 1}" if left > 0 else "/echo"
        return Response(status_code=302, headers={"Location": location})

    async def moved(request: Request) -> Response:
        await record(request)
        status = int(request.path_params["status"])
        return Response(status_code=status, headers={"Location": "/echo"})

    async def loop(request: Request) -> Response:
        await record(request)
        return Response(status_code=307, headers={"Location": "/loop"})

    async def to_file(request: Request) -> Response:
        await record(request)
        return Response(status_code=302, headers={"Location": "file:///etc/passwd"})

    return Starlette(
        routes=[
            Route("/echo", echo, methods=["GET", "POST"]),
            Route("/text", text),
            Route("/throttled/{case}", throttled),
            Route("/keys/{case}", keys),
            Route("/broken", broken),
            Route("/hop/{left}", hop),
            Route("/moved/{status}", moved, methods=["GET", "POST"]),
            Route("/loop", loop),
            Route("/to-file", to_file),
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


async def test_every_attempt_of_a_retried_block_sends_the_same_idempotency_key(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    path = f"/keys/flaky-{uuid.uuid4().hex}"
    block = http_block(f"{server.url}{path}", retry={"attempts": 3, "backoffMs": 0})
    output, recorder = await run_workflow(workflow([block]))
    assert [started["attempt"] for started in recorder.of("block:started")] == [1, 2]
    assert [failed["error"]["code"] for failed in recorder.of("block:failed")] == ["http_status"]
    expected = idempotency_key("ex_test", "call")
    assert output["call"]["body"] == {"keys": [expected]}
    assert [headers["idempotency-key"] for _, headers, _ in server.seen.of(path)] == [
        expected,
        expected,
    ]


async def test_blocks_and_executions_send_different_idempotency_keys(
    services: BlockServices, server: LiveServer
) -> None:
    case = uuid.uuid4().hex
    blocks = [
        {"id": name, "type": "http", "config": {"url": f"{server.url}/keys/{case}"}}
        for name in ("first", "second")
    ]
    definition = Workflow.model_validate(workflow(blocks))
    executor = Executor(BlockTypes.builtin(), services)
    received: dict[tuple[str, str], list[str]] = {}
    for execution_id in ("ex_one", "ex_two"):
        output = await executor.run(
            definition, execution_id=execution_id, input=None, emit=Recorder()
        )
        for name in ("first", "second"):
            received[execution_id, name] = output[name]["body"]["keys"]
    assert received == {
        (execution_id, name): [idempotency_key(execution_id, name)]
        for execution_id in ("ex_one", "ex_two")
        for name in ("first", "second")
    }
    assert len({keys[0] for keys in received.values()}) == 4


async def test_an_idempotency_key_set_in_the_config_is_sent_instead(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    path = f"/keys/flaky-{uuid.uuid4().hex}"
    block = http_block(
        f"{server.url}{path}",
        headers={"idempotency-KEY": "order-{{ input.n }}"},
        retry={"attempts": 2, "backoffMs": 0},
    )
    output, _ = await run_workflow(workflow([block]), input={"n": 7})
    assert output["call"]["body"] == {"keys": ["order-7"]}
    assert [headers["idempotency-key"] for _, headers, _ in server.seen.of(path)] == [
        "order-7",
        "order-7",
    ]


async def test_server_errors_are_retried_then_fail(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    block = http_block(f"{server.url}/broken", retry={"attempts": 2, "backoffMs": 1})
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]))
    assert caught.value.code == "http_status"
    assert len(server.seen.of("/broken")) == 2


async def test_redirect_chains_are_followed_with_the_same_idempotency_key(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    output, _ = await run_workflow(workflow([http_block(f"{server.url}/hop/3")]))
    assert output["call"]["status"] == 200
    assert output["call"]["body"] == {"method": "GET", "got": None}
    paths = ["/hop/3", "/hop/2", "/hop/1", "/hop/0"]
    keys = {server.seen.of(path)[-1][1]["idempotency-key"] for path in [*paths, "/echo"]}
    assert keys == {idempotency_key("ex_test", "call")}


@pytest.mark.parametrize(
    ("status", "method", "body"),
    [
        (303, "GET", None),
        (302, "GET", None),
        (301, "GET", None),
        (307, "POST", {"n": 1}),
        (308, "POST", {"n": 1}),
    ],
)
async def test_redirected_posts_follow_the_usual_method_rules(
    run_workflow: RunWorkflow, server: LiveServer, status: int, method: str, body: Any
) -> None:
    block = http_block(f"{server.url}/moved/{status}", method="POST", json={"n": 1})
    output, _ = await run_workflow(workflow([block]))
    assert output["call"]["body"] == {"method": method, "got": body}


async def test_redirect_loops_stop_after_five_hops(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    before = len(server.seen.of("/loop"))
    block = http_block(f"{server.url}/loop", retry={"attempts": 3, "backoffMs": 0})
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]))
    assert caught.value.code == "too_many_redirects"
    assert len(server.seen.of("/loop")) - before == 1 + MAX_REDIRECTS


async def test_redirects_to_other_schemes_are_refused(
    run_workflow: RunWorkflow, server: LiveServer
) -> None:
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([http_block(f"{server.url}/to-file")]))
    assert caught.value.code == "bad_url"


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
        ("100.64.0.1", True),
        ("::", True),
        ("::7f00:1", True),
        ("fec0::1", True),
        ("ff0e::1", True),
        ("64:ff9b::a00:1", True),
        ("64:ff9b::a9fe:a9fe", True),
        ("2002:7f00:1::", True),
        ("8.8.8.8", False),
        ("2606:4700:4700::1111", False),
        ("::ffff:8.8.8.8", False),
        ("64:ff9b::808:808", False),
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


# Strict mode (private addresses refused) against names the tests resolve themselves.
# Requests go to an httpx.MockTransport, so no packet leaves the process whatever
# address a test makes a name resolve to.

PUBLIC = "93.184.215.14"
OTHER_PUBLIC = "2606:4700:4700::1111"


@dataclass
class FakeDns:
    """A resolver seam: each name's successive answers (the last one repeats)."""

    answers: dict[str, list[list[str]]]
    lookups: list[str] = field(default_factory=list)

    async def __call__(
        self, host: str, port: int
    ) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        self.lookups.append(host)
        if host not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        queue = self.answers[host]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        return [ipaddress.ip_address(address) for address in answer]


Handler = Callable[[httpx.Request], httpx.Response]


@dataclass
class Traffic:
    """Every request the mock transport received, answered by ``handler``."""

    handler: Handler
    requests: list[httpx.Request] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)


def answer_ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"ok": True})


async def run_strict(
    services: BlockServices,
    dns: FakeDns,
    traffic: Traffic,
    block: dict[str, Any],
    recorder: Recorder | None = None,
) -> dict[str, Any]:
    """Run one block with private addresses refused, over the mock transport."""
    async with httpx.AsyncClient(transport=httpx.MockTransport(traffic)) as client:
        strict = replace(services, http=client, http_allow_private=False, resolve=dns)
        definition = Workflow.model_validate(workflow([block]))
        output: dict[str, Any] = await Executor(BlockTypes.builtin(), strict).run(
            definition, execution_id="ex", input=None, emit=recorder or Recorder()
        )
        return output


@pytest.mark.parametrize(
    "answer",
    [["10.0.0.1"], ["169.254.169.254"], ["::ffff:127.0.0.1"], [PUBLIC, "10.0.0.1"]],
)
async def test_names_resolving_to_private_addresses_are_refused_before_connecting(
    services: BlockServices, answer: list[str]
) -> None:
    dns = FakeDns({"public.example": [answer]})
    traffic = Traffic(answer_ok)
    block = http_block("http://user:secret@public.example/", retry={"attempts": 3})
    recorder = Recorder()
    with pytest.raises(BlockFailed) as caught:
        await run_strict(services, dns, traffic, block, recorder)
    assert caught.value.code == "address_refused"
    assert [f["willRetry"] for f in recorder.of("block:failed")] == [False]
    assert "secret" not in caught.value.message
    assert traffic.requests == []


async def test_the_request_is_pinned_to_the_checked_address(services: BlockServices) -> None:
    # Rebinding: the name answers a public address for the check and loopback after it.
    dns = FakeDns({"public.example": [[PUBLIC], ["127.0.0.1"]]})
    traffic = Traffic(answer_ok)
    block = http_block("https://public.example:8443/path?q=1")
    output = await run_strict(services, dns, traffic, block)
    assert output["call"]["body"] == {"ok": True}
    assert dns.lookups == ["public.example"]
    (request,) = traffic.requests
    assert str(request.url) == f"https://{PUBLIC}:8443/path?q=1"
    assert request.headers["host"] == "public.example:8443"
    assert request.extensions["sni_hostname"] == "public.example"
    assert request.headers["connection"] == "close"
    assert request.headers["idempotency-key"] == idempotency_key("ex", "call")


async def test_pinned_ipv6_addresses_are_bracketed(services: BlockServices) -> None:
    dns = FakeDns({"public.example": [[OTHER_PUBLIC]]})
    traffic = Traffic(answer_ok)
    await run_strict(services, dns, traffic, http_block("http://public.example/x"))
    (request,) = traffic.requests
    assert str(request.url) == f"http://[{OTHER_PUBLIC}]/x"
    assert request.headers["host"] == "public.example"
    assert "sni_hostname" not in request.extensions


async def test_the_next_checked_address_is_tried_when_connecting_fails(
    services: BlockServices,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == OTHER_PUBLIC:
            raise httpx.ConnectError("unreachable", request=request)
        return answer_ok(request)

    dns = FakeDns({"public.example": [[OTHER_PUBLIC, PUBLIC]]})
    traffic = Traffic(handler)
    output = await run_strict(services, dns, traffic, http_block("http://public.example/"))
    assert output["call"]["status"] == 200
    assert [request.url.host for request in traffic.requests] == [OTHER_PUBLIC, PUBLIC]


@pytest.mark.parametrize(
    "location",
    [
        "http://internal.example/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.1]/",
        "http://[fd00:ec2::254]/",
    ],
)
async def test_a_redirect_to_a_private_address_is_refused(
    services: BlockServices, location: str
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(302, headers={"Location": location})

    dns = FakeDns({"public.example": [[PUBLIC]], "internal.example": [["10.0.0.1"]]})
    traffic = Traffic(handler)
    with pytest.raises(BlockFailed) as caught:
        await run_strict(services, dns, traffic, http_block("http://public.example/"))
    assert caught.value.code == "address_refused"
    assert [request.url.host for request in traffic.requests] == [PUBLIC]


async def test_authorization_is_dropped_on_cross_origin_redirects(
    services: BlockServices,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/first":
            return httpx.Response(301, headers={"Location": "/second"})
        if request.url.path == "/second":
            return httpx.Response(302, headers={"Location": "https://other.example/third"})
        return answer_ok(request)

    dns = FakeDns({"public.example": [[PUBLIC]], "other.example": [[OTHER_PUBLIC]]})
    traffic = Traffic(handler)
    block = http_block("http://public.example/first", headers={"Authorization": "Bearer t"})
    output = await run_strict(services, dns, traffic, block)
    assert output["call"]["status"] == 200
    first, second, third = traffic.requests
    assert first.headers["authorization"] == second.headers["authorization"] == "Bearer t"
    assert "authorization" not in third.headers
    assert str(third.url) == f"https://[{OTHER_PUBLIC}]/third"
    assert third.headers["host"] == "other.example"
    assert third.extensions["sni_hostname"] == "other.example"
    keys = {request.headers["idempotency-key"] for request in traffic.requests}
    assert keys == {idempotency_key("ex", "call")}
