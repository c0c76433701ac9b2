"""Step 13 review, round 2: attempts to break our own SSE response (app/sse.py), the
stream open in one step (StreamReader.open) and the per-run lease renewals, with real
processes. Each test here demonstrates one confirmed break."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import (
    all_events,
    delay_workflow,
    paused_execution,
    put,
    streaming_workflow,
)
from tests.support.faults import command, pause_writes, wait_store_settled
from tests.support.logcheck import same_ids_same_events
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import events


def approval(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": {}}}],
    }


async def started(valkey: ValkeyServer, root: Path, **env: str) -> FlowcastServer:
    server = FlowcastServer(
        data_dir=root,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"b13r2{uuid.uuid4().hex[:6]}",
            **{f"FLOWCAST_{name.upper()}": value for name, value in env.items()},
        },
    )
    await server.start()
    return server


async def slot_back_within(client: httpx.AsyncClient, url: str, seconds: float) -> int:
    """Open (and close) a stream until it is not refused, for at most ``seconds``; the
    last status seen."""
    deadline = time.monotonic() + seconds
    while True:
        async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as again:
            status = again.status_code
        if status == 200 or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.1)


async def sse_clients(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("flowcast_sse_clients "):
            return float(line.split()[1])
    raise AssertionError("no flowcast_sse_clients in /metrics")


async def sse_clients_settled(client: httpx.AsyncClient, seconds: float) -> float:
    """``flowcast_sse_clients`` once it is 0, or as it is after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (count := await sse_clients(client)) != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return count


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
    response (its task group), and the slot came back."""
    server = await started(
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
                assert head.startswith(b"HTTP/1.1 200"), head
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


# ------------------------------------------------------------------ lease renewals


@pytest.mark.timeout(120)
async def test_a_renewal_refused_for_memory_is_an_outage_not_a_fencing(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Redis refusing writes for a moment (maxmemory reached: ``OOM command not
    allowed``; likewise ``READONLY`` during a failover, ``MISCONF``) while a run's lease
    is renewed: ``Ownership.renew`` turns every script error other than GONE/BEHIND into
    ``Conflict("fenced")`` (lib/execution/ownership.py ``renew``), and
    ``LeaseKeeper._renew`` stops the run as fenced (lib/workflows/leases.py). Nobody
    fenced it: its work is cancelled, it writes no last event ("the new owner writes the
    end"), ``_let_go`` releases its lease entry (settled, as fenced) and the renew loop
    skips it from then on. The metadata still names it owner of a ``running``
    execution, but no lease entry is watched any more: no janitor ever takes it over.
    The execution stays ``running`` forever (SPEC §7 "Nothing is ever stuck", "Redis
    refusing writes"), while the appends refused by the same OOM are (correctly) retried
    as an outage."""
    server = await started(own_valkey, tmp_path, lease_seconds="3")
    redis = Redis.from_url(own_valkey.url)
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            await put(client, delay_workflow("sit", ms=5_000))
            response = await client.post("/api/workflows/sit/execute", json={"input": {}})
            assert response.status_code == 202, response.text
            execution_id = response.json()["executionId"]
            async with asyncio.timeout(20):
                while True:
                    page = (
                        await client.get(f"/api/executions/{execution_id}/events?after=0")
                    ).json()
                    if any(
                        e["type"] == "block:started" and e["data"]["blockId"] == "think"
                        for e in page["events"]
                    ):
                        break
                    await asyncio.sleep(0.05)
            # Redis refuses writes until a renewal has met the refusal (either verdict).
            await redis.config_set("maxmemory", "1")
            try:
                async with asyncio.timeout(15):
                    while not any(
                        text in server.logs()
                        for text in ("lease renewal failed", "execution taken over")
                    ):
                        await asyncio.sleep(0.05)
            finally:
                await redis.config_set("maxmemory", "0")
            # The delay ends 5 s after it began; a lease (3 s) and more on top.
            status = "running"
            async with asyncio.timeout(30):
                while status == "running" and "execution taken over" not in server.logs():
                    status = (await client.get(f"/api/executions/{execution_id}")).json()["status"]
                    await asyncio.sleep(0.1)
            if status == "running":
                # Given every chance: a lease and then some for a janitor to step in.
                deadline = time.monotonic() + 3 * 3 + 5
                while status == "running" and time.monotonic() < deadline:
                    status = (await client.get(f"/api/executions/{execution_id}")).json()["status"]
                    await asyncio.sleep(0.2)
            if status == "completed":
                return
            problems = [f"still {status!r} long after its only block ended"]
            # A cancel now: 202 means it will happen (SPEC §3), whatever raced with it.
            cancel = await client.post(f"/api/executions/{execution_id}/cancel")
            if cancel.status_code == 202:
                deadline = time.monotonic() + 3 * 3 + 5
                while status == "running" and time.monotonic() < deadline:
                    status = (await client.get(f"/api/executions/{execution_id}")).json()["status"]
                    await asyncio.sleep(0.2)
                if status == "running":
                    problems.append("a cancel answered 202 and the execution is still running")
            logged = [line for line in server.logs().splitlines() if execution_id in line]
            assert not problems, (problems, logged[-6:])
    finally:
        await redis.aclose()
        await server.stop()


