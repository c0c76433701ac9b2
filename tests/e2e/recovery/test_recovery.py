"""Durable execution (SPEC §7) on real processes: checkpoints, recovery, hand-off.

Replicas share one Valkey with a 1 s lease. An owner SIGKILLed mid-run, a single
replica killed and started again, a SIGTERM with many executions running, a rolling
restart of every replica: each execution ends ``completed``, with exactly the
``execution:recovered`` events its moves made, and no block that completed before a
move runs again. Past ``FLOWCAST_MAX_RECOVERIES`` crashes it ends ``worker_lost``. An
``http`` block in flight at a crash runs again with the same ``Idempotency-Key``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.api import (
    all_events,
    delay_workflow,
    has_stored,
    ms_between,
    put,
    stored_types,
    until,
)
from tests.support.faults import (
    fresh_replica,
    kill_replica,
    replica,
    terminate_replica,
)
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events
from tests.support.timing import hold_for

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def replicas(*servers: FlowcastServer) -> AsyncIterator[None]:
    try:
        await asyncio.gather(*(server.start() for server in servers))
        yield
    finally:
        await asyncio.gather(*(server.stop(signal.SIGKILL) for server in servers))


def chain_workflow(workflow_id: str, *, blocks: int, ms: int) -> dict[str, Any]:
    """``blocks`` delay blocks of ``ms`` one after the other; the last outputs the first's."""
    ids = [f"s{index}" for index in range(blocks)]
    definition = [{"id": block_id, "type": "delay", "config": {"ms": ms}} for block_id in ids]
    definition.append(
        {"id": "end", "type": "transform", "config": {"value": "{{ blocks.s0.output }}"}}
    )
    edges = [{"from": a, "to": b} for a, b in zip([*ids], [*ids[1:], "end"], strict=True)]
    return {"id": workflow_id, "blocks": definition, "edges": edges}


async def start(client: httpx.AsyncClient, workflow_id: str) -> str:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert response.status_code == 202, response.text
    execution_id: str = response.json()["executionId"]
    return execution_id


async def finished(client: httpx.AsyncClient, execution_id: str, timeout: float = 30) -> str:

    async def ended() -> str | None:
        with contextlib.suppress(httpx.TransportError):
            snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
            if snapshot["status"] not in ("running", "queued"):
                return str(snapshot["status"])
        return None

    status: str = await until(ended, f"{execution_id} ended", timeout, every=0.05)
    return status


def check_recovered_run(stored: list[dict[str, Any]], moves: int | None = None) -> None:
    """A recovered run's log: contiguous, completed, each block completed exactly once,
    and nothing that a recovery kept from the checkpoint ran again after it."""
    check_log(stored)
    assert stored[-1]["type"] == "execution:completed", stored[-1]
    completed = [e["data"]["blockId"] for e in stored if e["type"] == "block:completed"]
    assert len(completed) == len(set(completed)), completed
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    if moves is not None:
        assert len(recovered) == moves, [e["data"] for e in recovered]
    for number, event in enumerate(recovered, start=1):
        assert event["data"]["recovery"] == number
        kept = set(event["data"]["completed"])
        before = {
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:completed" and e["id"] < event["id"]
        }
        # The checkpoint is exactly what the stored log had completed.
        assert kept == before, (kept, before)
        later = [
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:started" and e["id"] > event["id"]
        ]
        assert not kept & set(later), f"kept blocks ran again: {kept & set(later)}"


async def read_to_end(client: httpx.AsyncClient, execution_id: str) -> list[Frame]:
    received: list[Frame] = []
    url = f"/api/executions/{execution_id}/stream"
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        async for frame in events(response):
            received.append(frame)
    return received


