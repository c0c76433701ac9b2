"""The relay baselines: the plain endpoint's frames, sent to the client by another process
through Valkey — the least any design whose reader is not on the writer's process does.

Run as two processes of its own (``uvicorn --factory bench.relay_sse:create_app``, both
on ``FLOWCAST_REDIS_URL``): **P** produces the frames of ``bench/baseline_sse.py`` (the
same envelope, framing and ``ts``) on the same absolute schedule as ``/paced`` and hands
each to Valkey the moment it is made; **Q** holds the client's sse-starlette response
and sends each frame as Valkey delivers it. Both use redis-py's asyncio client built by
``app.connections.connect`` with the settings ``app/stores.py`` gives Flowcast's own
clients (a blocking pool for commands, a pool of its own for blocking reads and pub/sub).
Nothing else: no buffer, no workflow, no id reservation.

Routes:

- ``GET /relay/{name}`` (Q): subscribes to ``bench:relay:{name}``, sends a ``hello``
  frame once subscribed, then every message published there, until the terminal frame.
- ``GET /xrelay/{name}`` (Q): sends ``hello``, then reads the stream ``bench:xrelay:{name}``
  with ``XREAD BLOCK`` from its start and sends each entry, until the terminal frame (a
  stored hop: the event is written, then the reader's blocked read returns it).
- ``POST /produce/{name}?n=N&rate=R&mode=publish|xadd`` (P): starts producing N chunk
  frames at R per second, each ``PUBLISH``ed to (or ``XADD``ed to) the name's channel
  (stream), then the terminal frame; answers 202 at once.
- ``POST /execute`` (either): one Redis round trip (``EVALSHA`` of a script that writes
  a small hash with an expiry), then ``execution:started`` and ``execution:completed``:
  the plain TTFE endpoint plus the one store round trip any durable start needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.connections import connect
from app.stores import MAX_TAIL_CONNECTIONS, TAIL_BLOCK_MS
from bench.baseline_sse import chunk, execution_id, frame, respond

REDIS_MAX_CONNECTIONS = 24  # Settings.redis_max_connections's default
TERMINAL = b"event: execution:completed\n"
# One round trip that writes, as a start writes its record (KEYS[1]: the hash; ARGV[1]: id).
START_SCRIPT = """
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'status', 'running')
redis.call('PEXPIRE', KEYS[1], 60000)
return 1
"""


def channel(name: str) -> str:
    return f"bench:relay:{name}"


def stream_key(name: str) -> str:
    return f"bench:xrelay:{name}"


def hello(eid: str) -> bytes:
    return frame(eid, 1, "hello", {})


async def relay(request: Request) -> Response:
    """Frames published on the name's channel, as Valkey delivers them."""
    tail: Redis = request.app.state.tail_redis
    name = request.path_params["name"]
    eid = execution_id()

    async def frames() -> AsyncIterator[bytes]:
        pubsub = tail.pubsub()
        try:
            await pubsub.subscribe(channel(name))
            yield hello(eid)
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is None or message["type"] != "message":
                    continue
                data: bytes = message["data"]
                yield data
                if TERMINAL in data:
                    return
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    return respond(frames())


async def xrelay(request: Request) -> Response:
    """Entries added to the name's stream, each read by a blocked ``XREAD``."""
    tail: Redis = request.app.state.tail_redis
    redis: Redis = request.app.state.redis
    key = stream_key(request.path_params["name"])
    eid = execution_id()

    async def frames() -> AsyncIterator[bytes]:
        last: bytes | str = "0-0"
        try:
            yield hello(eid)
            while True:
                reply: Any = await tail.xread({key: last}, block=TAIL_BLOCK_MS)
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        last = entry_id
                        data: bytes = fields[b"f"]
                        yield data
                        if TERMINAL in data:
                            return
        finally:
            await redis.delete(key)

    return respond(frames())


async def produce(request: Request) -> Response:
    redis: Redis = request.app.state.redis
    name = request.path_params["name"]
    count = int(request.query_params["n"])
    rate = float(request.query_params["rate"])
    mode = request.query_params.get("mode", "publish")
    if mode not in ("publish", "xadd"):
        return JSONResponse({"error": f"unknown mode {mode}"}, status_code=400)
    eid = execution_id()

    async def send(data: bytes) -> None:
        if mode == "publish":
            await redis.publish(channel(name), data)
        else:
            await redis.xadd(stream_key(name), {"f": data})

    async def run() -> None:
        # The schedule of baseline_sse's /paced: each frame is made (its ts taken) on
        # time and handed to Valkey at once.
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index in range(count):
            delay = start + index / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(chunk(eid, index))
        await send(frame(eid, count + 2, "execution:completed", {"output": {}, "durationMs": 0}))

    tasks: set[asyncio.Task[None]] = request.app.state.tasks
    task = asyncio.create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return JSONResponse({"mode": mode}, status_code=202)


async def execute(request: Request) -> Response:
    await request.body()
    eid = execution_id()
    await request.app.state.start_script(keys=[f"bench:start:{eid}"], args=[eid])

    async def frames() -> AsyncIterator[bytes]:
        yield frame(eid, 1, "execution:started", {"input": {}})
        yield frame(eid, 2, "execution:completed", {"output": {}, "durationMs": 0})

    return respond(frames())


async def ready(request: Request) -> Response:
    await request.app.state.redis.ping()
    return JSONResponse({"status": "ok"})


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    url = os.environ["FLOWCAST_REDIS_URL"]
    # The clients app/stores.py builds for a Flowcast process.
    app.state.redis = connect(
        url, socket_timeout=TAIL_BLOCK_MS / 1000 + 10, max_connections=REDIS_MAX_CONNECTIONS
    )
    app.state.tail_redis = connect(
        url,
        socket_timeout=TAIL_BLOCK_MS / 1000 + 10,
        max_connections=MAX_TAIL_CONNECTIONS,
        queue=False,
    )
    app.state.start_script = app.state.redis.register_script(START_SCRIPT)
    app.state.tasks = set()
    try:
        yield
    finally:
        for task in app.state.tasks:
            task.cancel()
        await app.state.tail_redis.aclose()
        await app.state.redis.aclose()
        # A client given its pool (connect's) leaves the pool open when closed.
        await app.state.redis.connection_pool.disconnect()


def create_app() -> Starlette:
    """The relay app (a factory, so nothing is built at import time)."""
    return Starlette(
        routes=[
            Route("/readyz", ready),
            Route("/relay/{name}", relay),
            Route("/xrelay/{name}", xrelay),
            Route("/produce/{name}", produce, methods=["POST"]),
            Route("/execute", execute, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
