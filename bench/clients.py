"""A minimal raw-socket SSE client for the benchmark.

httpx costs tens of microseconds per chunk, which would make a single client process the
bottleneck when it holds 1,000 streams or reads 100,000 frames. This client is an
``asyncio.Protocol``: it stamps each read the moment the loop hands it over, undoes
HTTP/1.1 chunked encoding and splits SSE frames on the blank line, and leaves any
further parsing to the caller. One request per connection (``Connection: close``);
``bench/scale_client.py`` reuses it on keep-alive connections (``keep_alive=True``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

import orjson

HOST = "127.0.0.1"

FrameHandler = Callable[[list[bytes], float], None]


def http_request(
    method: str,
    path: str,
    *,
    port: int,
    headers: dict[str, str] | None = None,
    json: Any = None,
    keep_alive: bool = False,
) -> bytes:
    """The bytes of one HTTP/1.1 request that closes its connection when answered
    (or, with ``keep_alive``, leaves it open for the next request)."""
    body = b"" if json is None else orjson.dumps(json)
    connection = "keep-alive" if keep_alive else "close"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}", f"Connection: {connection}"]
    if json is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    elif method in ("POST", "PUT"):
        lines.append("Content-Length: 0")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class SSEClient(asyncio.Protocol):
    """One streaming HTTP response, read as SSE frames.

    ``on_frames(frames, received_at)`` gets every batch of complete frames with the wall
    clock time (``time.time()``) of the read that completed them. ``frames`` counts them
    all (heartbeat comments included); ``first_frame_at``/``last_frame_at`` are
    ``time.perf_counter()`` values, ``head_at`` the wall clock time the response's
    headers were complete.
    """

    def __init__(self, request: bytes, on_frames: FrameHandler | None = None) -> None:
        self._request = request
        self._on_frames = on_frames
        self._transport: asyncio.Transport | None = None
        self._raw = bytearray()
        self._sse = bytearray()
        self._head_done = False
        self._chunked = False
        self._chunk_left = 0
        self._need_crlf = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.frames = 0
        self.bytes = 0
        self.first_frame_at: float | None = None
        self.last_frame_at: float | None = None
        self.head_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        received_at = time.time()
        self._raw += data
        if not self._head_done and not self._read_head():
            return
        body = self._dechunk() if self._chunked else self._take_all()
        if body:
            self.bytes += len(body)
            self._feed(body, received_at)
        if self._chunked and self._chunk_left < 0:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc)

    def close(self) -> None:
        """Drop the connection (a stream given up on before its end)."""
        self._finish()

    def _finish(self, exc: Exception | None = None) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self.done.done():
            if exc is not None and not self._head_done:
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)

    def _read_head(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        self.status = int(head[0].split(" ", 2)[1])
        for line in head[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self._head_done = True
        self.head_at = time.time()
        return True

    def _take_all(self) -> bytes:
        body = bytes(self._raw)
        self._raw.clear()
        return body

    def _dechunk(self) -> bytes:
        raw = self._raw
        pos = 0
        out: list[bytes] = []
        while self._chunk_left >= 0:
            if self._chunk_left > 0:
                take = min(self._chunk_left, len(raw) - pos)
                if take == 0:
                    break
                out.append(bytes(raw[pos : pos + take]))
                pos += take
                self._chunk_left -= take
                self._need_crlf = self._chunk_left == 0
                continue
            if self._need_crlf:
                if len(raw) - pos < 2:
                    break
                pos += 2
                self._need_crlf = False
                continue
            end = raw.find(b"\r\n", pos)
            if end < 0:
                break
            size = int(bytes(raw[pos:end]).split(b";", 1)[0], 16)
            pos = end + 2
            self._chunk_left = size if size > 0 else -1  # -1: the last chunk was read
        del raw[:pos]
        return b"".join(out)

    def _feed(self, body: bytes, received_at: float) -> None:
        sse = self._sse
        sse += body
        end = sse.rfind(b"\n\n")
        if end < 0:
            return
        complete = bytes(sse[:end])
        del sse[: end + 2]
        now = time.perf_counter()
        if self.first_frame_at is None:
            self.first_frame_at = now
        self.last_frame_at = now
        self.frames += complete.count(b"\n\n") + 1
        if self._on_frames is not None:
            self._on_frames(complete.split(b"\n\n"), received_at)


async def open_stream(
    port: int, request: bytes, on_frames: FrameHandler | None = None
) -> SSEClient:
    """Connect, send the request and return the client reading its response."""
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(lambda: SSEClient(request, on_frames), HOST, port)
    return client


def frame_event(frame: bytes) -> str | None:
    """The ``event:`` of a frame (None for a comment)."""
    start = frame.find(b"event: ")
    if start < 0:
        return None
    end = frame.find(b"\n", start)
    return frame[start + 7 : end if end >= 0 else None].decode()


def frame_data(frame: bytes) -> Any:
    """The decoded ``data:`` of a frame."""
    start = frame.find(b"data: ")
    return orjson.loads(frame[start + 6 :]) if start >= 0 else None


def frame_id(frame: bytes) -> int:
    """The ``id:`` of a frame (0 when it has none)."""
    if not frame.startswith(b"id: "):
        return 0
    return int(frame[4 : frame.index(b"\n")])


_TS_CACHE: dict[bytes, float] = {}


def frame_ts(frame: bytes) -> float | None:
    """The envelope's ``ts`` as epoch seconds, found without decoding the JSON.

    ``ts`` has millisecond resolution and is truncated, so the event was emitted in
    ``[ts, ts + 1 ms)``: a latency computed from it overstates by less than 1 ms.
    """
    start = frame.find(b'"ts":"')
    if start < 0:
        return None
    raw = frame[start + 6 : start + 30]
    cached = _TS_CACHE.get(raw)
    if cached is None:
        if len(_TS_CACHE) > 100_000:
            _TS_CACHE.clear()
        cached = _TS_CACHE[raw] = datetime.fromisoformat(raw.decode()).timestamp()
    return cached


class LatencyRecorder:
    """Collects receive-minus-``ts`` latencies of the frames of one event type."""

    def __init__(self, event_type: str = "block:chunk") -> None:
        self._marker = f"event: {event_type}\n".encode()
        self.latencies: list[float] = []
        self.received: list[tuple[int, float]] = []  # (event id, receive time)
        self.types: list[str] = []

    def __call__(self, frames: list[bytes], received_at: float) -> None:
        for frame in frames:
            kind = frame_event(frame)
            if kind is not None:
                self.types.append(kind)
            if self._marker in frame:
                ts = frame_ts(frame)
                if ts is not None:
                    self.latencies.append(received_at - ts)
                    self.received.append((frame_id(frame), received_at))