async def test_sigterm_hands_ten_running_executions_off_and_none_fails(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with (
        replicas(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, chain_workflow(f"ten-{unique}", blocks=4, ms=500))
        started = [await start(on_a, f"ten-{unique}") for _ in range(10)]
        followers = [asyncio.create_task(read_to_end(on_b, eid)) for eid in started]

        async def all_running() -> bool:
            types = [await stored_types(on_b, eid) for eid in started]
            return all("block:started" in kinds for kinds in types)

        await until(all_running, "every execution runs a block", timeout=20.0)
        signalled = time.monotonic()
        stopping = asyncio.create_task(terminate_replica(a))
        views = await asyncio.wait_for(asyncio.gather(*followers), 30)
        assert await stopping in (0, -signal.SIGTERM)
        for execution_id, frames in zip(started, views, strict=True):
            stored = await all_events(on_b, execution_id)
            assert check_view(frames) == stored
            check_recovered_run(stored, moves=1)
            recovered = next(e for e in stored if e["type"] == "execution:recovered")
            assert recovered["data"]["reason"] == "handoff"
            assert stored[-1]["data"]["output"] == {"end": {"waitedMs": 500}}
        print(f"\nten executions handed off and completed {time.monotonic() - signalled:.2f} s")


async def test_a_rolling_restart_of_both_replicas_under_load_loses_and_fails_nothing(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    extra: list[FlowcastServer] = []
    try:
        async with replicas(a, b), httpx.AsyncClient(timeout=20) as client:
            workflow = chain_workflow(f"roll-{unique}", blocks=8, ms=400)
            response = await client.put(f"{a.url}/api/workflows/{workflow['id']}", json=workflow)
            assert response.status_code in (200, 201)
            started: list[str] = []
            stop_load = asyncio.Event()

            async def load(target: list[FlowcastServer]) -> None:
                # Keep starting executions on whichever replica is up.
                while not stop_load.is_set():
                    for server in list(target):
                        with contextlib.suppress(httpx.TransportError, AssertionError):
                            url = f"{server.url}/api/workflows/{workflow['id']}/execute"
                            answer = await client.post(url, json={})
                            if answer.status_code == 202:
                                started.append(answer.json()["executionId"])
                    await hold_for(0.15, "the load's pace: a start on each replica")

            up = [a, b]
            loader = asyncio.create_task(load(up))
            try:
                await until(lambda: _at_least(started, 6), "load started", timeout=20.0)
                # Restart A, then B, each replaced by a fresh process.
                for old in (a, b):
                    up.remove(old)
                    assert await terminate_replica(old) in (0, -signal.SIGTERM)
                    new = await fresh_replica(old)
                    extra.append(new)
                    up.append(new)
                    target = len(started) + 3
                    await until(
                        lambda t=target: _at_least(started, t), "load goes on", timeout=20.0
                    )
            finally:
                stop_load.set()
                await loader
            survivor = up[0]
            statuses = [
                await finished(client_for(client, survivor), eid, timeout=60) for eid in started
            ]
            assert statuses == ["completed"] * len(started), statuses
            moved = 0
            for execution_id in started:
                stored = await all_events(client_for(client, survivor), execution_id)
                check_recovered_run(stored)
                moved += any(e["type"] == "execution:recovered" for e in stored)
            print(f"\n{len(started)} executions across a rolling restart, {moved} handed off")
            assert moved > 0
    finally:
        await asyncio.gather(*(server.stop(signal.SIGKILL) for server in extra))


def client_for(client: httpx.AsyncClient, server: FlowcastServer) -> httpx.AsyncClient:
    client.base_url = httpx.URL(server.url)
    return client


async def _at_least(items: list[str], count: int) -> bool:
    return len(items) >= count


async def test_a_single_replica_killed_and_started_again_recovers_its_own_work(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    only = replica(valkey, tmp_path, "only")
    again: FlowcastServer | None = None
    try:
        await only.start()
        async with httpx.AsyncClient(base_url=only.url, timeout=20) as client:
            await put(client, delay_workflow(f"alone-{unique}", ms=1_000))
            execution_id = await start(client, f"alone-{unique}")
            await until(
                lambda: has_stored(client, execution_id, "block:started"),
                "the delay block started",
                timeout=20.0,
            )
        await kill_replica(only)
        again = await fresh_replica(only)
        async with httpx.AsyncClient(base_url=again.url, timeout=20) as client:
            assert await finished(client, execution_id) == "completed"
            stored = await all_events(client, execution_id)
            check_recovered_run(stored, moves=1)
            recovered = next(e for e in stored if e["type"] == "execution:recovered")
            assert recovered["data"]["reason"] == "worker_lost"
            assert recovered["data"]["completed"] == ["hello"]
            # Its duration counts from its creation, not from the recovery (SPEC §9).
            snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
            took = stored[-1]["data"]["durationMs"]
            assert abs(took - ms_between(snapshot["createdAt"], stored[-1]["ts"])) <= 2, took
            assert took > ms_between(stored[0]["ts"], recovered["ts"]), took
    finally:
        await only.stop(signal.SIGKILL)
        if again is not None:
            await again.stop(signal.SIGKILL)


async def test_past_max_recoveries_a_crashing_execution_ends_worker_lost(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    a = replica(valkey, tmp_path, "a", FLOWCAST_MAX_RECOVERIES="1")
    b = replica(valkey, tmp_path, "b", FLOWCAST_MAX_RECOVERIES="1")
    spare: FlowcastServer | None = None
    try:
        async with replicas(a, b), httpx.AsyncClient(base_url=b.url, timeout=20) as on_b:
            await put(on_b, chain_workflow(f"crashy-{unique}", blocks=10, ms=1_500))
            async with httpx.AsyncClient(base_url=a.url, timeout=20) as on_a:
                execution_id = await start(on_a, f"crashy-{unique}")
            await until(
                lambda: has_stored(on_b, execution_id, "block:started"),
                "started on A",
                timeout=20.0,
            )
            await kill_replica(a)  # crash 1: B recovers it
            await until(
                lambda: has_stored(on_b, execution_id, "execution:recovered"), "on B", timeout=20.0
            )
            spare = await fresh_replica(a)
            await kill_replica(b)  # crash 2: past the limit of 1
            async with httpx.AsyncClient(base_url=spare.url, timeout=20) as on_spare:
                assert await finished(on_spare, execution_id) == "failed"
                stored = await all_events(on_spare, execution_id)
        check_log(stored)
        assert [e["data"]["reason"] for e in stored if e["type"] == "execution:recovered"] == [
            "worker_lost"
        ]
        assert stored[-1]["type"] == "execution:failed"
        assert stored[-1]["data"]["error"]["code"] == "worker_lost"
    finally:
        if spare is not None:
            await spare.stop(signal.SIGKILL)


# -- the same Idempotency-Key across a recovery ---------------------------------------


class Remote:
    """A remote service on 127.0.0.1 that records the Idempotency-Key of each call and
    holds the first call open (so the caller can be killed while it waits)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.first_arrived = threading.Event()
        # Set at teardown: the held call then answers, so the server's shutdown does not
        # wait out its 10 s join for a connection nobody reads any more.
        self.released = threading.Event()

    async def job(self, request: Request) -> JSONResponse:
        self.keys.append(request.headers.get("idempotency-key", ""))
        if len(self.keys) == 1:
            self.first_arrived.set()
            await asyncio.to_thread(self.released.wait, 30)
        return JSONResponse({"job": "created"})


@pytest.fixture
def remote() -> Iterator[tuple[str, Remote]]:
    service = Remote()
    app = Starlette(routes=[Route("/jobs", service.job, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http="h11", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the remote did not start"
        time.sleep(0.01)  # polling the real readiness flag
    yield f"http://127.0.0.1:{port}", service
    service.released.set()
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


async def test_an_http_block_in_flight_at_a_crash_runs_again_with_the_same_idempotency_key(
    valkey: ValkeyServer, tmp_path: Path, unique: str, remote: tuple[str, Remote]
) -> None:
    url, service = remote
    env = {"FLOWCAST_HTTP_ALLOW_PRIVATE": "true"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    workflow = {
        "id": f"job-{unique}",
        "blocks": [
            {"id": "prepare", "type": "transform", "config": {"value": "ready"}},
            {
                "id": "submit",
                "type": "http",
                "config": {"url": f"{url}/jobs", "method": "post", "json": {"n": 1}},
            },
        ],
        "edges": [{"from": "prepare", "to": "submit"}],
    }
    async with (
        replicas(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, workflow)
        execution_id = await start(on_a, workflow["id"])
        await asyncio.wait_for(asyncio.to_thread(service.first_arrived.wait), 20)
        await kill_replica(a)
        assert await finished(on_b, execution_id) == "completed"
        stored = await all_events(on_b, execution_id)
    check_recovered_run(stored, moves=1)
    assert len(service.keys) == 2, service.keys
    assert service.keys[0] and service.keys[0] == service.keys[1]
    attempts = [
        e["data"]["attempt"]
        for e in stored
        if e["type"] == "block:started" and e["data"]["blockId"] == "submit"
    ]
    assert attempts == [1, 2]


# -- the checkpoint, in Redis ----------------------------------------------------------


async def test_the_checkpoint_holds_exactly_the_completed_blocks_and_a_pause_adds_no_copy(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, unique: str
) -> None:
    only = replica(valkey, tmp_path, "only")
    workflow = {
        "id": f"ck-{unique}",
        "blocks": [
            {"id": "small", "type": "transform", "config": {"value": {"n": 1}}},
            {"id": "skipped", "type": "transform", "config": {"value": 2}},
            {
                "id": "ask",
                "type": "approval",
                "config": {"prompt": "ok?", "schema": {"type": "object"}},
            },
        ],
        "edges": [
            {"from": "small", "to": "skipped", "when": "false"},
            {"from": "small", "to": "ask"},
        ],
    }
    async with replicas(only), httpx.AsyncClient(base_url=only.url, timeout=20) as client:
        await put(client, workflow)
        execution_id = await start(client, workflow["id"])

        async def paused() -> bool:
            snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
            return bool(snapshot["status"] == "paused")

        await until(paused, "paused", timeout=20.0)
        state = await redis.hgetall(f"fc:{{{execution_id}}}:state")
        fields = {key.decode(): value for key, value in state.items()}
        assert fields["o:small"] == b'{"n":1}'
        assert fields["s:skipped"] == b"1"
        assert fields["t:small"] == b"1" and fields["t:ask"] == b"1"
        assert "o:ask" not in fields and "run" not in fields  # no second copy for the pause
        resumed = await client.post(
            f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}}
        )
        assert resumed.status_code == 202, resumed.text
        assert await finished(client, execution_id) == "completed"
        state = await redis.hgetall(f"fc:{{{execution_id}}}:state")
        fields = {key.decode(): value for key, value in state.items()}
        assert fields["a:ask"] == b'{"ok":true}' and fields["o:ask"] == b'{"ok":true}'
        stored = await all_events(client, execution_id)
        starts = [e["data"]["blockId"] for e in stored if e["type"] == "block:started"]
        assert starts == ["small", "ask"]  # the answered block did not start twice
