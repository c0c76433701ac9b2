"""A load-client process for the ``starts`` and ``streams`` metrics (``bench/scale.py``).

    python -m bench.scale_client

One JSON command per line on stdin, one JSON answer per line on stdout. The metrics
spread their clients over several of these processes, so no single client process
becomes the limit, and each reports its own CPU time (``getrusage``) beside what it
measured. Wall clock times (``time.time()``) are comparable between the processes of
one machine, so the controller can tell when the last of all clients was served.

Commands:

- ``starts``: ``loops`` concurrent loops, each on its own keep-alive connection to one of
  ``ports`` (round robin): ``POST path`` with ``Accept: text/event-stream``, read the
  SSE response to its end, again, until the wall time ``t1``. Answers with the
  executions completed in ``[t0, t1]``, the errors, the CPU time spent in ``[t0, t1]``
  and each completed execution's request → terminal event time.
- ``posts``: ``loops`` loops on keep-alive connections, each ``POST path`` with a JSON
  body read to its end (``Content-Length``), again, until ``t1`` or until ``count``
  requests were answered; answers with the statuses, the CPU time spent and each
  request's time (the ``starts-cost`` metric, ``bench/starts_cost.py``).
- ``open``: open one SSE stream per target (``[path, cursor]``) at once, all
  concurrently; answers when every one got its response headers or failed (or
  ``timeout`` passed), with the first and last header times.
- ``record``: start (``on: true``) or stop (``on: false``, answers with them) collecting
  receive - ``ts`` latencies of ``block:chunk`` frames on every open stream.
- ``stats``: streams open, streams that ended by themselves, frames, CPU time.
- ``exit``: close every stream and end.
"""

from __future__ import annotations

import asyncio
import math
import re
import resource
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import orjson

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.clients import HOST, FrameHandler, SSEClient, frame_event, frame_ts, http_request

SSE = {"Accept": "text/event-stream"}
COMPLETED = "execution:completed"
CHUNK = b"event: block:chunk\n"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit; returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# --- starts: one keep-alive connection per loop ----------------------------------------


class Reusable(SSEClient):
    """An ``SSEClient`` on a keep-alive connection: one SSE request after another.

    A response ends at its last chunk; the connection then stays open for the next
    request. Any other ending (an error status, a response that is not chunked, the
    server closing) closes the connection: the loop opens a new one.
    """

    def __init__(self) -> None:
        super().__init__(b"", self._frames)
        self.lost = False
        self.last_event: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes) -> asyncio.Future[None]:
        self._raw.clear()
        self._sse.clear()
        self._head_done = False
        self._chunked = False
        self._chunk_left = 0
        self._need_crlf = False
        self.status = 0
        self.headers = {}
        self.frames = 0
        self.last_event = None
        self.done = asyncio.get_running_loop().create_future()
        assert self._transport is not None
        self._transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_done and (self.status != 200 or not self._chunked):
            self._close_for_good()  # not a stream: give the connection up

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        super().connection_lost(exc)

    def _finish(self, exc: Exception | None = None) -> None:
        if not self.lost and exc is None and self._chunked and self._chunk_left < 0:
            if not self.done.done():  # the response is complete; keep the connection
                self.done.set_result(None)
            return
        self._close_for_good(exc)

    def _close_for_good(self, exc: Exception | None = None) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.close()
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)

    def _frames(self, frames: list[bytes], received_at: float) -> None:
        for frame in frames:
            kind = frame_event(frame)
            if kind is not None:
                self.last_event = kind


async def starts(command: dict[str, Any]) -> dict[str, Any]:
    path: str = command["path"]
    body = command.get("body", {"input": {}})
    t0: float = command["t0"]
    t1: float = command["t1"]
    timeout: float = command.get("timeout", 30.0)
    ports: list[int] = command["ports"]
    requests = {
        port: http_request("POST", path, port=port, headers=SSE, json=body, keep_alive=True)
        for port in ports
    }
    loop = asyncio.get_running_loop()
    completed: list[float] = []  # wall time of each terminal event...
    durations: list[float] = []  # ...and request → terminal event, in [t0, t1]
    errors: Counter[str] = Counter()
    errors_in_window = 0
    connections = 0
    cpu: dict[str, float] = {}

    def error(reason: str, at: float) -> None:
        nonlocal errors_in_window
        errors[reason] += 1
        if t0 <= at <= t1:
            errors_in_window += 1

    async def one_loop(port: int) -> None:
        nonlocal connections
        client: Reusable | None = None
        request = requests[port]
        while time.time() < t1:
            try:
                if client is None or client.lost:
                    async with asyncio.timeout(timeout):
                        _, client = await loop.create_connection(Reusable, HOST, port)
                    connections += 1
                sent = time.time()
                async with asyncio.timeout(timeout):
                    await client.send(request)
            except (OSError, TimeoutError) as exc:
                error(type(exc).__name__, time.time())
                if client is not None:
                    client.close()
                client = None
                await asyncio.sleep(0.05)
                continue
            ended = time.time()
            if client.status != 200:
                error(f"status {client.status}", ended)
            elif client.last_event != COMPLETED:
                error(f"ended with {client.last_event or 'no event'}", ended)
            elif t0 <= ended <= t1:
                completed.append(ended)
                durations.append(ended - sent)
        if client is not None:
            client.close()

    async def cpu_at(name: str, at: float) -> None:
        await asyncio.sleep(max(at - time.time(), 0))
        cpu[name] = cpu_seconds()

    async with asyncio.TaskGroup() as group:
        group.create_task(cpu_at("t0", t0))
        group.create_task(cpu_at("t1", t1))
        for index in range(command["loops"]):
            group.create_task(one_loop(ports[index % len(ports)]))
    return {
        "completed": len(completed),
        "errors": dict(errors),
        "errors_in_window": errors_in_window,
        "connections": connections,
        "cpu": cpu["t1"] - cpu["t0"],
        "durations": durations,
    }


