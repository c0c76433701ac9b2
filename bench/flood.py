"""Load for the queue metric (``bench/queue.py``): cheap floods of starts, lines kept at
a level, and one start watched until ``execution:started``.

The floods use raw keep-alive connections: httpx's own CPU per request would take the
machine's second core from the servers while thousands of executions are posted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis

from bench.clients import HOST, frame_data, frame_event, http_request, open_stream
from bench.report import ms
from bench.stack import SSE
from tests.support.servers import bearer

STARTED = "execution:started"
POSTERS = 16  # keep-alive connections of one flood, at most
TICK = 0.2  # how often a feeder looks at the lines it keeps
_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)


class Poster:
    """``POST``s on one keep-alive connection, each answer read whole (not parsed)."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.key = key
        self.statuses: Counter[int] = Counter()
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: Any) -> int:
        if self._io is None:
            self._io = await asyncio.open_connection(HOST, self.port)
        reader, writer = self._io
        request = http_request(
            "POST", path, port=self.port, headers=bearer(self.key), json=body, keep_alive=True
        )
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = _LENGTH.search(head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        status = int(head.split(b" ", 2)[1])
        self.statuses[status] += 1
        if b"connection: close" in head.lower():
            self.close()
        return status

    def close(self) -> None:
        if self._io is not None:
            self._io[1].close()
            self._io = None


async def flood(port: int, key: str, workflows: list[str], count: int) -> Counter[int]:
    """Start ``count`` executions round robin over ``workflows``; the answers' statuses."""
    posters = [Poster(port, key) for _ in range(min(POSTERS, count))]
    paths = [f"/api/workflows/{workflows[i % len(workflows)]}/execute" for i in range(count)]

    async def loop(poster: Poster) -> None:
        while paths:
            await poster.post(paths.pop(), {"input": {}})

    try:
        await asyncio.gather(*(loop(poster) for poster in posters))
    finally:
        for poster in posters:
            poster.close()
    total: Counter[int] = Counter()
    for poster in posters:
        total.update(poster.statuses)
    return total


# --- lines kept at a level --------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """A tenant's line a feeder keeps at ``level`` queued, with starts of ``workflows``."""

    key: str  # the tenant's API key
    queued: str  # its queued set in Redis (``Keys.queued``)
    level: int
    workflows: list[str]


@dataclass(frozen=True)
class Mark:
    """Each line's queued count, read in one MULTI, and what was posted to it before."""

    at: float  # perf_counter
    depth: dict[str, int]
    posted: dict[str, int]


@dataclass
class Feeder:
    """Tops lines up to their level every ``TICK`` and marks each tick, so the executions
    taken from a line between two marks are known exactly: its depth at the first, plus
    what was posted between them, minus its depth at the second."""

    port: int
    redis: Redis
    lines: list[Line]
    marks: list[Mark] = field(default_factory=list)
    posted: Counter[str] = field(default_factory=Counter)
    refused: Counter[int] = field(default_factory=Counter)

    async def mark(self) -> Mark:
        async with self.redis.pipeline(transaction=True) as pipe:
            for line in self.lines:
                pipe.zcard(line.queued)
            depths = await pipe.execute()
        mark = Mark(
            time.perf_counter(),
            {line.key: int(depth) for line, depth in zip(self.lines, depths, strict=True)},
            dict(self.posted),
        )
        self.marks.append(mark)
        return mark

    async def tick(self) -> None:
        mark = await self.mark()
        for line in self.lines:
            missing = line.level - mark.depth[line.key]
            if missing > 0:
                statuses = await flood(self.port, line.key, line.workflows, missing)
                self.posted[line.key] += statuses.pop(202, 0)
                self.refused.update(statuses)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Feeder]:
        """Tick until the block ends (one last mark then)."""
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), TICK)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            stop.set()
            await task
            await self.mark()

    def taken(self, key: str, first: Mark, last: Mark) -> int:
        """Executions taken from ``key``'s line between two marks."""
        return (
            first.depth[key]
            + last.posted.get(key, 0)
            - first.posted.get(key, 0)
            - (last.depth[key])
        )

    async def until_taken(self, key: str, count: int, timeout: float) -> None:
        """Wait until ``count`` were taken from ``key``'s line since the first mark."""
        async with asyncio.timeout(timeout):
            while not self.marks or self.taken(key, self.marks[0], self.marks[-1]) < count:
                await asyncio.sleep(TICK)


# --- one start, watched on its own stream ----------------------------------------------


@dataclass
class Start:
    """Request sent → ``execution:started`` received, and the ``queuedMs`` it carried.
    A late start (none within the timeout) has ``seconds`` None until ``settle`` finds
    its ``execution:started`` in the stored log (then its ``queuedMs`` stands in)."""

    execution_id: str
    seconds: float | None
    queued_ms: int | None
    queue_frames: int = 0
    late: bool = False


async def start_streamed(port: int, key: str, workflow: str, *, timeout: float) -> Start:
    """``POST …/execute`` with ``Accept: text/event-stream``, read to its end, or given up
    after ``timeout`` without ``execution:started`` (a late start)."""
    got: dict[str, Any] = {}
    queue_frames = 0

    def on_frames(frames: list[bytes], _received_at: float) -> None:
        nonlocal queue_frames
        for frame in frames:
            kind = frame_event(frame)
            if kind == "queue":
                queue_frames += 1
            elif kind == STARTED and "at" not in got:
                got["at"] = time.perf_counter()
                got["queued_ms"] = frame_data(frame)["data"].get("queuedMs", 0)

    request = http_request(
        "POST",
        f"/api/workflows/{workflow}/execute",
        port=port,
        headers={**SSE, **bearer(key)},
        json={"input": {}},
    )
    sent = time.perf_counter()
    client = await open_stream(port, request, on_frames)
    try:
        await asyncio.wait_for(client.done, timeout)
    except TimeoutError:
        pass
    finally:
        client.close()
    if client.status != 200:
        raise RuntimeError(f"{workflow}: answered {client.status}")
    eid = client.headers.get("x-execution-id", "")
    if "at" not in got:
        return Start(eid, None, None, queue_frames, late=True)
    return Start(eid, got["at"] - sent, int(got["queued_ms"]), queue_frames)


async def settle(
    http: httpx.AsyncClient, url: str, key: str, starts: list[Start], *, timeout: float
) -> None:
    """Wait (all at once, up to ``timeout``) for the late starts' ``execution:started`` in
    their stored logs, and take its ``queuedMs`` as their wait; those still without one
    stay None (never started)."""

    async def one(start: Start) -> None:
        path = f"{url}/api/executions/{start.execution_id}/events"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while True:
                    answer = await http.get(path, headers=bearer(key))
                    if answer.status_code == 200:
                        for event in answer.json()["events"]:
                            if event["type"] == STARTED:
                                start.queued_ms = int(event["data"].get("queuedMs", 0))
                                start.seconds = start.queued_ms / 1000
                                return
                    await asyncio.sleep(0.5)

    await asyncio.gather(*(one(start) for start in starts if start.late and start.execution_id))


def waits(starts: list[Start]) -> list[float]:
    """Each start's seconds to ``execution:started``; infinite when it never came."""
    return [math.inf if s.seconds is None else s.seconds for s in starts]


def wait(seconds: float) -> str:
    if seconds == math.inf:
        return "never"
    return ms(seconds) if seconds < 10 else f"{seconds:.1f} s"
