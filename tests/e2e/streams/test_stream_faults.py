"""Our own SSE response (app/sse.py) and the stream open in one step
(``StreamReader.open``) under faults, with real processes: a request whose body never
came, a replay read that stalls, writes paused while streams open; each stream still
pings, frees its slot and replays."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import (
    delay_workflow,
    paused_execution,
    put,
    sse_clients,
    until,
    wait_status,
    within,
)
from tests.support.faults import command, pause_writes, stopped, wait_store_settled
from tests.support.servers import ValkeyServer, flowcast_on
from tests.support.timing import assert_below_timer


def approval(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": {}}}],
    }


async def slot_back_within(client: httpx.AsyncClient, url: str, seconds: float) -> int:
    """Open (and close) a stream until it is not refused, for at most ``seconds``; the
    last status seen."""
    statuses: list[int] = []

    async def let_in() -> bool:
        async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as again:
            statuses.append(again.status_code)
        return statuses[-1] == 200

    await within(let_in, seconds, every=0.1)
    return statuses[-1]


async def sse_clients_settled(client: httpx.AsyncClient, seconds: float) -> float:
    """``flowcast_sse_clients`` once it is 0, or as it is after ``seconds``."""

    async def none_left() -> bool:
        return await sse_clients(client) == 0

    await within(none_left, seconds, every=0.1)
    return await sse_clients(client)


async def read_for(
    reader: asyncio.StreamReader, seconds: float, *, until: bytes | None = None
) -> list[tuple[float, bytes]]:
    """What arrives on ``reader`` during ``seconds`` (a measurement window), with times;
    an empty ``bytes`` last when the server closed the connection. With ``until``, it
    ends early at the first read that holds those bytes."""
    arrived: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            data = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        arrived.append((time.monotonic(), data))
        if not data or (until is not None and until in data):
            break
    return arrived


# ------------------------------------------------------------------ heartbeats


# ------------------------------------------------------------------ the client's leaving


@pytest.mark.timeout(60)
async def test_a_stream_whose_request_body_never_came_still_pings_and_frees_its_slot(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """EventStream learns that its client left only from its ``_watch`` task (app/sse.py
    ``_watch``: ``receive()`` until ``http.disconnect``). Behind BodyLimit that
    ``receive`` is ``limited()`` (app/limits.py): for a GET that declares a body
    (``Content-Length: 10``) which never comes, it raises the 408 ApiError after
    FLOWCAST_BODY_TIMEOUT_SECONDS, inside the ``_watch`` task, where nobody looks at it.
    From then on:

    - BodyLimit's ``guarded`` swallows every later ``send`` (``refused`` is set): the
      stream goes silent — no ``: ping`` (SPEC §4 heartbeat), no events, no end — yet
      stays open;
    - the client leaving is never noticed: the reader, its hub subscription
      (``flowcast_sse_clients``) and the tenant's stream slot stay taken until the
      execution ends (a paused one: FLOWCAST_SSE_MAX_SECONDS, an hour). With
      FLOWCAST_MAX_STREAMS_PER_TENANT=1 the tenant gets 429 for every stream after.

    With sse-starlette the same exception in its disconnect listener ended the whole
    response (its task group), and the slot came back. Found by the step 13 review (round 2).
    Since step 16's fresh-eyes review a body is read before the route runs (Turns): the
    GET is answered 408 and closed, and nothing it could hold is taken."""
    server = await flowcast_on(
        valkey,
        tmp_path,
        max_streams_per_tenant="1",
        body_timeout_seconds="1",
        sse_ping_seconds="0.5",
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            await put(client, approval("hold"))
            execution_id = await paused_execution(client, "hold")
            url = f"/api/executions/{execution_id}/stream"
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                writer.write(
                    f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
                    "Content-Length: 10\r\n\r\n".encode()
                )
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                # The body is read before the request's turn (app/limits.py Turns), so
                # one that never comes is answered 408 before the stream opens.
                assert head.startswith(b"HTTP/1.1 408"), head
                opened = time.monotonic()
                arrived = await read_for(reader, 4.0)
            finally:
                writer.close()
                await writer.wait_closed()
            pings = [at - opened for at, data in arrived if b": ping" in data]
            status = await slot_back_within(client, url, 6.0)
            clients = await sse_clients_settled(client, 5.0)
        ended = bool(arrived) and arrived[-1][1] == b""
        problems = []
        if not ended and (not pings or pings[-1] < 3.0):
            problems.append(
                f"the stream went silent and stayed open: pings at {pings} over a 4 s window"
            )
        if status != 200:
            problems.append(f"the tenant's stream slot never came back: {status}")
        if clients != 0:
            problems.append(f"hub subscriptions left after every client left: {clients}")
        assert not problems, problems
    finally:
        await server.stop()


@pytest.mark.timeout(90)
async def test_a_stream_waiting_on_a_stalled_replay_read_still_sends_heartbeats(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Heartbeats now come only from the reader's own coroutine: the ticker pokes the
    subscription (app/sse.py ``OpenStreams.tick`` -> ``StreamReader.poke``), and the
    ``: ping`` is yielded by ``StreamReader._live`` once ``Subscription.wait`` returns
    empty. A stream whose coroutine is inside a Redis call — the replay's next page
    (``_replay``), a hole filled from the buffer (``_fill``) — sends nothing until that
    call returns, and a stalled Redis holds it up to the socket timeout (15 s), then
    the stream ends. sse-starlette pinged from a task of its own, so the stream stayed
    alive through the stall. SPEC §4: a ``: ping`` every FLOWCAST_SSE_PING_SECONDS on
    idle streams (here 0.5 s; the client sees nothing for the whole 4 s stall).

    Made deterministic with flow control: a 6 MB first event and a tiny receive window
    keep the server waiting to write the second page until the client reads; Valkey is
    stopped (SIGSTOP) before that, so the third page's read meets the stall.
    Found by the step 13 review (round 2)."""
    server = await flowcast_on(own_valkey, tmp_path, sse_ping_seconds="0.5")
    try:
        await wait_store_settled(own_valkey, timeout=30)
        words = " ".join(f"w{i}" for i in range(2_500))  # three replay pages
        workflow = {
            "id": "long",
            "blocks": [
                {"id": "talk", "type": "generate", "config": {"text": words, "tokensPerSecond": 0}},
                {"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": {}}},
            ],
            "edges": [{"from": "talk", "to": "ask"}],
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await put(client, workflow)
            body = {"input": {"blob": "x" * 6_000_000}}
            response = await client.post("/api/workflows/long/execute", json=body)
            assert response.status_code == 202, response.text
            execution_id = response.json()["executionId"]
            await wait_status(client, execution_id, "paused", timeout=30)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=2**24)
        try:
            writer.write(
                f"GET /api/executions/{execution_id}/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Accept: text/event-stream\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
            os.kill(own_valkey.pid, signal.SIGSTOP)
            try:

                async def valkey_stopped() -> bool:
                    return stopped(own_valkey.pid)

                await until(valkey_stopped, "Valkey stopped", 5, every=0.01)
                began = time.monotonic()
                arrived = await read_for(reader, 4.0)
            finally:
                os.kill(own_valkey.pid, signal.SIGCONT)
            received = sum(len(data) for _, data in arrived)
            last = max((at for at, data in arrived if data), default=began) - began
            # The rest of the replay, then the live tail with its pings, once Valkey is back
            # (up to the first ping: the only thing looked for in it).
            rest = await read_for(reader, 3.0, until=b": ping")
        finally:
            writer.close()
            await writer.wait_closed()
        assert any(b": ping" in data for _, data in rest), "the stream did not survive the stall"
        assert last > 3.0, (
            f"nothing at all reached the client in the last {4.0 - last:.1f} s of a 4 s "
            f"Valkey stall ({received} bytes before), with FLOWCAST_SSE_PING_SECONDS=0.5"
        )
    finally:
        await server.stop()


# ------------------------------------------------------------------ reads while writes wait


@pytest.mark.timeout(60)
async def test_a_stream_opens_and_replays_while_writes_are_paused(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Opening a stream is one read (``read.lua``, flagged no-writes): during ``CLIENT
    PAUSE … WRITE`` (a failover's first step) a finished execution still replays at
    once, where an unflagged script would wait out the pause before the headers.
    Found by the step 13 review (round 2)."""
    server = await flowcast_on(own_valkey, tmp_path)
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, delay_workflow("quick", ms=1))
            response = await client.post("/api/workflows/quick/execute", json={"input": {}})
            execution_id = response.json()["executionId"]
            await wait_status(client, execution_id, "completed", timeout=20)
            # Once before: a script Valkey has not seen is loaded first (SCRIPT LOAD
            # waits out a write pause too).
            assert (await client.get(f"/api/executions/{execution_id}/stream")).is_success
            await pause_writes(own_valkey, 5_000)
            began = time.monotonic()
            replayed = await client.get(f"/api/executions/{execution_id}/stream")
            took = time.monotonic() - began
        assert replayed.status_code == 200
        assert "event: execution:completed" in replayed.text
        assert_below_timer(
            took,
            bound=2,
            timer="the 5 s write pause",
            what="a replay while writes are paused",
            detail="(it waited for the paused writes)",
        )
    finally:
        # Measured: the server's shutdown need not wait out the rest of the pause.
        await command(own_valkey, "CLIENT", "UNPAUSE")
        await server.stop()
