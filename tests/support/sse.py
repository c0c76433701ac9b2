"""A strict reader of raw SSE bytes, so tests see exactly what a browser would parse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass
class Frame:
    """One SSE frame as sent: its lines, parsed."""

    event: str | None = None
    id: str | None = None
    data: str | None = None
    comments: list[str] = field(default_factory=list)
    raw: bytes = b""

    @property
    def json(self) -> Any:
        assert self.data is not None, f"frame without data: {self.raw!r}"
        return orjson.loads(self.data)


def parse_frame(raw: bytes) -> Frame:
    frame = Frame(raw=raw)
    for line in raw.decode().split("\n"):
        if line.startswith(":"):
            frame.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            frame.id = value
        elif name == "event":
            frame.event = value
        elif name == "data":
            frame.data = value if frame.data is None else frame.data + "\n" + value
        else:
            raise AssertionError(f"unexpected SSE line {line!r} in {raw!r}")
    return frame


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    """Frames of a streaming response, in order, comments included."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        while b"\n\n" in pending:
            raw, pending = pending.split(b"\n\n", 1)
            yield parse_frame(raw)
    assert pending.strip() == b"", f"stream ended inside a frame: {pending!r}"


async def events(response: httpx.Response) -> AsyncIterator[Frame]:
    """Frames that carry an event (heartbeat comments left out)."""
    async for frame in frames(response):
        if frame.event is not None:
            yield frame


async def collect(
    client: httpx.AsyncClient,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    json: Any = None,
) -> tuple[httpx.Response, list[Frame]]:
    """Open a stream and read it to its end; returns the response and its event frames."""
    request_headers = {"Accept": "text/event-stream", **(headers or {})}
    async with client.stream(method, url, headers=request_headers, json=json) as response:
        if response.status_code != 200:
            await response.aread()
            return response, []
        return response, [frame async for frame in events(response)]


async def follow(
    client: httpx.AsyncClient,
    execution_id: str,
    *,
    cursor: int = 0,
    started: asyncio.Event | None = None,
    timeout: float = 40.0,
) -> list[Frame]:
    """Read an execution's stream from ``cursor`` to its end (it must end within
    ``timeout``) on the replica ``client`` talks to; a 204 (nothing after the cursor) is
    no frame. ``started`` is set once the stream is open."""
    url = f"/api/executions/{execution_id}/stream"
    async with asyncio.timeout(timeout):
        async with client.stream("GET", url, headers={"Last-Event-ID": str(cursor)}) as response:
            if started is not None:
                started.set()
            if response.status_code == 204:
                return []
            assert response.status_code == 200, await response.aread()
            return [frame async for frame in events(response)]
