"""Remote tails woken through the notify channel (one pub/sub subscription per process
instead of an ``XREAD BLOCK`` per tail), with real processes: the execution runs on A,
the SSE readers attach through B. The connection that carries the wake-ups can drop, or
die silently, without a tail missing an event."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
from redis.asyncio import Redis

from tests.support.api import delay_workflow, execute, put, until, wait_finished
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, frames
from tests.support.timing import assert_below_timer


async def start_servers(
    valkey: ValkeyServer, root: Path, names: tuple[str, ...], **env: str
) -> list[FlowcastServer]:
    shared = {"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_SSE_PING_SECONDS": "0.5", **env}
    servers = [FlowcastServer(data_dir=root / name, env=shared) for name in names]
    await asyncio.gather(*(server.start() for server in servers))
    return servers


async def command_calls(redis: Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def until_quiet(redis: Redis, command: str, *, quiet: float, timeout: float) -> None:
    """Until Valkey has served no ``command`` for ``quiet`` seconds."""
    calls, since = await command_calls(redis, command), time.monotonic()

    async def quiet_so_long() -> bool:
        nonlocal calls, since
        now = await command_calls(redis, command)
        if now != calls:
            calls, since = now, time.monotonic()
        return time.monotonic() - since >= quiet

    await until(quiet_so_long, f"no {command} for {quiet} s", timeout, every=0.05)


class Reader:
    """One SSE stream read to its end in a task; each event with the time it arrived."""

    def __init__(self, client: httpx.AsyncClient, execution_id: str, cursor: int = 0) -> None:
        self.received: list[tuple[Frame, float]] = []
        self.status: int | None = None
        self.arrived = asyncio.Event()
        self.task = asyncio.create_task(self._read(client, execution_id, cursor))

    async def _read(self, client: httpx.AsyncClient, execution_id: str, cursor: int) -> None:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(cursor)}
        url = f"/api/executions/{execution_id}/stream"
        async with client.stream("GET", url, headers=headers) as response:
            self.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for frame in frames(response):
                if frame.event is not None:
                    self.received.append((frame, time.monotonic()))
                    self.arrived.set()

    async def until_type(self, event_type: str, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not any(frame.event == event_type for frame, _ in self.received):
                self.arrived.clear()
                await self.arrived.wait()

    @property
    def ids(self) -> list[int]:
        return [int(frame.id) for frame, _ in self.received if frame.id is not None]

    def arrival(self, event_type: str) -> float:
        return next(at for frame, at in self.received if frame.event == event_type)


# --------------------------------------------------------------- 1. lost wake-ups


async def test_a_notify_connection_dropped_while_redis_is_up_wakes_every_tail_when_back(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (hub.py docstring: "when that connection is lost and back, every tail reads
    again"; SPEC §4 live events): B's notify subscription is dropped by the server while
    Redis stays up (``CLIENT KILL TYPE pubsub`` here; in production a pub/sub client
    past ``client-output-buffer-limit pubsub``, a proxy or LB idle cut, a failover
    proxy). The terminal event is stored while B is not subscribed. B's stream should get
    it as soon as B is subscribed again; it gets it only when the tail's idle timer
    (``tail_block_ms``, 5 s) fires.

    Cause: the tail pool is built with ``retry=Retry(..., retries=2)`` and
    ``retry_on_error=[ConnectionError]`` (app/connections.py:40-43 and 52-53, app/main.py:101-106),
    so redis-py's ``PubSub._execute`` reconnects and re-subscribes *inside*
    ``get_message`` (PubSub.on_connect): no exception reaches ``Hub._listen``
    (lib/execution/hub.py:266-293), so ``_wake_all()`` (hub.py:275) never runs after
    that reconnect, and every message published meanwhile is lost for good. A loop of
    such kills never logs "notify listener lost" at all.
    Found by the step 13 review.
    """
    root = tmp_path
    a, b = await start_servers(own_valkey, root, ("a", "b"))
    admin = Redis.from_url(own_valkey.url)
    stopped = False
    try:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            await put(on_a, delay_workflow("quiet", 2000))
            execution_id = await execute(on_a, "quiet", {})
            reader = Reader(on_b, execution_id)
            # B's tail has read the events up to the delay, and now waits to be woken.
            await reader.until_type("block:started", timeout=10)
            async with asyncio.timeout(10):
                while sum(f.event == "block:started" for f, _ in reader.received) < 2:
                    reader.arrived.clear()
                    await reader.arrived.wait()
            # B's tail has read everything stored and is idle (waiting to be woken): no
            # tail read (XRANGE) for a while.
            await until_quiet(admin, "xrange", quiet=0.3, timeout=5)
            # B cannot reconnect while it is stopped: its subscription is gone while A
            # stores the rest of the run (and publishes its wake-ups to nobody on B).
            os.kill(b.pid, signal.SIGSTOP)
            stopped = True
            await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            await wait_finished(on_a, execution_id, timeout=10)
            os.kill(b.pid, signal.SIGCONT)
            stopped = False
            resumed = time.monotonic()
            await asyncio.wait_for(reader.task, timeout=15)
            assert reader.ids == list(range(1, len(reader.ids) + 1))
            assert reader.received[-1][0].event == "execution:completed"
            late = reader.arrival("execution:completed") - resumed
            timeline = [(f.event, round(at - resumed, 2)) for f, at in reader.received]
            # The subscription is back within milliseconds of SIGCONT.
            assert_below_timer(
                late,
                bound=1.0,
                timer="the tail's 5 s idle timer",
                what="terminal event on B's stream after SIGCONT",
                detail=(
                    "the wake-up published while B's subscription was down was lost and "
                    "nothing woke the tail (it waited for its idle timer); arrivals "
                    f"relative to SIGCONT: {timeline}"
                ),
            )
            assert "notify listener lost" not in b.logs()  # the reconnect was silent
    finally:
        if stopped:
            os.kill(b.pid, signal.SIGCONT)
        await admin.aclose()
        await asyncio.gather(a.stop(), b.stop())


