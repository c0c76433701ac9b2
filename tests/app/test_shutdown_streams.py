"""Streams end cleanly at a frame boundary when their server shuts down."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import httpx

from tests.support.api import put, streaming_workflow
from tests.support.logcheck import check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import events


async def test_a_server_shutting_down_closes_open_streams_cleanly(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"sd{uuid.uuid4().hex[:6]}",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await put(client, streaming_workflow("slow", words=400, tps=20))
        started = (await client.post("/api/workflows/slow/execute", json={})).json()
        frames = []
        stopping: asyncio.Task[int] | None = None
        async with client.stream("GET", started["streamUrl"]) as response:
            # A clean end: the body finishes; a cut one raises RemoteProtocolError here.
            async for frame in events(response):
                frames.append(frame)
                if len(frames) == 5:
                    stopping = asyncio.create_task(server.stop(signal.SIGTERM))
    assert stopping is not None
    await stopping
    check_view(frames)
    assert 5 <= len(frames) < 400
    assert "without completing response" not in server.logs()
