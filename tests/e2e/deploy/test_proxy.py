"""nginx in front of two replicas, from the repository's own ``deploy/nginx.conf.template``.

A real nginx process (a free 127.0.0.1 port, its files under a temporary directory)
proxies to two uvicorn processes on one Valkey, as compose runs them: streams pass
unbuffered, reconnects with Last-Event-ID land on either replica and get exactly what
they missed, a pause resumed through the proxy goes on on the same stream, a POST a
replica may have received is never sent to the other, and nginx's own answers speak
Flowcast's error format.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.embedded import free_port
from tests.support.api import all_events, put, start_execution, talking_workflow
from tests.support.logcheck import TERMINAL, check_log
from tests.support.proxy import NGINX, Dropper, NginxProxy
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import collect, events

pytestmark = [
    pytest.mark.skipif(
        not NGINX.exists(),
        reason=f"{NGINX} is missing: `make nginx` installs it (as root, from Debian's nginx)",
    ),
    pytest.mark.timeout(60),
]

KEY = "proxy-key-" + "k" * 20
AUTH = {"Authorization": f"Bearer {KEY}"}
SSE = {"Accept": "text/event-stream"}


def address(server: FlowcastServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
async def replicas(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Two replicas as compose runs them: one store, the same keys and secret."""
    root = tmp_path_factory.mktemp("replicas")
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": "proxy",
        "FLOWCAST_API_KEYS": KEY,
        "FLOWCAST_SECRET_KEY": "proxy-secret-" + "s" * 20,
        "FLOWCAST_SSE_PING_SECONDS": "1",
        "FLOWCAST_BODY_TIMEOUT_SECONDS": "3",
    }
    pair = (
        FlowcastServer(data_dir=root / "a", env=env),
        FlowcastServer(data_dir=root / "b", env=env),
    )
    await asyncio.gather(*(server.start() for server in pair))
    yield pair
    await asyncio.gather(*(server.stop() for server in pair))


@pytest.fixture(scope="module")
async def proxy(
    replicas: tuple[FlowcastServer, FlowcastServer], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[NginxProxy]:
    a, b = replicas
    directory = tmp_path_factory.mktemp("nginx")
    async with NginxProxy(directory=directory, replicas=(address(a), address(b))) as nginx:
        yield nginx


@pytest.fixture
async def through(proxy: NginxProxy) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the proxy's one address, with the API key."""
    async with httpx.AsyncClient(base_url=proxy.url, headers=AUTH, timeout=20) as client:
        yield client


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"approved": {"type": "boolean"}}}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "ask", "type": "approval", "config": {"prompt": "Go on?", "schema": schema}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [{"from": "ask", "to": "done"}],
    }


def test_the_repository_config_passes_nginx_t(tmp_path: Path) -> None:
    nginx = NginxProxy(directory=tmp_path, replicas=("127.0.0.1:8001", "127.0.0.1:8002"))
    result = nginx.check()
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr and "test is successful" in result.stderr