class Proxy:
    """A TCP proxy to Valkey that can silently black-hole the connections that
    subscribed (the bytes are swallowed both ways; no FIN, no RST): what a NAT or
    firewall that forgot the connection, or a primary that vanished without closing its
    sockets (a host lost, a failover behind a virtual IP), looks like to a client."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.subscribed: list[dict[str, bool]] = []
        self.subscriptions = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.server is not None
        self.server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def blackhole_subscribers(self) -> None:
        for state in self.subscribed:
            state["dead"] = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        self._writers += [writer, upstream_writer]
        state = {"dead": False, "subscriber": False}

        async def pump(
            source: asyncio.StreamReader, sink: asyncio.StreamWriter, upstream: bool
        ) -> None:
            with contextlib.suppress(Exception):
                while data := await source.read(65536):
                    if upstream and not state["subscriber"] and b"SUBSCRIBE" in data.upper():
                        state["subscriber"] = True
                        self.subscribed.append(state)
                        self.subscriptions += 1
                    if state["dead"]:
                        continue  # swallowed: the peer never hears of it
                    sink.write(data)
                    await sink.drain()
            if not state["dead"]:
                sink.close()

        for task in (
            asyncio.create_task(pump(reader, upstream_writer, True)),
            asyncio.create_task(pump(upstream_reader, writer, False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def test_a_silently_dead_notify_connection_is_replaced(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (SPEC §4 live events; hub.py: "when that connection is lost and back,
    every tail reads again"): B's notify connection goes silently dead (no FIN/RST:
    a NAT/conntrack entry dropped, a primary host lost behind a virtual IP). Every
    other connection of B works (its requests and tails read through fresh ones). B's
    listener never notices, never subscribes again, and every stream on B from then on
    gets each burst of events only when its tail's 5 s idle timer fires, for as long as
    the kernel keeps the dead socket (TCP retransmission gives up after ~15 minutes).
    The old design's blocking XREAD timed out after ``socket_timeout`` (15 s) and
    reconnected.

    Cause: ``Hub._listen`` (lib/execution/hub.py:278-282) calls ``get_message(timeout=
    tail_block_ms)``; a read timeout there just returns ``None`` and the loop goes on
    (``continue``), and redis-py's pub/sub health check only *sends* a PING every 30 s
    (``health_check_interval=30``, app/connections.py:53) without ever expecting its
    reply. Nothing bounds how long the subscription may stay silent.
    Found by the step 13 review.
    """
    async with Proxy(own_valkey.port) as proxy:
        a = FlowcastServer(
            data_dir=tmp_path / "a",
            env={"FLOWCAST_REDIS_URL": own_valkey.url, "FLOWCAST_SSE_PING_SECONDS": "0.5"},
        )
        b = FlowcastServer(
            data_dir=tmp_path / "b",
            env={"FLOWCAST_REDIS_URL": proxy.url, "FLOWCAST_SSE_PING_SECONDS": "0.5"},
        )
        await asyncio.gather(a.start(), b.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
            ):
                await put(on_a, delay_workflow("quiet", 1500))

                async def subscriptions_above(count: int) -> bool:
                    return proxy.subscriptions > count

                await until(lambda: subscriptions_above(0), "B subscribed", 10, every=0.05)
                before = proxy.subscriptions
                proxy.blackhole_subscribers()
                # B finds its subscription silent, gets no PONG, and subscribes again.
                await until(
                    lambda: subscriptions_above(before), "B subscribed again", 20, every=0.05
                )
                execution_id = await execute(on_a, "quiet", {})
                reader = Reader(on_b, execution_id)
                await asyncio.wait_for(reader.task, timeout=10)
                assert reader.ids == list(range(1, len(reader.ids) + 1))
                assert reader.received[-1][0].event == "execution:completed"
                finished = await on_a.get(f"/api/executions/{execution_id}")
                assert finished.status_code == 200
                think_done = next(
                    at
                    for frame, at in reader.received
                    if frame.event == "block:completed" and frame.json["data"]["blockId"] == "think"
                )
                started_think = [
                    at for frame, at in reader.received if frame.event == "block:started"
                ][1]
                waited = think_done - started_think
                assert_below_timer(
                    waited,
                    bound=1500 / 1000 + 1.0,
                    timer="the tail's 5 s idle timer, past the 1.5 s delay",
                    what="end of a 1.5 s delay on B's stream after its start",
                    detail=(
                        "no wake-up reached B (its notify connection is dead and was never "
                        f"replaced: {proxy.subscriptions} subscription(s) seen by the proxy "
                        "in all), the tail waited for its 5 s idle timer"
                    ),
                )
        finally:
            await asyncio.gather(a.stop(), b.stop())
