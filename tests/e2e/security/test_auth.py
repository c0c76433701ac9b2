"""API keys as tenants, stream tokens scoped to one execution, relayed requests refused
by a keyless server, and /metrics behind keys."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from app.auth import LoopbackOnly
from app.tokens import StreamTokens, load_secret
from tests.support.api import put, streaming_workflow, wait_finished
from tests.support.live_list import LIVE
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer, authed, bearer, serving
from tests.support.sse import collect

ALICE, BOB = "alice-key-" + "a" * 20, "bob-key-" + "b" * 20


@pytest.fixture(scope="module")
async def keyed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root = tmp_path_factory.mktemp("keyed")
    async with serving(valkey, root, api_keys=f"{ALICE}, {BOB}") as server:
        yield server


@pytest.fixture
async def alice(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(keyed, ALICE) as client:
        yield client


@pytest.fixture
async def anonymous(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(keyed) as client:
        yield client


async def test_every_api_route_needs_a_valid_key(anonymous: httpx.AsyncClient) -> None:
    for method, url in [
        ("GET", "/api/workflows"),
        ("PUT", "/api/workflows/x"),
        ("GET", "/api/executions"),
        ("GET", "/api/executions/ex_x"),
        ("GET", "/api/executions/ex_x/events"),
        ("GET", "/api/executions/ex_x/stream"),
        ("POST", "/api/executions/ex_x/resume"),
        ("POST", "/api/executions/ex_x/cancel"),
        ("POST", "/api/workflows/stream-story/execute"),
    ]:
        for headers in ({}, bearer("wrong-key"), {"Authorization": "Basic abc"}):
            response = await anonymous.request(method, url, headers=headers, json={})
            assert response.status_code == 401, (method, url, headers)
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
    assert (await anonymous.get("/healthz")).status_code == 200


async def test_metrics_need_a_key_once_keys_are_set(
    alice: httpx.AsyncClient, anonymous: httpx.AsyncClient
) -> None:
    for headers in ({}, bearer("wrong-key")):
        response = await anonymous.get("/metrics", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    # A stream token is for one execution's stream, not for the process's figures.
    assert (await anonymous.get("/metrics?token=1.abc")).status_code == 401
    response = await alice.get("/metrics")
    assert response.status_code == 200
    assert "flowcast_executions_total" in response.text


async def test_health_the_api_description_and_the_page_answer_without_a_key(
    anonymous: httpx.AsyncClient,
) -> None:
    # Probes and docs carry no tenant's data: a load balancer, a container healthcheck
    # and a person reading the API reference have no key.
    for url in ("/healthz", "/readyz", "/openapi.json", "/docs", "/"):
        assert (await anonymous.get(url)).status_code == 200, url
    assert "/metrics" in (await anonymous.get("/openapi.json")).json()["paths"]


async def test_metrics_public_opens_metrics_and_nothing_else(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    async with (
        serving(valkey, tmp_path, api_keys=ALICE, metrics_public="true") as server,
        authed(server) as scraper,
    ):
        response = await scraper.get("/metrics")
        assert response.status_code == 200
        assert "flowcast_sse_clients" in response.text
        assert (await scraper.get("/api/executions")).status_code == 401


async def test_each_key_is_a_tenant_that_sees_only_its_own_things(
    keyed: FlowcastServer, alice: httpx.AsyncClient, unique: str
) -> None:
    await put(alice, streaming_workflow(f"mine-{unique}", words=3))
    started = (await alice.post(f"/api/workflows/mine-{unique}/execute", json={})).json()
    execution_id = started["executionId"]
    await wait_finished(alice, execution_id)
    async with authed(keyed, BOB) as bob:
        assert (await bob.get(f"/api/workflows/mine-{unique}")).status_code == 404
        assert f"mine-{unique}" not in (await bob.get("/api/workflows")).text
        for url in (
            f"/api/executions/{execution_id}",
            f"/api/executions/{execution_id}/events",
            f"/api/executions/{execution_id}/stream",
        ):
            assert (await bob.get(url)).status_code == 404, url
        assert (await bob.post(f"/api/executions/{execution_id}/cancel")).status_code == 404
        assert execution_id not in (await bob.get("/api/executions")).text
        # Example workflows from files are everyone's.
        assert (await bob.get("/api/workflows/stream-story")).status_code == 200
    assert execution_id in (await alice.get("/api/executions")).text


async def test_a_stream_token_opens_the_stream_of_its_execution_only(
    alice: httpx.AsyncClient, anonymous: httpx.AsyncClient, unique: str
) -> None:
    await put(alice, streaming_workflow(f"tok-{unique}", words=5))
    first = (await alice.post(f"/api/workflows/tok-{unique}/execute", json={})).json()
    second = (await alice.post(f"/api/workflows/tok-{unique}/execute", json={})).json()
    token = first["streamToken"]
    response, frames = await collect(anonymous, f"{first['streamUrl']}?token={token}")
    assert response.status_code == 200
    check_log(check_view(frames))
    # The same token for another execution, a tampered one, or on another route: 401.
    tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    for url in (
        f"{second['streamUrl']}?token={token}",
        f"{first['streamUrl']}?token={tampered}",
        f"/api/executions/{first['executionId']}?token={token}",
        f"/api/executions/{first['executionId']}/events?token={token}",
    ):
        assert (await anonymous.get(url)).status_code == 401, url
    # A key holder passing a token on another route is refused too.
    response = await alice.get(f"/api/executions/{first['executionId']}?token={token}")
    assert response.status_code == 401


# Hostile spellings of ``?token=``, sent as raw query strings so httpx does not tidy
# them: other Unicode digits, non-ASCII or empty parts, numbers past every limit,
# percent-encoded bytes that decode to junk (or to nothing valid in UTF-8).
HOSTILE_TOKENS = [
    "%C2%B2.abc",  # ².abc: str.isdigit says yes, int says no
    "9999999999.%C3%A9",  # a non-ASCII mac
    "%EF%BC%91%EF%BC%92.abc",  # fullwidth digits
    "%D9%A1%D9%A2%D9%A3." + "A" * 43,  # Arabic-Indic digits before a well-sized mac
    "9999999999." + "%C3%A9" * 43,
    ".",
    "",
    "123.",
    ".abc",
    "9" * 5000 + ".abc",  # past Python's limit for int("...")
    "9" * 40 + "." + "A" * 43,
    "-1." + "A" * 43,
    "1e9." + "A" * 43,
    "9999999999.%00%FF%FE",  # undecodable bytes
    "%ZZ%.%%",
    "9999999999." + "A" * 42 + "%0A",  # a trailing newline
    "9999999999." + "A" * 43 + ".extra",
]


async def test_a_malformed_stream_token_is_401_never_500(
    alice: httpx.AsyncClient, anonymous: httpx.AsyncClient, unique: str
) -> None:
    await put(alice, streaming_workflow(f"junk-{unique}", words=3))
    started = (await alice.post(f"/api/workflows/junk-{unique}/execute", json={})).json()
    execution_id = started["executionId"]
    await wait_finished(alice, execution_id)
    for path in (
        f"/api/executions/{execution_id}/stream",
        f"/api/executions/{execution_id}/values/lv_{'0' * 64}",
    ):
        for token in HOSTILE_TOKENS:
            url = httpx.URL(anonymous.base_url.join(path), query=f"token={token}".encode())
            response = await anonymous.get(url)
            assert response.status_code == 401, (path, token[:40], response.text)
            error = response.json()["error"]
            assert error["code"] == "unauthorized" and error["message"], error
            assert response.headers["www-authenticate"] == "Bearer"
    # The real token still opens the stream: the check only got stricter about shape.
    response, frames = await collect(
        anonymous, f"{started['streamUrl']}?token={started['streamToken']}"
    )
    assert response.status_code == 200
    check_log(check_view(frames))


def test_stream_tokens_expire_and_are_bound_to_their_secret(tmp_path: Path) -> None:
    secret = load_secret(None, tmp_path)
    assert load_secret(None, tmp_path) == secret  # generated once, kept
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0
    tokens = StreamTokens(secret=secret, lifetime_seconds=60)
    token = tokens.issue("ex_a", now=1_000)
    assert tokens.check(token, "ex_a", now=1_030)
    assert not tokens.check(token, "ex_a", now=1_061)
    assert not tokens.check(token, "ex_b", now=1_030)
    other = StreamTokens(secret=b"another secret", lifetime_seconds=60)
    assert not other.check(token, "ex_a", now=1_030)
    for junk in ("", ".", "abc", "123.", "x.y", f"{int(time.time()) + 60}.garbage"):
        assert not tokens.check(junk, "ex_a")
    # Malformed spellings are simply not valid, never an exception.
    expires, _, mac = token.partition(".")
    wide = expires.translate({ord(d): ord(d) + 0xFF10 - ord("0") for d in "0123456789"})
    for junk in (f"².{mac}", f"{wide}.{mac}", f"{token}\n", f"{expires}.é{mac[1:]}", "9" * 5000):
        assert not tokens.check(junk, "ex_a", now=1_030)


async def test_keys_never_appear_in_logs(keyed: FlowcastServer, alice: httpx.AsyncClient) -> None:
    await alice.get("/api/workflows")
    await alice.get("/api/workflows", headers=bearer("wrong-" + ALICE))
    logs = keyed.logs()
    assert ALICE not in logs and BOB not in logs


@pytest.mark.parametrize(
    ("server", "reaches_app"),
    [
        (("127.0.0.1", 8000), True),
        (("::1", 8000), True),
        (("localhost", 8000), True),
        (None, True),
        (("10.1.2.3", 8000), False),
        (("192.0.2.7", 8000), False),
        (("2001:db8::1", 8000), False),
    ],
)
async def test_a_server_without_keys_answers_on_loopback_addresses_only(
    server: tuple[str, int] | None, reaches_app: bool
) -> None:
    # A seam test: no test may listen on anything but 127.0.0.1, so the request's
    # server address is set in the ASGI scope, as uvicorn would for another interface.
    scope: Scope = {"type": "http", "method": "GET", "path": "/api/workflows", "headers": []}
    if server is not None:
        scope["server"] = server
    reached, sent = await through_loopback_only(scope)
    assert reached == reaches_app
    if not reaches_app:
        assert sent[0]["status"] == 403
        assert b"loopback_only" in sent[1]["body"]


@pytest.mark.parametrize(
    ("header", "reaches_app"),
    [
        ((b"x-forwarded-for", b"203.0.113.9"), False),
        ((b"x-forwarded-proto", b"https"), False),
        ((b"x-forwarded-host", b"flowcast.example"), False),
        ((b"x-real-ip", b"203.0.113.9"), False),
        ((b"forwarded", b"for=203.0.113.9"), False),
        ((b"via", b"1.1 proxy"), False),
        ((b"authorization", b"Bearer x"), True),
        ((b"last-event-id", b"7"), True),
    ],
)
async def test_a_server_without_keys_refuses_what_a_proxy_on_loopback_relays(
    header: tuple[bytes, bytes], reaches_app: bool
) -> None:
    # A proxy on this machine reaches the server on loopback: without this, it would
    # open the keyless API to everyone who can reach the proxy.
    scope: Scope = {
        "type": "http",
        "method": "GET",
        "path": "/api/workflows",
        "headers": [(b"host", b"127.0.0.1:8000"), header],
        "server": ("127.0.0.1", 8000),
    }
    reached, sent = await through_loopback_only(scope)
    assert reached == reaches_app
    if not reaches_app:
        assert sent[0]["status"] == 403
        message = orjson.loads(sent[1]["body"])["error"]["message"]
        assert header[0].decode() in message and "FLOWCAST_API_KEYS" in message


async def through_loopback_only(scope: Scope) -> tuple[bool, list[Message]]:
    """Whether a request reached the app behind LoopbackOnly, and what was sent back."""
    reached: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(True)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await LoopbackOnly(app)(scope, receive, send)
    return bool(reached), sent


async def _status_line(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return (await reader.readline()).strip()
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.timeout(60)
async def test_a_keyless_server_refuses_relayed_requests_however_the_headers_are_spelled(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Found by the step 14 review."""
    server = FlowcastServer(
        data_dir=tmp_path,
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": "b14open"},
    )
    await server.start()
    try:
        for path in (b"/api/workflows", b"/api/executions/live", b"/metrics", b"/"):
            for headers in (
                b"Host: x\r\nX-Forwarded-For: 203.0.113.9\r\n",
                b"Host: x\r\nx-FORWARDED-for: 203.0.113.9\r\n",
                b"Host: x\r\nX-Forwarded-Proto: https\r\n",
                b"Host: x\r\nX-Forwarded-For: 127.0.0.1\r\nX-Forwarded-For: 203.0.113.9\r\n",
                b"Host: x\r\nForwarded: for=203.0.113.9\r\n",
                b"Host: x\r\nVia: 1.1 proxy\r\n",
                b"Host: x\r\nX-Real-IP: 203.0.113.9\r\n",
            ):
                for version in (b"HTTP/1.1", b"HTTP/1.0"):
                    request = b"GET " + path + b" " + version + b"\r\n" + headers + b"\r\n"
                    line = await _status_line(server.port, request)
                    assert line.split()[1] == b"403", (request, line)
            # This machine's own client, unrelayed, is answered.
            ok = await _status_line(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ok.split()[1] == b"200"
    finally:
        await server.stop()


@pytest.mark.timeout(60)
async def test_metrics_behind_keys_take_only_a_key(valkey: ValkeyServer, tmp_path: Path) -> None:
    """Found by the step 14 review."""
    key = "metrics-key-" + "m" * 20
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": "b14metrics",
            "FLOWCAST_API_KEYS": key,
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            auth = {"Authorization": f"Bearer {key}"}
            list_token = (await client.post(f"{LIVE}/token", headers=auth)).json()["streamToken"]
            for url, headers in (
                ("/metrics", {}),
                ("/metrics", {"Authorization": "Bearer nope"}),
                (f"/metrics?token={list_token}", {}),
                (f"/metrics?%74oken={list_token}", {}),
                ("/metrics", {"Authorization": f"Basic {key}"}),
            ):
                response = await client.get(url, headers=headers)
                assert response.status_code == 401, (url, headers, response.status_code)
            for path in (b"/metrics/", b"/Metrics", b"//metrics", b"/metrics%2F", b"/./metrics"):
                request = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"
                line = await _status_line(server.port, request)
                # Not found, or a redirect to /metrics (which takes a key, as above).
                assert line.split()[1] in (b"401", b"404", b"307"), (path, line)
            assert (await client.get("/metrics", headers=auth)).status_code == 200
    finally:
        await server.stop()
