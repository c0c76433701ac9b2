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
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.api import approval_workflow, paused_execution, put
from tests.support.servers import ALPHA, FlowcastServer, ValkeyServer, authed, serving

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
