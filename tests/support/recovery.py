"""Helpers for the fault scenarios on several replicas sharing one ``FaultyValkey``
(lease 1 s, grace 1 s): a module's store, the replicas it runs, the workflows they run
and the checks every recovered log goes through.

A test module takes the store by importing ``valkey`` and ``settled`` (module-scoped:
one store per module, settled and emptied before each test).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, until
from tests.support.faults import FaultyValkey, wait_store_settled
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events, follow

DEADLINE = 40.0


@pytest.fixture(scope="module")
async def valkey(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FaultyValkey]:
    server = FaultyValkey(data_dir=tmp_path_factory.mktemp("faulty-valkey"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(autouse=True)
async def settled(valkey: FaultyValkey) -> None:
    """Start each test on a running, empty, settled store, with no leftover ownership
    from an earlier test (its replicas are dead: their executions must not be recovered
    here)."""
    if valkey._process is None:  # a test left it down
        await valkey.start()
    await wait_store_settled(valkey, timeout=DEADLINE, flush=True)


@contextlib.asynccontextmanager
async def running(*servers: FlowcastServer) -> AsyncIterator[list[FlowcastServer]]:
    """Start the servers; SIGKILL whatever is still up at the end (extras appended too)."""
    alive = list(servers)
    try:
        await asyncio.gather(*(server.start() for server in servers))
        yield alive
    finally:
        await asyncio.gather(*(s.stop(signal.SIGKILL) for s in alive), return_exceptions=True)


def chain(workflow_id: str, *, blocks: int, ms: int) -> dict[str, Any]:
    """s0 → s1 → … (delays), then ``end`` echoing s0's output."""
    ids = [f"s{index}" for index in range(blocks)]
    definition: list[dict[str, Any]] = [
        {"id": block_id, "type": "delay", "config": {"ms": ms}} for block_id in ids
    ]
    definition.append(
        {"id": "end", "type": "transform", "config": {"value": "{{ blocks.s0.output }}"}}
    )
    edges = [{"from": a, "to": b} for a, b in zip(ids, [*ids[1:], "end"], strict=True)]
    return {"id": workflow_id, "blocks": definition, "edges": edges}


