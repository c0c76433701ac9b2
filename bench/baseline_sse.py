"""The baseline: a plain sse-starlette endpoint that streams the same frames, no buffer.

Run in its own process: ``uvicorn --factory bench.baseline_sse:create_app``. Each frame
has Flowcast's envelope and framing (``id:``, ``event:``, ``data:``, blank line), encoded
with orjson as it is sent and yielded one frame at a time, as a plain endpoint would.
Nothing is stored: this is the ceiling of the HTTP/SSE stack the server is built on.

Routes:

- ``POST /execute``: ``execution:started`` then ``execution:completed`` (TTFE baseline).
- ``GET /burst?n=N``: N ``block:chunk`` frames as fast as possible, then the terminal one.
- ``GET /paced?n=N&rate=R``: N chunk frames on an absolute schedule of R per second.
- ``GET /fanout/{name}``: joins a broadcast, sends a ``hello`` frame, then every frame
  the broadcast publishes; ``POST /fanout/{name}/start?n=N&rate=R`` starts publishing.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lib.execution.events import sse_frame, utc_timestamp

WORKFLOW_ID = "bench-baseline"


def frame(execution_id: str, event_id: int, event_type: str, data: dict[str, Any]) -> bytes:
    envelope = {
        "id": event_id,
        "type": event_type,
        "executionId": execution_id,
        "workflowId": WORKFLOW_ID,
        "ts": utc_timestamp(),
        "data": data,
    }
    return sse_frame(event_id, event_type, orjson.dumps(envelope))


def chunk(execution_id: str, index: int) -> bytes:
    return frame(execution_id, index + 2, "block:chunk", {"blockId": "talk", "text": f"w{index} "})


def execution_id() -> str:
    return "ex_" + secrets.token_urlsafe(18)  # the length of Flowcast's ids


def respond(frames: AsyncIterator[bytes]) -> EventSourceResponse:
    return EventSourceResponse(frames, headers={"Cache-Control": "no-cache"}, sep="\n")


async def execute(request: Request) -> Response:
    await request.body()
    eid = execution_id()

    async def frames() -> AsyncIterator[bytes]:
        yield frame(eid, 1, "execution:started", {"input": {}})
        yield frame(eid, 2, "execution:completed", {"output": {}, "durationMs": 0})

    return respond(frames())


async def burst(request: Request) -> Response:
    count = int(request.query_params["n"])
    eid = execution_id()

    async def frames() -> AsyncIterator[bytes]:
        for index in range(count):
            yield chunk(eid, index)
        yield frame(eid, count + 2, "execution:completed", {"output": {}, "durationMs": 0})

    return respond(frames())


async def paced(request: Request) -> Response:
    count = int(request.query_params["n"])
    rate = float(request.query_params["rate"])
    eid = execution_id()

    async def frames() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index in range(count):
            delay = start + index / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            yield chunk(eid, index)
        yield frame(eid, count + 2, "execution:completed", {"output": {}, "durationMs": 0})

    return respond(frames())


class Broadcast:
    """Frames published once and queued to every subscriber: fan-out without a buffer."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[bytes | None]] = set()
        self.task: asyncio.Task[None] | None = None
        self.execution_id = execution_id()

    def publish(self, data: bytes | None) -> None:
        for queue in self.queues:
            queue.put_nowait(data)

    async def run(self, count: int, rate: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index in range(count):
            delay = start + index / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.publish(chunk(self.execution_id, index))
        self.publish(frame(self.execution_id, count + 2, "execution:completed", {"output": {}}))
        self.publish(None)


async def fanout(request: Request) -> Response:
    broadcasts: dict[str, Broadcast] = request.app.state.broadcasts
    name = request.path_params["name"]
    broadcast = broadcasts.setdefault(name, Broadcast())
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    broadcast.queues.add(queue)

    async def frames() -> AsyncIterator[bytes]:
        try:
            yield frame(broadcast.execution_id, 1, "hello", {})
            while (data := await queue.get()) is not None:
                yield data
        finally:
            broadcast.queues.discard(queue)

    return respond(frames())


async def fanout_start(request: Request) -> Response:
    broadcasts: dict[str, Broadcast] = request.app.state.broadcasts
    broadcast = broadcasts[request.path_params["name"]]
    count = int(request.query_params["n"])
    rate = float(request.query_params["rate"])
    broadcast.task = asyncio.create_task(broadcast.run(count, rate))
    return JSONResponse({"subscribers": len(broadcast.queues)}, status_code=202)


async def ready(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def create_app() -> Starlette:
    """The baseline app (a factory, so nothing is built at import time)."""
    app = Starlette(
        routes=[
            Route("/readyz", ready),
            Route("/execute", execute, methods=["POST"]),
            Route("/burst", burst),
            Route("/paced", paced),
            Route("/fanout/{name}", fanout),
            Route("/fanout/{name}/start", fanout_start, methods=["POST"]),
        ]
    )
    app.state.broadcasts = {}
    return app