# ------------------------------------------------------------------ heartbeats


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


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
    stopped (SIGSTOP) before that, so the third page's read meets the stall."""
    server = await started(own_valkey, tmp_path, sse_ping_seconds="0.5")
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
            async with asyncio.timeout(30):
                while (await client.get(f"/api/executions/{execution_id}")).json()[
                    "status"
                ] != "paused":
                    await asyncio.sleep(0.05)
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
                async with asyncio.timeout(5):
                    while not stopped(own_valkey.pid):
                        await asyncio.sleep(0.01)
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


# ------------------------------------------------------------------ template bound


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(60)
async def test_a_template_that_never_reaches_a_sandbox_check_is_still_cut_at_its_cpu_bound() -> (
    None
):
    """The sandbox checks its CPU deadline only on calls, attribute and item access
    (lib/workflows/templates.py ``_Sandbox._on_time``); ``{% set %}`` and the ``*`` the
    sandbox intercepts (``call_binop``) never check it, so thirteen squarings of
    ``7 ** 1024`` (one C-level multiply of ~2.5 s at the end) run unchecked. Before,
    the pool cut any template at the bound on the wall clock. Now the pool waits
    ``4 x bound + 2 s`` (pool.py ``wall_seconds``) and the only cut left is the worker's
    RLIMIT_CPU, set to ``ceil(used + bound) + 1`` s (worker.py ``_Limits``): a template
    bounded to 500 ms of CPU gets 1.5-2.5 s of CPU, 3-5x the bound SPEC §8 states
    ("never takes more than FLOWCAST_TEMPLATE_TIMEOUT_MS of CPU"), and holds a worker
    that long while other tenants' templates queue for it."""
    from lib.errors import BlockError
    from lib.workflows.pool import TemplatePool

    squarings = "{% set a = 7 ** 1024 %}" + "{% set a = a * a %}" * 13 + "{{ a > 1 }}"
    async with TemplatePool(size=1, timeout_ms=500) as pool:
        assert await pool.render("{{ 1 + 1 }}", {}) == 2  # the worker is up and idle
        (worker,) = pool._idle
        pid = worker.process.pid
        before = cpu_seconds(pid)
        children = os.times().children_user + os.times().children_system
        with pytest.raises(BlockError):
            await pool.render(squarings, {})
        async with asyncio.timeout(10):
            await worker.process.wait()
    spent = os.times().children_user + os.times().children_system - children - before
    assert spent < 0.5 * 1.5, f"a template bounded to 500 ms of CPU used {spent:.2f} s of CPU"


# ------------------------------------------------------------------ the live gate


