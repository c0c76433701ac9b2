"""Ownership, crashes and shutdown (SPEC §7) on real processes sharing one Valkey.

A process that runs an execution holds a lease (here 1 s, renewed every third of it).
When the owner is killed, another process takes the execution over under a new fencing
token and recovers it from its checkpoint (or, with recovery turned off, ends it with
``worker_lost``); an owner that was only stalled cannot append once it wakes up. On
SIGTERM a process lets short executions finish within the grace period and hands the
others off to another process, which recovers them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from tests.support.api import (
    all_events,
    delay_workflow,
    execute,
    has_stored,
    put,
    stored_types,
    talking_workflow,
    until,
)
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events
from tests.support.timing import assert_below_timer, latencies

LEASE_SECONDS = 1.0


def servers(valkey: ValkeyServer, root: Path, **env: str) -> tuple[FlowcastServer, ...]:
    shared = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_LEASE_SECONDS": str(LEASE_SECONDS),
        "FLOWCAST_SSE_PING_SECONDS": "0.5",
        **env,
    }
    return (
        FlowcastServer(data_dir=root / "a", env=shared),
        FlowcastServer(data_dir=root / "b", env=shared),
    )


@contextlib.asynccontextmanager
async def running(*flowcasts: FlowcastServer) -> AsyncIterator[None]:
    """Start the servers; on the way out continue any stopped one, then stop them all."""
    try:
        await asyncio.gather(*(server.start() for server in flowcasts))
        yield
    finally:
        for server in flowcasts:
            with contextlib.suppress(AssertionError, ProcessLookupError):
                os.kill(server.pid, signal.SIGCONT)
        await asyncio.gather(*(server.stop(signal.SIGKILL) for server in flowcasts))


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0
) -> float:
    """Poll ``check`` until it holds; returns the monotonic time it first held."""
    await until(check, what, timeout)
    return time.monotonic()


async def read_stream(
    client: httpx.AsyncClient, execution_id: str, *, after: int = 0, cut_ok: bool = False
) -> tuple[list[Frame], float]:
    """Read a stream until the server closes it; returns its frames and when it closed.

    ``cut_ok``: the server may drop the connection mid-response (a process shutting
    down); the frames received until then are returned.
    """
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
    url = f"/api/executions/{execution_id}/stream"
    received: list[Frame] = []
    try:
        async with client.stream("GET", url, headers=headers) as response:
            assert response.status_code == 200
            async for frame in events(response):
                received.append(frame)
    except httpx.RemoteProtocolError:
        if not cut_ok:
            raise
    return received, time.monotonic()


def exited_on_sigterm(code: int) -> bool:
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    return code in (0, -signal.SIGTERM)


def assert_worker_lost(envelopes: list[dict[str, Any]]) -> None:
    check_log(envelopes)
    assert envelopes[-1]["type"] == "execution:failed", envelopes[-1]
    assert envelopes[-1]["data"]["error"]["code"] == "worker_lost"


async def meta(redis: Redis, execution_id: str) -> dict[str, str]:
    raw = await redis.hgetall(f"fc:{{{execution_id}}}:meta")
    return {key.decode(): value.decode() for key, value in raw.items()}


# -- a dead owner --------------------------------------------------------------------


def recovered_events(envelopes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in envelopes if e["type"] == "execution:recovered"]


def completions(envelopes: list[dict[str, Any]]) -> list[str]:
    return [e["data"]["blockId"] for e in envelopes if e["type"] == "block:completed"]


async def test_a_killed_owner_s_execution_is_recovered_by_another_process(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, unique: str
) -> None:
    a, b = servers(valkey, tmp_path)
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, delay_workflow(f"lost-{unique}", ms=1_500))
        execution_id = await execute(on_a, f"lost-{unique}", {})
        follower = asyncio.create_task(read_stream(on_b, execution_id))
        await eventually(
            lambda: has_stored(on_b, execution_id, "block:started"), "the delay block started"
        )
        owner_before = (await meta(redis, execution_id))["owner"]

        await a.stop(signal.SIGKILL)
        killed = time.monotonic()
        frames, closed = await asyncio.wait_for(follower, 20)
        print(f"\nrecovered and completed {closed - killed:.2f} s after SIGKILL")

        stored = await all_events(on_b, execution_id)
        check_log(stored)
        assert check_view(frames) == stored  # the client on B got everything, to the end
        assert stored[-1]["type"] == "execution:completed", stored[-1]
        assert stored[-1]["data"]["output"] == {"bye": 2}
        (recovered,) = recovered_events(stored)
        assert recovered["data"] == {
            "reason": "worker_lost",
            "recovery": 1,
            "rerun": ["think"],
            "completed": ["hello"],
        }
        # hello completed before the kill and is never run again; think runs again with
        # its next attempt, after the recovery.
        assert completions(stored) == ["hello", "think", "bye"]
        starts = [
            (e["data"]["blockId"], e["data"]["attempt"])
            for e in stored
            if e["type"] == "block:started"
        ]
        assert starts == [("hello", 1), ("think", 1), ("think", 2), ("bye", 1)], starts
        assert stored.index(recovered) < [e["type"] for e in stored].index("block:completed", 3)
        final = await meta(redis, execution_id)
        assert final["owner"] != owner_before and final["recoveries"] == "1"
        # The dead owner's lease entry was settled by the takeover.
        leases = await redis.zrange("fc:leases", 0, -1)
        assert not [m for m in leases if m.decode() == f"{execution_id} {owner_before}"]


async def test_with_recovery_turned_off_a_killed_owner_s_execution_ends_worker_lost(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    a, b = servers(valkey, tmp_path, FLOWCAST_MAX_RECOVERIES="0")
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, delay_workflow(f"lost-{unique}"))
        execution_id = await execute(on_a, f"lost-{unique}", {})
        follower = asyncio.create_task(read_stream(on_b, execution_id))
        await eventually(
            lambda: has_stored(on_b, execution_id, "block:started"), "the delay block started"
        )

        await a.stop(signal.SIGKILL)
        killed = time.monotonic()
        frames, closed = await asyncio.wait_for(follower, 15)
        detected = closed - killed
        print(f"\nworker_lost on a stream of the surviving process {detected:.2f} s after SIGKILL")
        # The lease is 1 s and the janitor looks twice a lease: a few lease periods at most.
        assert_below_timer(
            detected,
            bound=5 * LEASE_SECONDS,
            timer="the 1 s lease",
            what="worker_lost on the surviving process after SIGKILL",
        )

        stored = await all_events(on_b, execution_id)
        assert check_view(frames) == stored
        assert_worker_lost(stored)
        assert not recovered_events(stored)
        assert completions(stored) == ["hello"]
        snapshot = (await on_b.get(f"/api/executions/{execution_id}")).json()
        assert snapshot["status"] == "failed"
        assert snapshot["error"]["code"] == "worker_lost"
        # A client reconnecting after the events it saw gets the terminal one, then 204.
        again, _ = await read_stream(on_b, execution_id, after=stored[-2]["id"])
        assert check_view(again, after=stored[-2]["id"]) == stored[-1:]
        response = await on_b.get(
            f"/api/executions/{execution_id}/stream",
            headers={"Last-Event-ID": str(stored[-1]["id"])},
        )
        assert response.status_code == 204


async def test_a_stalled_owner_that_wakes_up_is_fenced_out(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, unique: str
) -> None:
    a, b = servers(valkey, tmp_path)
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, talking_workflow(f"stall-{unique}", words=100, tps=50))
        execution_id = await execute(on_a, f"stall-{unique}", {})
        follower = asyncio.create_task(read_stream(on_b, execution_id))

        async def chunks_stored() -> bool:
            return (await stored_types(on_b, execution_id)).count("block:chunk") >= 5

        await eventually(chunks_stored, "A streams chunks")
        owner_before = (await meta(redis, execution_id))["owner"]

        os.kill(a.pid, signal.SIGSTOP)
        stopped = time.monotonic()

        async def completed() -> bool:
            return (await meta(redis, execution_id))["status"] == "completed"

        ended = await eventually(completed, "B recovers the stalled execution", timeout=20)
        print(f"\ncompleted by B {ended - stopped:.2f} s after SIGSTOP")
        frames, _ = await asyncio.wait_for(follower, 10)
        stored = await all_events(on_b, execution_id)
        check_log(stored)
        assert [e["data"]["reason"] for e in recovered_events(stored)] == ["worker_lost"]
        assert check_view(frames) == stored
        owner_after = (await meta(redis, execution_id))["owner"]
        assert owner_after != owner_before

        os.kill(a.pid, signal.SIGCONT)
        # A wakes up mid-text: its next chunks are refused (fenced); it stops at its next
        # lease renewal, unless its text ran out first (the rest of it is refused too).
        await eventually(
            lambda: _logged(a, execution_id, "buffer refused the writer"),
            "A is fenced out",
        )
        # A stays healthy and keeps serving; the stored log did not move.
        assert (await on_a.get("/healthz")).status_code == 200
        assert await all_events(on_a, execution_id) == stored
        final = await meta(redis, execution_id)
        assert final["owner"] == owner_after
        assert int(final["lastId"]) == stored[-1]["id"]
        assert final["status"] == "completed"
        refusals = _log_lines(a, execution_id, "buffer refused the writer")
        print(f"writes A tried after waking up and had refused: {len(refusals)} batch(es)")
        assert all(line.get("reason") == "fenced" for line in refusals), refusals


async def test_a_client_attached_to_a_stalled_owner_gets_the_terminal_event(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, unique: str
) -> None:
    a, b = servers(valkey, tmp_path)
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, talking_workflow(f"stall-client-{unique}", words=100, tps=50))
        execution_id = await execute(on_a, f"stall-client-{unique}", {})
        on_owner = LiveReader(on_a, execution_id)

        async def chunks_stored() -> bool:
            return (await stored_types(on_b, execution_id)).count("block:chunk") >= 5

        await eventually(chunks_stored, "A streams chunks")
        os.kill(a.pid, signal.SIGSTOP)

        async def completed() -> bool:
            return (await meta(redis, execution_id))["status"] == "completed"

        await eventually(completed, "B recovers the stalled execution", timeout=20)
        os.kill(a.pid, signal.SIGCONT)
        await eventually(
            lambda: _logged(a, execution_id, "buffer refused the writer"), "A is fenced out"
        )
        stored = await all_events(on_b, execution_id)
        try:
            await eventually(lambda: on_owner.saw("execution:completed"), "the terminal on A", 5)
            assert check_view(on_owner.frames) == stored
        finally:
            await on_owner.aclose()


def _log_lines(server: FlowcastServer, execution_id: str, message: str) -> list[dict[str, Any]]:
    found = []
    for line in server.logs().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if record.get("executionId") == execution_id and message in str(record.get("message")):
            found.append(record)
    return found


async def _logged(server: FlowcastServer, execution_id: str, message: str) -> bool:
    return bool(_log_lines(server, execution_id, message))


# -- SIGTERM ---------------------------------------------------------------------------


async def test_sigterm_lets_the_running_block_finish_and_hands_the_rest_off(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    a, b = servers(valkey, tmp_path, FLOWCAST_SHUTDOWN_GRACE_SECONDS="2")
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, delay_workflow(f"short-{unique}", ms=1_000))
        execution_id = await execute(on_a, f"short-{unique}", {})
        follower = asyncio.create_task(read_stream(on_b, execution_id))
        await eventually(
            lambda: has_stored(on_a, execution_id, "block:started"), "the delay block started"
        )
        terminated = time.monotonic()
        assert exited_on_sigterm(await a.stop(signal.SIGTERM))
        print(f"\nshutdown took {time.monotonic() - terminated:.2f} s")

        frames, _ = await asyncio.wait_for(follower, 10)
        stored = await all_events(on_b, execution_id)
        check_log(stored)
        assert stored[-1]["type"] == "execution:completed"
        assert stored[-1]["data"]["output"] == {"bye": 2}
        assert check_view(frames) == stored
        # think, running at the signal, finished on A within the grace; no new block
        # started there: bye ran on B, after the hand-off.
        (recovered,) = recovered_events(stored)
        assert recovered["data"]["reason"] == "handoff"
        assert recovered["data"]["rerun"] == []
        assert recovered["data"]["completed"] == ["hello", "think"]
        assert completions(stored) == ["hello", "think", "bye"]


async def test_sigterm_hands_an_execution_longer_than_the_grace_off_to_another_process(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, unique: str
) -> None:
    grace = 2.0
    a, b = servers(valkey, tmp_path, FLOWCAST_SHUTDOWN_GRACE_SECONDS=str(grace))
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, delay_workflow(f"long-{unique}", ms=4_000))
        execution_id = await execute(on_a, f"long-{unique}", {})
        on_owner = asyncio.create_task(read_stream(on_a, execution_id, cut_ok=True))
        on_other = LiveReader(on_b, execution_id)
        await eventually(
            lambda: has_stored(on_a, execution_id, "block:started"), "the delay block started"
        )
        owner_before = (await meta(redis, execution_id))["owner"]
        terminated = time.monotonic()
        stopping = asyncio.create_task(a.stop(signal.SIGTERM))
        handed = await eventually(
            lambda: on_other.saw("execution:recovered"), "B recovers the hand-off", 15
        )
        print(f"\nexecution:recovered on B {handed - terminated:.2f} s after SIGTERM")
        # The block still running at the end of the grace is cancelled and runs again on
        # B, within about a second of the grace.
        assert grace <= handed - terminated < grace + 2.0
        assert exited_on_sigterm(await asyncio.wait_for(stopping, 20))

        await eventually(lambda: on_other.saw("execution:completed"), "completed on B", 15)
        await on_other.aclose()
        stored = await all_events(on_b, execution_id)
        check_log(stored)
        assert check_view(on_other.frames) == stored
        assert stored[-1]["type"] == "execution:completed"
        (recovered,) = recovered_events(stored)
        assert recovered["data"] == {
            "reason": "handoff",
            "recovery": 1,
            "rerun": ["think"],
            "completed": ["hello"],
        }
        assert completions(stored) == ["hello", "think", "bye"]
        owner_frames, _ = await on_owner
        assert check_view(owner_frames) == stored[: len(owner_frames)]
        final = await meta(redis, execution_id)
        assert final["status"] == "completed" and final["owner"] != owner_before
        # Handed off, not crashed: it does not count towards FLOWCAST_MAX_RECOVERIES.
        assert final.get("crashes", "0") == "0"

        # No lease entry outlives the run for long. A renewal racing the run's last
        # release may write its entry back (renew re-lists an entry the store lost, on
        # purpose); the janitor drops such a stale entry within about a lease.
        async def no_lease_left() -> bool:
            leases = await redis.zrange("fc:leases", 0, -1)
            return not [m for m in leases if m.decode().startswith(f"{execution_id} ")]

        await until(no_lease_left, "the run's lease entries gone", timeout=5 * LEASE_SECONDS)


class LiveReader:
    """An SSE client whose frames can be looked at while it reads."""

    def __init__(self, client: httpx.AsyncClient, execution_id: str) -> None:
        self.frames: list[Frame] = []
        self.task = asyncio.create_task(self._read(client, execution_id))

    async def _read(self, client: httpx.AsyncClient, execution_id: str) -> None:
        url = f"/api/executions/{execution_id}/stream"
        with contextlib.suppress(httpx.TransportError):  # cut by a shutdown or a kill
            async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as r:
                async for frame in events(r):
                    self.frames.append(frame)

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def saw(self, event_type: str) -> bool:
        return any(frame.event == event_type for frame in self.frames)


async def test_sigterm_after_the_grace_still_stores_a_terminal_event_already_emitted(
    tmp_path: Path, unique: str
) -> None:
    # The execution completes while the buffer stalls: its terminal event is emitted
    # but not yet stored when the grace ends (a terminal event is shown live only once
    # stored). Ending it then must not abandon that write: the terminal is stored once
    # the buffer answers again, and what the client saw is the stored log's start.
    """The stall must begin while think runs, and the test notices think's start by
    polling B: think lasts ten times the slowest of five GETs on B here and now, plus
    0.3 s. A fixed 300 ms was too short beside a busy loop (step 15's runs, issue 23
    point 6): think ended and was stored before the SIGSTOP, 1 run in 10."""
    stalled = ValkeyServer(data_dir=tmp_path / "valkey")
    await stalled.start()
    grace = 1.0
    a, b = servers(stalled, tmp_path, FLOWCAST_SHUTDOWN_GRACE_SECONDS=str(grace))
    # A long lease: nobody may take the execution over while the buffer stalls.
    for server in (a, b):
        server.env["FLOWCAST_LEASE_SECONDS"] = "30"
    try:
        async with (
            running(a, b),
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            # From think's start to the SIGSTOP: the stream's first frame, a poll's pause
            # and one or two of its GETs on B, each about as slow as the probe.
            poll = max(await latencies(on_b, "/api/workflows", 5))
            think_ms = round(1000 * (10 * poll + 0.3))
            await put(on_a, delay_workflow(f"stall-end-{unique}", ms=think_ms))
            execution_id = await execute(on_a, f"stall-end-{unique}", {})
            live = LiveReader(on_a, execution_id)
            # The client's stream is open before the stall: a stream still opening then
            # waits on the stalled buffer, and uvicorn waits for its connection before
            # the runner may drain (no "draining executions": 1 run in 15 beside a
            # busy loop).
            await eventually(lambda: live.saw("execution:started"), "the client attached")
            await eventually(lambda: has_stored(on_b, execution_id, "block:started"), "started")

            os.kill(stalled.pid, signal.SIGSTOP)
            # think's completion, bye's three events and the terminal wait in memory.
            await eventually(lambda: _pending(on_a, 4), "the run completed, unstored")
            stopping = asyncio.create_task(a.stop(signal.SIGTERM))
            await eventually(lambda: _logged_any(a, "draining executions"), "A drains on SIGTERM")
            # Not a readiness wait: the grace period has to pass with the buffer stalled.
            await asyncio.sleep(grace + 0.5)
            os.kill(stalled.pid, signal.SIGCONT)
            assert exited_on_sigterm(await asyncio.wait_for(stopping, 20))
            await live.aclose()

            async def finished() -> bool:
                snapshot = (await on_b.get(f"/api/executions/{execution_id}")).json()
                return bool(snapshot["status"] != "running")

            await eventually(finished, "the execution is finished in the buffer")
            stored = await all_events(on_b, execution_id)
            check_log(stored)
            assert stored[-1]["type"] == "execution:completed"
            seen = check_view(live.frames)
            assert seen == stored[: len(seen)]
    finally:
        with contextlib.suppress(AssertionError, ProcessLookupError):
            os.kill(stalled.pid, signal.SIGCONT)
        await stalled.stop()


async def _pending(client: httpx.AsyncClient, count: int) -> bool:
    metrics = (await client.get("/metrics")).text
    line = next(x for x in metrics.splitlines() if x.startswith("flowcast_pending_events "))
    return float(line.split()[1]) >= count


async def _logged_any(server: FlowcastServer, message: str) -> bool:
    return message in server.logs()