async def test_a_frame_passes_the_proxy_as_soon_as_the_replica_writes_it(
    through: httpx.AsyncClient, unique: str
) -> None:
    # Ten words at four a second, a few hundred bytes in all: a proxy that held frames
    # back (a buffer to fill, a compressor) would hand them over at the end.
    await put(through, talking_workflow(f"slow-{unique}", words=10, tps=4))
    headers = {**SSE, "Accept-Encoding": "gzip"}
    url = f"/api/workflows/slow-{unique}/execute"
    async with through.stream("POST", url, json={"input": {}}, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        assert "content-encoding" not in response.headers
        execution_id = response.headers["x-execution-id"]
        received = []
        async with aclosing(events(response)) as stream:
            async for frame in stream:
                received.append(frame.json)
                if frame.event == "block:chunk":
                    snapshot = (await through.get(f"/api/executions/{execution_id}")).json()
                    assert snapshot["status"] == "running", snapshot
                    break
    assert received[-1]["data"]["text"].strip() == "w0"


async def test_reconnects_through_the_proxy_land_on_both_replicas_and_get_exactly_what_they_missed(
    through: httpx.AsyncClient, proxy: NginxProxy, unique: str
) -> None:
    await put(through, talking_workflow(f"hop-{unique}", words=30, tps=20))
    key = {"Idempotency-Key": f"hop-{unique}"}
    started = await start_execution(through, f"hop-{unique}", {}, headers=key)
    # The same start again (on whichever replica): the same execution, nothing new.
    assert (await start_execution(through, f"hop-{unique}", {}, headers=key))[
        "executionId"
    ] == started["executionId"]
    seen: list[dict[str, Any]] = []
    connections = 0
    async with asyncio.timeout(30):
        while not seen or seen[-1]["type"] not in TERMINAL:
            # What EventSource does: the last id it saw, in the Last-Event-ID header.
            cursor = {"Last-Event-ID": str(seen[-1]["id"])} if seen else {}
            async with through.stream("GET", started["streamUrl"], headers={**SSE, **cursor}) as r:
                assert r.status_code == 200
                connections += 1
                async with aclosing(events(r)) as stream:
                    async for frame in stream:
                        seen.append(frame.json)
                        if len(seen) % 3 == 0:
                            break  # drop the connection every three events
    assert connections > 5
    check_log(seen)
    assert seen == await all_events(through, started["executionId"])
    streams = await proxy.logged(
        lambda entry: entry.path == started["streamUrl"], count=connections
    )
    assert {entry.upstreams[-1] for entry in streams} == set(proxy.replicas), streams


async def test_a_pause_resumed_through_the_proxy_goes_on_on_the_same_stream(
    through: httpx.AsyncClient, proxy: NginxProxy, unique: str
) -> None:
    await put(through, approval_workflow(f"ask-{unique}"))
    started = await start_execution(through, f"ask-{unique}", {})
    eid = started["executionId"]
    stream_path = started["streamUrl"]
    received: list[dict[str, Any]] = []
    # A browser's EventSource: no Authorization header, the stream token in the URL.
    async with (
        httpx.AsyncClient(base_url=proxy.url, timeout=20) as browser,
        browser.stream("GET", f"{stream_path}?token={started['streamToken']}", headers=SSE) as r,
    ):
        assert r.status_code == 200
        async with asyncio.timeout(20), aclosing(events(r)) as stream:
            async for frame in stream:
                received.append(frame.json)
                if frame.event == "execution:paused":
                    answer = {"input": {"approved": True}}
                    resumed = await through.post(f"/api/executions/{eid}/resume", json=answer)
                    assert resumed.status_code == 202, resumed.text
    types = [event["type"] for event in received]
    assert types.index("execution:paused") < types.index("execution:resumed")
    assert types[-1] == "execution:completed"
    check_log(received)
    [stream] = await proxy.logged(lambda entry: entry.path == stream_path)
    [resume] = await proxy.logged(lambda entry: entry.path.endswith(f"{eid}/resume"))
    # least_conn: the resume went to the replica without the open stream, and the
    # stream carried what that replica then ran.
    assert resume.upstreams != stream.upstreams
    logs = proxy.logs()
    assert "token=" not in logs and started["streamToken"] not in logs


async def test_nginx_resends_a_get_but_never_a_post_a_replica_may_have_received(
    replicas: tuple[FlowcastServer, FlowcastServer], tmp_path: Path, unique: str
) -> None:
    a, _ = replicas
    async with (
        Dropper() as dropper,
        httpx.AsyncClient(base_url=a.url, headers=AUTH, timeout=20) as direct,
    ):
        await put(direct, talking_workflow(f"once-{unique}", words=1, tps=0))
        upstreams = (address(a), dropper.address)
        async with (
            NginxProxy(directory=tmp_path / "get", replicas=upstreams) as nginx,
            httpx.AsyncClient(base_url=nginx.url, headers=AUTH, timeout=20) as client,
        ):
            for _ in range(4):
                assert (await client.get("/api/workflows")).status_code == 200
                if dropper.received:
                    break
            assert dropper.received == ["GET /api/workflows"]
            [tried_twice] = await nginx.logged(lambda entry: len(entry.upstreams) == 2)
            assert tried_twice.upstreams == [dropper.address, address(a)]

        dropper.received.clear()
        accepted, refused = [], []
        async with (
            NginxProxy(directory=tmp_path / "post", replicas=upstreams) as nginx,
            httpx.AsyncClient(base_url=nginx.url, headers=AUTH, timeout=20) as client,
        ):
            path = f"/api/workflows/once-{unique}/execute"
            for _ in range(4):
                response = await client.post(path, json={"input": {}})
                (accepted if response.status_code == 202 else refused).append(response)
                if dropper.received:
                    break
            assert dropper.received == [f"POST {path}"]
            # The replica got the POST and never answered: it may have started the
            # execution, so nginx tells the client instead of starting another one.
            [failed] = refused
            assert failed.status_code == 502
            assert failed.json()["error"]["code"] == "bad_gateway"
            posts = await nginx.logged(
                lambda entry: entry.method == "POST", count=len(accepted) + 1
            )
            assert [entry.upstreams for entry in posts if entry.status == 502] == [
                [dropper.address]
            ]
        listed = (await direct.get(f"/api/executions?workflowId=once-{unique}")).json()
        assert len(listed["executions"]) == len(accepted)


async def test_with_a_replica_stopped_every_request_through_the_proxy_is_answered_by_the_other(
    replicas: tuple[FlowcastServer, FlowcastServer],
    proxy: NginxProxy,
    through: httpx.AsyncClient,
    unique: str,
) -> None:
    a, b = replicas
    await put(through, talking_workflow(f"left-{unique}", words=3, tps=0))
    await b.stop()
    try:
        path = f"/api/workflows/left-{unique}/execute"
        started = [await start_execution(through, f"left-{unique}", {}) for _ in range(4)]
        # b refused the connection, so nothing had been sent: that POST went on to a.
        posts = await proxy.logged(lambda entry: entry.path == path, count=len(started))
        assert [address(b), address(a)] in [entry.upstreams for entry in posts], posts
        listed = (await through.get(f"/api/executions?workflowId=left-{unique}")).json()
        assert len(listed["executions"]) == len({s["executionId"] for s in started}) == 4
        for execution in started:
            response, frames = await collect(through, execution["streamUrl"])
            assert response.status_code == 200
            check_log([frame.json for frame in frames])
    finally:
        await b.start()


async def test_what_nginx_answers_itself_speaks_flowcasts_error_format(tmp_path: Path) -> None:
    nobody = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    async with (
        NginxProxy(directory=tmp_path, replicas=nobody, max_body_bytes=4096) as nginx,
        httpx.AsyncClient(base_url=nginx.url, timeout=20) as client,
    ):
        down = await client.get("/api/workflows")
        assert down.status_code == 502
        assert down.json()["error"]["code"] == "bad_gateway"
        assert down.headers["server"] == "nginx"  # no version
        large = await client.post("/api/workflows/x/execute", content=b"x" * 4097)
        assert large.status_code == 413
        assert large.json()["error"] == {
            "code": "body_too_large",
            "message": "the request body is larger than 4096 bytes",
        }
        metrics = await client.get("/metrics")
        assert metrics.status_code == 404 and metrics.json()["error"]["code"] == "not_found"
    answered_by_nginx = [e for e in nginx.requests() if e.status in (413, 404)]
    assert [entry.upstreams for entry in answered_by_nginx] == [["-"], ["-"]]


async def test_a_server_without_api_keys_refuses_what_the_proxy_relays(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    keyless = FlowcastServer(
        data_dir=tmp_path / "open",
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": "proxy-open"},
    )
    await keyless.start()
    try:
        upstreams = (address(keyless), address(keyless))
        async with (
            NginxProxy(directory=tmp_path / "nginx", replicas=upstreams) as nginx,
            httpx.AsyncClient(timeout=20) as client,
        ):
            relayed = await client.get(f"{nginx.url}/api/workflows")
            assert relayed.status_code == 403
            error = relayed.json()["error"]
            assert error["code"] == "loopback_only" and "x-forwarded-for" in error["message"]
            assert (await client.get(f"{keyless.url}/api/workflows")).status_code == 200
    finally:
        await keyless.stop()


async def test_a_trickled_body_is_answered_408_through_the_proxy(proxy: NginxProxy) -> None:
    """Step 16's review (row 12): behind the shipped nginx, a body trickled a byte every
    20 s was never answered 408 (still connected after 65 s; to a replica directly, 408
    at its bound): nginx buffered the body, and its own bound is on the wait between two
    reads only. Bodies now pass on as they come, so the replica's bound on the whole
    body (3 s here) holds through the proxy."""
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answer = b""
    try:
        writer.write(
            (
                "PUT /api/workflows/trickled HTTP/1.1\r\nHost: proxy\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n{"
            ).encode()
        )
        await writer.drain()
        async with asyncio.timeout(30):
            while not answer:
                try:
                    async with asyncio.timeout(0.5):
                        answer = await reader.read(4096)
                except TimeoutError:
                    writer.write(b" ")  # a byte at a time, well within nginx's own bound
                    await writer.drain()
            # The head and the body may come in separate reads.
            while b"\r\n\r\n" not in answer:
                answer += await reader.read(4096)
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body += await reader.readexactly(length - len(body))
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"body_timeout" in body