@pytest.mark.timeout(120)
async def test_an_owner_that_wakes_from_a_stall_into_an_outage_never_shows_ids_it_lost(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A stalls (SIGSTOP) for longer than its lease; B takes the execution over and
    stores ``execution:recovered`` and more under the next ids; then Valkey goes down,
    and A wakes up. A's renewals now fail as an outage, and ``LeaseKeeper._renew``
    (lib/workflows/leases.py, ``except FlowcastError``) sets ``checked_at = started``:
    that reopens A's live gate (log.py: ``time.monotonic() - renewed_at() <
    live_for_seconds``), so A goes on publishing its own events live to the clients
    attached to it, under the very ids B already gave to other events (the comment
    "nobody can take over while the buffer is unreachable" forgets the takeover that
    happened during the stall, before the outage). When Valkey is back A is fenced,
    but its clients have seen e.g. id 11 = A's ``block:chunk`` where the log has
    ``execution:recovered``: an id names two events (SPEC §4 "Ids": never, "not after
    the execution moved to another process"). A stalled owner must keep its gate shut
    until a renewal succeeds."""
    env = {
        "FLOWCAST_REDIS_URL": own_valkey.url,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SSE_PING_SECONDS": "0.5",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    a = FlowcastServer(data_dir=tmp_path / "a", env=env)
    b = FlowcastServer(data_dir=tmp_path / "b", env=env)
    await asyncio.gather(a.start(), b.start())
    seen: list[dict[str, Any]] = []
    arrived = asyncio.Event()
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
        ):
            await put(on_a, streaming_workflow("slow", words=400, tps=10))
            started_run = await on_a.post("/api/workflows/slow/execute", json={"input": {}})
            execution_id = started_run.json()["executionId"]

            async def follow() -> None:
                url = f"/api/executions/{execution_id}/stream"
                with contextlib.suppress(httpx.HTTPError):
                    async with on_a.stream("GET", url) as response:
                        async for frame in events(response):
                            seen.append(frame.json)
                            arrived.set()

            follower = asyncio.create_task(follow())
            try:
                async with asyncio.timeout(20):
                    while len(seen) < 10:
                        arrived.clear()
                        await arrived.wait()
                os.kill(a.pid, signal.SIGSTOP)
                async with asyncio.timeout(5):
                    while not stopped(a.pid):
                        await asyncio.sleep(0.01)
                before_stall = seen[-1]["id"]
                # B takes over and stores its own events under the next ids.
                async with asyncio.timeout(30):
                    while True:
                        stored = await all_events(on_b, execution_id)
                        types = [event["type"] for event in stored]
                        if "execution:recovered" in types and len(stored) > before_stall + 3:
                            break
                        await asyncio.sleep(0.1)
                own_valkey.kill()
                os.kill(a.pid, signal.SIGCONT)
                # What A shows its clients from now on (a measurement window).
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and len(seen) < before_stall + 10:
                    arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrived.wait(), deadline - time.monotonic())
                await own_valkey.start()
                newest = max(event["id"] for event in seen)
                async with asyncio.timeout(30):
                    while (stored := await all_events(on_b, execution_id))[-1]["id"] < newest:
                        await asyncio.sleep(0.1)
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
        same_ids_same_events(seen, stored)
    finally:
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(a.pid, signal.SIGCONT)
        await asyncio.gather(a.stop(), b.stop())  # both drain their run: side by side


# ------------------------------------------------------------------ reads while writes wait


@pytest.mark.timeout(60)
async def test_a_stream_opens_and_replays_while_writes_are_paused(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Opening a stream is one read (``read.lua``, flagged no-writes): during ``CLIENT
    PAUSE … WRITE`` (a failover's first step) a finished execution still replays at
    once, where an unflagged script would wait out the pause before the headers."""
    server = await started(own_valkey, tmp_path)
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, delay_workflow("quick", ms=1))
            response = await client.post("/api/workflows/quick/execute", json={"input": {}})
            execution_id = response.json()["executionId"]
            async with asyncio.timeout(20):
                while (await client.get(f"/api/executions/{execution_id}")).json()[
                    "status"
                ] != "completed":
                    await asyncio.sleep(0.05)
            # Once before: a script Valkey has not seen is loaded first (SCRIPT LOAD
            # waits out a write pause too).
            assert (await client.get(f"/api/executions/{execution_id}/stream")).is_success
            await pause_writes(own_valkey, 5_000)
            began = time.monotonic()
            replayed = await client.get(f"/api/executions/{execution_id}/stream")
            took = time.monotonic() - began
        assert replayed.status_code == 200
        assert "event: execution:completed" in replayed.text
        assert took < 2, f"the replay waited {took:.2f} s for the paused writes"
    finally:
        # Measured: the server's shutdown need not wait out the rest of the pause.
        await command(own_valkey, "CLIENT", "UNPAUSE")
        await server.stop()
