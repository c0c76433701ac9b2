"""Requests wait their turn in their caller's line (app/limits.py ``Turns``; step 16).

A process works on at most 64 requests at once, at most 8 of one caller (one key, one
token), the callers in turn; the storm that needed it is in
tests/e2e/streams/test_open_storm.py. What a turn must never cover: a body still on its
way, and a stream waiting for its next event. Either would let a caller hold its own
line (or, without keys, everyone's) with requests that cost the server nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.api import approval_workflow, paused_execution, put
from tests.support.servers import (
    ALPHA,
    BETA,
    ROOT,
    FlowcastServer,
    ValkeyServer,
    authed,
    env_on,
    serving,
)
from tests.support.timing import assert_within, probing

PER_CALLER = 8  # Turns' default


@pytest.fixture(scope="module")
async def server(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root: Path = tmp_path_factory.mktemp("turns")
    async with serving(valkey, root, api_keys=ALPHA) as served:
        yield served


@pytest.mark.timeout(30)
async def test_bodies_on_their_way_hold_no_turn(server: FlowcastServer) -> None:
    """Twice the per-caller turns of PUTs whose bodies never finish: the same key's GET is
    still answered at once."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(PER_CALLER * 2):
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            stack.callback(writer.close)
            writer.write(
                b"PUT /api/workflows/slow HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"Authorization: Bearer {ALPHA}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            await writer.drain()
        async with authed(server, ALPHA) as alpha, asyncio.timeout(5):
            assert (await alpha.get("/api/workflows")).status_code == 200


@pytest.mark.timeout(30)
async def test_streams_waiting_for_events_hold_no_turn(server: FlowcastServer) -> None:
    """Twice the per-caller turns of streams at the live end of a paused run (nothing to
    send until it is resumed): the same key's GET and resume are answered at once, and
    every stream then gets the rest of the run."""
    async with authed(server, ALPHA) as alpha:
        await put(alpha, approval_workflow("turns-held"))
        execution_id = await paused_execution(alpha, "turns-held")
        last = (await alpha.get(f"/api/executions/{execution_id}")).json()["lastEventId"]
        url = f"/api/executions/{execution_id}/stream"
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    alpha.stream("GET", url, headers={"Last-Event-ID": str(last)})
                )
                for _ in range(PER_CALLER * 2)
            ]
            assert {stream.status_code for stream in streams} == {200}
            async with asyncio.timeout(5):
                assert (await alpha.get("/api/workflows")).status_code == 200
                resumed = await alpha.post(f"/api/executions/{execution_id}/resume", json={})
            assert resumed.status_code == 202, resumed.text
            async with asyncio.timeout(15):
                texts = await asyncio.gather(*(stream.aread() for stream in streams))
            assert all(b"event: execution:completed" in text for text in texts)


STORM = 1_500  # streams of one key opened at once (from another process)


async def worst_beside_storm(
    server: FlowcastServer, beta: httpx.AsyncClient, path: str, *spelling: str
) -> float:
    """Beta's worst GET while ``STORM`` streams of alpha's open, spelled one way or
    (``"spelled"``) each its own way; the storm's process is killed once they opened."""
    async with probing(beta, "/api/workflows") as loaded:
        storm = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.storm",
            str(server.port), path, ALPHA, str(STORM), *spelling,
            cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert storm.stdout is not None
            async with asyncio.timeout(120):
                opened = json.loads(await storm.stdout.readline())
        finally:
            storm.kill()
            await storm.wait()
    assert opened["opened"] == STORM and not opened["failed"], opened
    return max(loaded)


@pytest.mark.timeout(300)
async def test_one_key_spelled_many_ways_is_one_caller(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """A key's requests wait in one line however its ``Authorization`` is spelled (the
    scheme's case, the spaces before the key): another tenant's worst GET while 1,500
    streams of one key open, each spelled its own way, stays within a bound of its worst
    while 1,500 spelled one way open. (Keyed by the header's bytes, each spelling was a
    caller of its own, with its own 8 turns and its own place in the gate.)"""
    env = env_on(valkey, api_keys=f"{ALPHA},{BETA}", max_streams_per_tenant=str(STORM * 4))
    server = FlowcastServer(data_dir=tmp_path / "spelled", env=env)
    await server.start()
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            await put(alpha, approval_workflow("spelled"))
            path = f"/api/executions/{await paused_execution(alpha, 'spelled')}/stream"
            same = await worst_beside_storm(server, beta, path)
            varied = await worst_beside_storm(server, beta, path, "spelled")
        print(f"spelled one way {same:.3f} s, each its own way {varied:.3f} s")
        assert_within(
            varied,
            probe=same,
            ratio=2.5,
            floor=0.5,
            what=f"beta's worst GET beside {STORM} spelled opens (spelled one way: {same:.2f} s)",
        )
    finally:
        await server.stop()
