"""Streams end cleanly at a frame boundary when their server shuts down."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid
from pathlib import Path

import httpx

from tests.support.api import delay_workflow, put, streaming_workflow, within
from tests.support.logcheck import check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import events
from tests.support.timing import assert_below_timer


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


async def test_a_client_that_stopped_reading_is_cut_after_the_grace(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """Its stream waits on a full socket; two seconds after the exit signal the server
    stops writing to it and frees what it held. (The socket itself closes once uvicorn's
    ``--timeout-graceful-shutdown`` runs out, or here, when the client goes.)"""
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"sr{uuid.uuid4().hex[:6]}",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",  # the run is handed off quickly
        },
    )
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await put(client, delay_workflow("big", ms=60_000))
        # More than the kernel's socket buffers hold (4 MiB here): the last write waits.
        body = {"input": {"blob": "x" * 6_000_000}}
        started = (await client.post("/api/workflows/big/execute", json=body)).json()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        request = f"GET {started['streamUrl']} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        await loop.sock_sendall(sock, request.encode())
        head = await loop.sock_recv(sock, 1024)  # the headers and a little; then no more
        assert head.startswith(b"HTTP/1.1 200")
        stopping = asyncio.create_task(server.stop(signal.SIGTERM, timeout=20))
        began = time.monotonic()
        cut = "without completing response"

        async def cut_logged() -> bool:
            return cut in server.logs()

        await within(cut_logged, 8, every=0.1)
        assert_below_timer(
            time.monotonic() - began if cut in server.logs() else float("inf"),
            bound=8,
            timer="the 2 s cut after the exit signal",
            what="a stalled client's stream cut",
            detail=server.logs()[-2000:],
        )
        assert "ending the open streams" in server.logs()
        assert not stopping.done()  # uvicorn still waits for the socket
    finally:
        sock.close()
    await stopping
