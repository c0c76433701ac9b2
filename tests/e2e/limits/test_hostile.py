"""Hostile tenants (SPEC §8 "Tenants are untrusted") on a real process with two keys:
an approval schema never makes the server fetch anything, and no pattern in one can
stall the server for the other tenant."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import put, until, wait_status
from tests.support.servers import FlowcastServer, ValkeyServer, authed, serving

MALLORY, ALICE = "mallory-key-" + "m" * 20, "alice-key-" + "a" * 20
CAROL = "carol-key-" + "c" * 20


@pytest.fixture(scope="module")
async def shared(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root = tmp_path_factory.mktemp("hostile")
    async with serving(valkey, root, api_keys=f"{MALLORY},{ALICE}") as server:
        yield server


@pytest.fixture
async def mallory(shared: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(shared, MALLORY) as client:
        yield client


@pytest.fixture
async def alice(shared: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(shared, ALICE) as client:
        yield client


def approval(workflow_id: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": schema}}],
    }


class Listener:
    """A loopback HTTP server that counts every connection made to it."""

    def __init__(self) -> None:
        self.hits = 0
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hits += 1
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{"type":"string"}')
        await writer.drain()
        writer.close()


async def test_a_schema_that_refers_outside_itself_is_refused_and_nothing_is_fetched(
    mallory: httpx.AsyncClient, unique: str
) -> None:
    listener = Listener()
    server = await asyncio.start_server(listener._handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for ref in (f"http://127.0.0.1:{port}/internal.json", "file:///etc/passwd"):
            schema = {"type": "object", "properties": {"x": {"$ref": ref}}}
            response = await mallory.put(
                f"/api/workflows/ref-{unique}", json=approval(f"ref-{unique}", schema)
            )
            assert response.status_code == 422, response.text
            assert "outside the schema" in response.text
            assert "root:" not in response.text
        # A ref inside the schema is fine.
        inside = {
            "$defs": {"ok": {"type": "boolean"}},
            "properties": {"ok": {"$ref": "#/$defs/ok"}},
        }
        created = await mallory.put(
            f"/api/workflows/in-{unique}", json=approval(f"in-{unique}", inside)
        )
        assert created.status_code in (200, 201), created.text
    finally:
        server.close()
        await server.wait_closed()
    assert listener.hits == 0


async def test_a_catastrophic_pattern_answers_at_once_and_never_stalls_another_tenant(
    mallory: httpx.AsyncClient, alice: httpx.AsyncClient, unique: str
) -> None:
    schema = {"type": "string", "pattern": "^(a+)+$"}
    await put(mallory, approval(f"redos-{unique}", schema))
    started = await mallory.post(f"/api/workflows/redos-{unique}/execute", json={})
    execution_id = started.json()["executionId"]
    await wait_status(mallory, execution_id, "paused", timeout=20)
    # With a backtracking engine this input takes 2**40 steps; RE2 answers at once.
    evil = {"input": "a" * 40 + "!"}
    resume = asyncio.create_task(mallory.post(f"/api/executions/{execution_id}/resume", json=evil))
    other = await alice.get("/api/workflows")
    refused = await resume
    assert other.status_code == 200
    assert refused.status_code == 422, refused.text
    assert "does not match" in refused.text
    good = await mallory.post(f"/api/executions/{execution_id}/resume", json={"input": "aaa"})
    assert good.status_code == 202, good.text


async def test_a_pattern_that_needs_backtracking_is_refused_when_stored(
    mallory: httpx.AsyncClient, unique: str
) -> None:
    schema = {"type": "string", "pattern": "^(a)\\1$"}
    workflow = approval(f"backref-{unique}", schema)
    response = await mallory.put(f"/api/workflows/backref-{unique}", json=workflow)
    assert response.status_code == 422, response.text
    assert "not supported" in response.text


@pytest.fixture(scope="module")
async def impatient(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root = tmp_path_factory.mktemp("impatient")
    async with serving(valkey, root, api_keys=MALLORY, body_timeout_seconds="1") as server:
        yield server


async def test_a_body_that_trickles_in_is_answered_408_and_closed(
    impatient: FlowcastServer,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", impatient.port)
    body = b'{"id": "slow", "blocks": []}'
    writer.write(
        b"PUT /api/workflows/slow HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {MALLORY}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    answer = b""
    async with asyncio.timeout(15):
        # One byte every half second: the whole body would take 14 s.
        for byte in body:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                answer += await asyncio.wait_for(reader.read(4096), 0.5)
            except TimeoutError:
                continue
            if answer:
                break
        reset = False
        try:
            answer += await reader.read()  # the server closes the connection after it
        except ConnectionResetError:
            # Closed too: the server closed with bytes of ours unread, and its kernel
            # answered with a reset, which may drop what of the 408 was not read yet (a
            # clean-clone run of the step 16 session).
            reset = True
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in answer.lower()
    assert reset or b"body_timeout" in answer, answer


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_storing_a_template_evaluates_nothing_and_formatting_is_bounded(
    shared: FlowcastServer, mallory: httpx.AsyncClient, unique: str
) -> None:
    workflow = {
        "id": f"fold-{unique}",
        "blocks": [
            {"id": "f", "type": "transform", "config": {"value": "{{ '%0200000000d' % 1 }}"}}
        ],
    }
    before = rss_bytes(shared.pid)
    for _ in range(3):
        response = await mallory.put(f"/api/workflows/fold-{unique}", json=workflow)
        assert response.status_code in (200, 201), response.text
    # Constant-folding that expression while compiling built ~200 MB per PUT.
    assert rss_bytes(shared.pid) - before < 50 * 1024 * 1024
    started = await mallory.post(f"/api/workflows/fold-{unique}/execute", json={})
    execution_id = started.json()["executionId"]
    snapshot = await finished(mallory, execution_id)
    assert snapshot["status"] == "failed", snapshot
    assert "too large" in snapshot["error"]["message"], snapshot


@pytest.fixture(scope="module")
async def capped(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    async with serving(
        valkey,
        tmp_path_factory.mktemp("capped"),
        api_keys=f"{MALLORY},{ALICE},{CAROL}",
        max_streams_per_tenant="3",
        max_executions_per_tenant="3",
    ) as server:
        yield server


async def test_open_streams_are_capped_per_tenant_and_freed_when_they_end(
    capped: FlowcastServer, unique: str
) -> None:
    as_mallory = {"Authorization": f"Bearer {MALLORY}"}
    as_alice = {"Authorization": f"Bearer {ALICE}"}
    async with (
        httpx.AsyncClient(base_url=capped.url, headers=as_mallory, timeout=30) as mallory,
        httpx.AsyncClient(base_url=capped.url, headers=as_alice, timeout=30) as alice,
    ):
        schema = {"type": "boolean"}
        await put(mallory, approval(f"hold-{unique}", schema))
        await put(alice, approval(f"hold-{unique}", schema))
        started = await mallory.post(f"/api/workflows/hold-{unique}/execute", json={})
        execution_id = started.json()["executionId"]
        url = f"/api/executions/{execution_id}/stream"
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(3):
                response = await stack.enter_async_context(mallory.stream("GET", url))
                assert response.status_code == 200
            refused = await mallory.get(url)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "too_many_streams"
            assert refused.headers["retry-after"]
            # The cap is per tenant: another tenant streams as usual.
            async with alice.stream(
                "POST",
                f"/api/workflows/hold-{unique}/execute",
                json={},
                headers={"Accept": "text/event-stream"},
            ) as other:
                assert other.status_code == 200
        # Closed streams free their slots.

        async def let_in() -> bool:
            async with mallory.stream("GET", url) as again:
                return again.status_code == 200

        await until(let_in, "the closed streams' slots came back", 10, every=0.05)


async def test_paused_executions_count_toward_the_tenant_cap(
    capped: FlowcastServer, unique: str
) -> None:
    as_carol = {"Authorization": f"Bearer {CAROL}"}
    async with httpx.AsyncClient(base_url=capped.url, headers=as_carol, timeout=30) as carol:
        await put(carol, approval(f"wait-{unique}", {"type": "boolean"}))
        paused = []
        for _ in range(3):
            response = await carol.post(f"/api/workflows/wait-{unique}/execute", json={})
            assert response.status_code == 202, response.text
            paused.append(response.json()["executionId"])
        for execution_id in paused:
            await wait_status(carol, execution_id, "paused", timeout=20)
        refused = await carol.post(f"/api/workflows/wait-{unique}/execute", json={})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"]
        # At its cap, a tenant still resumes its own pause; once that one ends, there
        # is room again. A cancelled pause frees its place too.
        resumed = await carol.post(f"/api/executions/{paused[0]}/resume", json={"input": True})
        assert resumed.status_code == 202, resumed.text
        cancelled = await carol.post(f"/api/executions/{paused[1]}/cancel")
        assert cancelled.status_code == 202, cancelled.text

        async def admitted() -> bool:
            again = await carol.post(f"/api/workflows/wait-{unique}/execute", json={})
            assert again.status_code in (202, 429), again.text
            return again.status_code == 202

        await until(admitted, "a start admitted once a slot is free", 20, every=0.05)


NESTED_LOOPS = "{% for a in [0]*100000 %}{% for b in [0]*1000000 %}{% endfor %}{% endfor %}"


async def finished(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:

    async def ended() -> dict[str, Any] | None:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        return snapshot if snapshot["status"] not in ("queued", "running") else None

    found: dict[str, Any] = await until(ended, f"{execution_id} ended", 20)
    return found


async def test_a_template_that_never_ends_fails_its_block_while_other_tenants_are_served(
    shared: FlowcastServer, mallory: httpx.AsyncClient, alice: httpx.AsyncClient, unique: str
) -> None:
    workflow = {
        "id": f"loops-{unique}",
        "blocks": [{"id": "spin", "type": "transform", "config": {"value": NESTED_LOOPS}}],
    }
    await put(mallory, workflow)
    before = rss_bytes(shared.pid)
    started = await mallory.post(f"/api/workflows/loops-{unique}/execute", json={})
    assert started.status_code == 202, started.text
    execution_id = started.json()["executionId"]
    # Rendered on the event loop, this template would hold every request for hours.
    answered_meanwhile = []
    async with asyncio.timeout(20):
        while True:
            other = await alice.get("/api/workflows")
            status = (await mallory.get(f"/api/executions/{execution_id}")).json()["status"]
            if status not in ("queued", "running"):
                break
            answered_meanwhile.append(other.status_code)
    assert len(answered_meanwhile) >= 3
    assert set(answered_meanwhile) == {200}
    snapshot = await finished(mallory, execution_id)
    assert snapshot["status"] == "failed", snapshot
    assert snapshot["error"]["code"] == "template_error", snapshot
    assert "too long" in snapshot["error"]["message"], snapshot
    assert rss_bytes(shared.pid) - before < 100 * 1024 * 1024


@pytest.mark.parametrize(
    "source",
    [
        "{{ [[0]*1000000]*1000 }}",
        "{{ 'a'|center(200000000) }}",
        "{{ '{:>200000000}'.format(1) }}",
        "{{ lipsum(100, false, 100000, 100001) }}",
    ],
)
async def test_a_template_that_builds_a_huge_value_fails_and_the_server_stays_small(
    shared: FlowcastServer, mallory: httpx.AsyncClient, unique: str, source: str
) -> None:
    workflow = {
        "id": f"bloat-{unique}",
        "blocks": [{"id": "big", "type": "transform", "config": {"value": source}}],
    }
    await put(mallory, workflow)
    before = rss_bytes(shared.pid)
    started = await mallory.post(f"/api/workflows/bloat-{unique}/execute", json={})
    snapshot = await finished(mallory, started.json()["executionId"])
    assert snapshot["status"] == "failed", snapshot
    assert snapshot["error"]["code"] == "template_error", snapshot
    assert rss_bytes(shared.pid) - before < 100 * 1024 * 1024


NESTED = {
    "parentheses": "(" * 3000 + "1" + ")" * 3000,
    "lists": "[" * 3000 + "]" * 3000,
    "unary minus": "-" * 5000 + "1",
    "attributes": "input" + ".a" * 5000,
}


async def test_a_deeply_nested_template_or_condition_is_422_with_its_path(
    shared: FlowcastServer, mallory: httpx.AsyncClient, alice: httpx.AsyncClient, unique: str
) -> None:
    """Step 16's hostile-tenant review (row 11): a deeply nested template or ``when``
    made PUT answer 500 (a RecursionError) and drop the keep-alive connection, 5 of 5
    shapes. Each is now 422 with its path, on a connection that goes on serving; the
    template that formats 200 MB (row 14) is stored without being evaluated."""
    url = f"/api/workflows/deep-{unique}"
    for expression in NESTED.values():
        blocks = [
            {"id": "a", "type": "transform", "config": {"value": "{{ " + expression + " }}"}},
            {"id": "b", "type": "transform", "config": {"value": 1}},
        ]
        edges = [{"from": "a", "to": "b", "when": expression}]
        response = await mallory.put(
            url, json={"id": f"deep-{unique}", "blocks": blocks, "edges": edges}
        )
        assert response.status_code == 422, response.text
        problems = {p["path"]: p["message"] for p in response.json()["error"]["problems"]}
        assert "nested too deeply" in problems["$.blocks[0].config.value"], problems
        assert "nested too deeply" in problems["$.edges[0].when"], problems
    before = rss_bytes(shared.pid)
    formatted = {"value": "x{{ '%200000002s'|format(1) }}"}
    stored = await mallory.put(
        url,
        json={
            "id": f"deep-{unique}",
            "blocks": [{"id": "f", "type": "transform", "config": formatted}],
        },
    )
    assert stored.status_code in (200, 201), stored.text
    assert rss_bytes(shared.pid) - before < 50 * 1024 * 1024
    assert (await alice.get("/api/workflows")).status_code == 200


async def test_streams_opened_by_token_count_toward_the_tenant_cap(
    capped: FlowcastServer, unique: str
) -> None:
    """Step 16's review (row 15): with a cap of 5, 3 streams by key and 2 by ``?token=``
    let a 6th through. Every open stream of a tenant counts, however it was authorized:
    the execution's, the live list's (by key or list token)."""
    async with authed(capped, MALLORY) as mallory, authed(capped) as anonymous:
        await put(mallory, approval(f"tok-{unique}", {"type": "boolean"}))
        started = (await mallory.post(f"/api/workflows/tok-{unique}/execute", json={})).json()
        url = f"/api/executions/{started['executionId']}/stream"
        by_token = f"{url}?token={started['streamToken']}"
        list_token = (await mallory.post("/api/executions/live/token")).json()["streamToken"]
        for opened in (
            [by_token, by_token, by_token],
            [url, by_token, f"/api/executions/live?token={list_token}"],
        ):
            async with contextlib.AsyncExitStack() as stack:
                for path in opened:
                    client = mallory if "token=" not in path else anonymous
                    response = await stack.enter_async_context(client.stream("GET", path))
                    assert response.status_code == 200, path
                for client, path in ((mallory, url), (anonymous, by_token)):
                    refused = await client.get(path)
                    assert refused.status_code == 429, (path, refused.text)


@pytest.mark.parametrize("authorization", ["", "Authorization: Bearer not-a-key\r\n"])
async def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(
    shared: FlowcastServer, authorization: str
) -> None:
    """Step 16's review (row 5): eight keyless clients sending 10 MiB bodies of
    ``[{},{},…]`` added ~300 MiB and pushed another tenant's p99 to 1.25-3.5 s: bodies
    were read and parsed before the key was checked. Here the body never comes: the
    401 can only be the answer if nothing waited for it (else a 408, 30 s later)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", shared.port)
    try:
        writer.write(
            (
                "POST /api/workflows/any/execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"{authorization}Content-Type: application/json\r\n"
                "Content-Length: 10000000\r\n\r\n[{},{},"
            ).encode()
        )
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    assert b"www-authenticate: bearer" in head.lower()


async def test_a_config_that_repeats_a_large_input_fails_before_it_is_built(
    shared: FlowcastServer, mallory: httpx.AsyncClient, alice: httpx.AsyncClient, unique: str
) -> None:
    """Step 16's review (row 3): ``["{{ input.s }}"] * 300`` with a 1 MB input cost the
    server +288 MiB and wrote 287 MiB to the value store, each answer within the bound.
    The block now fails on the whole config's size before anything is built."""
    workflow_id = f"repeat-{unique}"
    config = {"value": ["{{ input.s }}"] * 300}
    await put(
        mallory, {"id": workflow_id, "blocks": [{"id": "r", "type": "transform", "config": config}]}
    )
    before = rss_bytes(shared.pid)
    started = await mallory.post(
        f"/api/workflows/{workflow_id}/execute", json={"input": {"s": "z" * 1_000_000}}
    )
    snapshot = await finished(mallory, started.json()["executionId"])
    assert snapshot["status"] == "failed", snapshot
    assert "renders to more than" in snapshot["error"]["message"], snapshot
    assert rss_bytes(shared.pid) - before < 50 * 1024 * 1024
    assert (await alice.get("/api/workflows")).status_code == 200