async def snapshot_of(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/executions/{execution_id}")
    return dict(response.json())


async def finished(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {}

    async def done() -> bool:
        nonlocal result
        with contextlib.suppress(httpx.TransportError):
            response = await client.get(f"/api/executions/{execution_id}")
            if response.status_code == 200:
                result = response.json()
                return result["status"] in ("completed", "failed", "cancelled")
        return False

    await until(done, f"{execution_id} finished (last seen {result})")
    return result


async def has_event(
    client: httpx.AsyncClient, execution_id: str, kind: str, block: str = ""
) -> bool:
    with contextlib.suppress(httpx.TransportError, KeyError):  # KeyError: a 404 page
        for event in await all_events(client, execution_id):
            if event["type"] == kind and (not block or event["data"].get("blockId") == block):
                return True
    return False


async def follow_on(server: FlowcastServer, execution_id: str) -> list[Frame]:
    """``follow`` with a client of its own, closed after (its socket would otherwise be
    left for the garbage collector, and warn in whichever test it runs in)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        return await follow(client, execution_id)


def check_recovered(stored: list[dict[str, Any]], *, moves: int | None = None) -> None:
    """As test_recovery.check_recovered_run: contiguous, one terminal event, each block
    completed once, each recovery numbered 1, 2, … and kept blocks never run again."""
    check_log(stored)
    completed = [e["data"]["blockId"] for e in stored if e["type"] == "block:completed"]
    assert len(completed) == len(set(completed)), f"a block completed twice: {completed}"
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    if moves is not None:
        assert len(recovered) == moves, [e["data"] for e in recovered]
    for number, event in enumerate(recovered, start=1):
        assert event["data"]["recovery"] == number, [e["data"] for e in recovered]
        kept = set(event["data"]["completed"])
        before = {
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:completed" and e["id"] < event["id"]
        }
        assert kept == before, (kept, before)
        later = {
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:started" and e["id"] > event["id"]
        }
        assert not kept & later, f"kept blocks ran again: {kept & later}"


def http_for(client: httpx.AsyncClient, server: FlowcastServer) -> httpx.AsyncClient:
    client.base_url = httpx.URL(server.url)
    return client


async def settled_store(valkey: FaultyValkey) -> bool:
    """The server answering now was noticed (fc:store names its run id) and the settle
    window after the change is over: owners had their time to re-assert."""
    redis = Redis.from_url(valkey.url)
    try:
        with contextlib.suppress(Exception):
            info = await redis.info("server")
            run_id, until_ms = await redis.hmget("fc:store", ["runId", "settleUntil"])
            seconds, micros = await redis.time()
            return (
                run_id is not None
                and run_id.decode() == str(info["run_id"])
                and int(until_ms or 0) <= seconds * 1000 + micros // 1000
            )
        return False
    finally:
        await redis.aclose()


def approval_flow(workflow_id: str, *, before_ms: int = 0, after_ms: int = 0) -> dict[str, Any]:
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "wait", "type": "delay", "config": {"ms": before_ms}},
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": schema}},
            {"id": "after", "type": "delay", "config": {"ms": after_ms}},
            {"id": "echo", "type": "transform", "config": {"value": "{{ blocks.review.output }}"}},
        ],
        "edges": [
            {"from": "wait", "to": "review"},
            {"from": "review", "to": "after"},
            {"from": "after", "to": "echo"},
        ],
    }


def dropped_ranges(frames: list[Frame]) -> list[tuple[int, int]]:
    gaps = [frame.json for frame in frames if frame.event == "replay:gap"]
    return [(gap["after"] + 1, gap["resumeAt"] - 1) for gap in gaps]


async def meta_field(valkey: FaultyValkey, eid: str, field: str) -> bytes | None:
    redis = Redis.from_url(valkey.url)
    try:
        value: bytes | None = await redis.hget(f"fc:{{{eid}}}:meta", field)
        return value
    finally:
        await redis.aclose()


class LiveReader:
    """A client following one execution on one replica: keeps every frame it got, even
    when the replica dies under it (the stream is then cut)."""

    def __init__(self, server: FlowcastServer, eid: str) -> None:
        self.frames: list[Frame] = []
        self._client = httpx.AsyncClient(base_url=server.url, timeout=60)
        self._task = asyncio.create_task(self._read(eid))

    async def _read(self, eid: str) -> None:
        url = f"/api/executions/{eid}/stream"
        with contextlib.suppress(httpx.HTTPError, AssertionError):
            async with self._client.stream("GET", url) as response:
                async for frame in events(response):
                    self.frames.append(frame)

    @property
    def done(self) -> bool:
        """Its stream ended (or was cut)."""
        return self._task.done()

    def last_id(self) -> int:
        ids = [int(frame.id) for frame in self.frames if frame.id is not None]
        return max(ids, default=0)

    def seen(self) -> list[dict[str, Any]]:
        return check_view(self.frames)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


def long_tail(workflow_id: str, *, long_ms: int = 20_000) -> dict[str, Any]:
    """s0 → s1 (short) → long (a long delay) → end: an owner idle in ``long``."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "s0", "type": "delay", "config": {"ms": 200}},
            {"id": "s1", "type": "delay", "config": {"ms": 200}},
            {"id": "long", "type": "delay", "config": {"ms": long_ms}},
            {"id": "end", "type": "transform", "config": {"value": "{{ blocks.s0.output }}"}},
        ],
        "edges": [
            {"from": "s0", "to": "s1"},
            {"from": "s1", "to": "long"},
            {"from": "long", "to": "end"},
        ],
    }