# --- posts: plain requests on keep-alive connections ------------------------------------


_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)


class Plain(asyncio.Protocol):
    """Requests answered with a ``Content-Length`` body, one after another on one
    keep-alive connection; ``send`` resolves to the answer's status once its body is in
    (the body is not parsed). A connection the server closes is given up."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.done: asyncio.Future[int] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes) -> asyncio.Future[int]:
        self._buffer.clear()
        self.done = asyncio.get_running_loop().create_future()
        assert self._transport is not None
        self._transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self._buffer[:end])
        length = _LENGTH.search(head)
        if len(self._buffer) < end + 4 + (int(length.group(1)) if length else 0):
            return
        if b"connection: close" in head.lower():
            self.close()
        if self.done is not None and not self.done.done():
            self.done.set_result(int(head.split(b" ", 2)[1]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc or ConnectionResetError("closed by the server"))

    def close(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.close()


async def posts(command: dict[str, Any]) -> dict[str, Any]:
    """``loops`` loops, each on its own keep-alive connection to one of ``ports`` (round
    robin), each sending ``POST path`` with the JSON ``body`` (and the loop's entry of
    ``headers``, round robin, if given) as soon as the previous answer is in. Either
    until the wall time ``t1``, counting the answers that arrive in ``[t0, t1]`` (and
    the CPU spent in that window), or, with ``count``, until that many requests were
    answered in all (the CPU spent from the first request to the last answer)."""
    path: str = command["path"]
    body = command.get("body", {"input": {}})
    ports: list[int] = command["ports"]
    headers: list[dict[str, str]] = command.get("headers") or [{}]
    timeout: float = command.get("timeout", 30.0)
    count: int | None = command.get("count")
    t0: float = command.get("t0", 0.0)
    t1: float = command.get("t1", math.inf)
    loop = asyncio.get_running_loop()
    statuses: Counter[int] = Counter()  # answers in the window (all of them with count)
    answered = 0  # answers in all, the warm-up's included
    errors: Counter[str] = Counter()  # not answered: the whole run
    durations: list[float] = []  # request sent → answer in, in the window
    connections = 0
    left = count if count is not None else -1
    cpu: dict[str, float] = {}
    began = time.time()

    async def one_loop(index: int) -> None:
        nonlocal connections, left, answered
        port = ports[index % len(ports)]
        request = http_request(
            "POST", path, port=port, headers=headers[index % len(headers)], json=body,
            keep_alive=True,
        )  # fmt: skip
        client: Plain | None = None
        while left > 0 if count is not None else time.time() < t1:
            left -= 1
            try:
                if client is None or client.lost:
                    async with asyncio.timeout(timeout):
                        _, client = await loop.create_connection(Plain, HOST, port)
                    connections += 1
                sent = time.time()
                async with asyncio.timeout(timeout):
                    status = await client.send(request)
            except (OSError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
                if client is not None:
                    client.close()
                client = None
                await asyncio.sleep(0.05)
                continue
            answered += 1
            now = time.time()
            if count is not None or t0 <= now <= t1:
                statuses[status] += 1
                durations.append(now - sent)
        if client is not None:
            client.close()

    async def cpu_at(name: str, at: float) -> None:
        await asyncio.sleep(max(at - time.time(), 0))
        cpu[name] = cpu_seconds()

    cpu["t0"] = cpu_seconds()
    async with asyncio.TaskGroup() as group:
        if count is None:
            group.create_task(cpu_at("t0", t0))
            group.create_task(cpu_at("t1", t1))
        for index in range(command["loops"]):
            group.create_task(one_loop(index))
    cpu.setdefault("t1", cpu_seconds())
    return {
        "statuses": {str(status): n for status, n in statuses.items()},
        "answered": answered,
        "errors": dict(errors),
        "connections": connections,
        "cpu": cpu["t1"] - cpu["t0"],
        "began": began,
        "ended": time.time(),
        "durations": durations,
    }


# --- streams: many SSE streams held open -----------------------------------------------


class Held(SSEClient):
    """An ``SSEClient`` whose ``head`` future resolves when its headers are in (or it ended)."""

    def __init__(self, request: bytes, on_frames: FrameHandler) -> None:
        super().__init__(request, on_frames)
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _read_head(self) -> bool:
        complete = super()._read_head()
        if complete and not self.head.done():
            self.head.set_result(None)
        return complete

    def _finish(self, exc: Exception | None = None) -> None:
        super()._finish(exc)
        if not self.head.done():
            self.head.set_result(None)


class Streams:
    """Every stream this process holds, and the latencies it collects."""

    def __init__(self) -> None:
        self.clients: list[Held] = []
        self.closing = False
        self.recording = False
        self.latencies: list[float] = []
        self.frames = 0
        self.ended: Counter[str] = Counter()  # streams that ended without being closed

    def on_frames(self, frames: list[bytes], received_at: float) -> None:
        self.frames += len(frames)
        if not self.recording:
            return
        for frame in frames:
            if CHUNK in frame:
                ts = frame_ts(frame)
                if ts is not None:
                    self.latencies.append(received_at - ts)

    def _ended(self, future: asyncio.Future[None]) -> None:
        if self.closing:
            return
        exc = None if future.cancelled() else future.exception()
        self.ended[type(exc).__name__ if exc is not None else "closed by the server"] += 1

    async def open(self, command: dict[str, Any]) -> dict[str, Any]:
        port: int = command["port"]
        timeout: float = command.get("timeout", 30.0)
        loop = asyncio.get_running_loop()
        failed: Counter[str] = Counter()

        async def one(path: str, cursor: int) -> Held | None:
            request = http_request(
                "GET", path, port=port, headers={**SSE, "Last-Event-ID": str(cursor)}
            )
            client: Held | None = None
            try:
                async with asyncio.timeout(timeout):
                    _, client = await loop.create_connection(
                        lambda: Held(request, self.on_frames), HOST, port
                    )
                    await client.head
                if client.head_at is None:
                    client.done.result()  # raises what ended it, if anything did
                    failed["closed before the headers"] += 1
                    return None
                if client.status != 200:
                    failed[f"status {client.status}"] += 1
                    client.close()
                    return None
            except (OSError, TimeoutError) as exc:
                failed[type(exc).__name__] += 1
                if client is not None:
                    client.close()
                return None
            client.done.add_done_callback(self._ended)
            return client

        cpu = cpu_seconds()
        opened = await asyncio.gather(*(one(path, cursor) for path, cursor in command["targets"]))
        clients = [client for client in opened if client is not None]
        self.clients += clients
        heads = [client.head_at for client in clients if client.head_at is not None]
        return {
            "opened": len(clients),
            "failed": dict(failed),
            "first_head": min(heads, default=None),
            "last_head": max(heads, default=None),
            "cpu": cpu_seconds() - cpu,
        }

    def record(self, on: bool) -> dict[str, Any]:
        self.recording = on
        if on:
            self.latencies = []
            return {"ok": True}
        latencies, self.latencies = self.latencies, []
        return {"latencies": latencies}

    def stats(self) -> dict[str, Any]:
        return {
            "open": sum(1 for client in self.clients if not client.done.done()),
            "ended": dict(self.ended),
            "frames": self.frames,
            "cpu": cpu_seconds(),
        }

    def close(self) -> None:
        self.closing = True
        for client in self.clients:
            client.close()


Command = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve(commands: dict[str, Command], close: Callable[[], None]) -> None:
    """Answer one JSON command per line on stdin with one JSON line on stdout, by its
    ``cmd``, until ``exit`` (or stdin closes); ``close`` runs at the end. The first line
    out says the process is ready, with its open-file limit."""
    limit = raise_nofile()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer

    def answer(value: dict[str, Any]) -> None:
        out.write(orjson.dumps(value) + b"\n")
        out.flush()

    answer({"ready": True, "nofile": limit})
    while line := await reader.readline():
        command = orjson.loads(line)
        kind = command["cmd"]
        if kind == "exit":
            close()
            answer({"ok": True})
            break
        handler = commands.get(kind)
        answer(await handler(command) if handler else {"error": f"unknown command {kind!r}"})
    close()
    await asyncio.sleep(0)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main`` on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


async def main() -> None:
    streams = Streams()

    async def record(command: dict[str, Any]) -> dict[str, Any]:
        return streams.record(bool(command["on"]))

    async def stats(_command: dict[str, Any]) -> dict[str, Any]:
        return streams.stats()

    commands: dict[str, Command] = {
        "starts": starts,
        "posts": posts,
        "open": streams.open,
        "record": record,
        "stats": stats,
    }
    await serve(commands, streams.close)


if __name__ == "__main__":
    run(main)
