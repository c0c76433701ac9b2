"""Races between the queue's steps on real processes (SPEC §14 "Nothing stuck, nothing
lost"; SPEC §3 "A 202 means it happens").

An ``execute`` queues the execution (queue.lua ``enter``) in one write and creates its
record (start.lua) in the next: a worker may take it in between. Such a delivery must
not be dropped for good, or the execution stays ``queued`` with no queue holding it.

Found by the step 17 fresh-eyes review.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from lib.execution.indexes import created_ms
from tests.support.api import delay_workflow, put, quick_workflow, until, wait_finished, wait_status
from tests.support.faults import LEASE_SECONDS, kill_replica, replica
from tests.support.logcheck import check_log
from tests.support.queue import most_at_once, run_log
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.tap import Tap

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def api_and_worker(
    own_valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[Tap, httpx.AsyncClient, FlowcastServer]]:
    """An API replica without worker slots, through a tap; a worker beside it."""
    async with Tap(own_valkey.port) as tap:
        api = replica(own_valkey, tmp_path, "api", FLOWCAST_REDIS_URL=tap.url)
        api.env["FLOWCAST_WORKER_SLOTS"] = "0"
        worker = replica(own_valkey, tmp_path, "worker")
        await asyncio.gather(api.start(), worker.start())
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
                await put(client, quick_workflow("quick"))
                yield tap, client, worker
        finally:
            await asyncio.gather(api.stop(), worker.stop())


async def test_a_queued_execution_taken_before_its_record_exists_still_runs(
    api_and_worker: tuple[Tap, httpx.AsyncClient, FlowcastServer], own_valkey: ValkeyServer
) -> None:
    tap, client, worker = api_and_worker
    redis = Redis.from_url(own_valkey.url)
    try:
        release = asyncio.Event()
        # start.lua writes the metadata and the run state together: held, after the
        # batch that queued the execution.
        tap.hold(lambda data: b"}:meta" in data and b"}:state" in data, release=release)
        answer = asyncio.create_task(
            client.post("/api/workflows/quick/execute", json={"input": {"n": 1}})
        )
        await asyncio.wait_for(tap.held.wait(), 20)

        # Another start, on the worker, queues behind it and wakes the worker, which
        # takes the oldest in line: the one whose record is not written yet.
        async with httpx.AsyncClient(base_url=worker.url, timeout=60) as on_worker:
            other = await on_worker.post("/api/workflows/quick/execute", json={"input": {}})
            assert other.status_code == 202, other.text
            assert (await wait_finished(on_worker, other.json()["executionId"]))[
                "status"
            ] == "completed"

        async def taken() -> bool:
            return not await redis.keys("*{queue}:queued:*") and not await redis.keys(
                "*{queue}:tenants"
            )

        await until(taken, "the worker took the execution before it existed", 20)
        release.set()
        accepted = await answer
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["status"] == "queued"
        execution_id = accepted.json()["executionId"]
        # Given back within a few leases (a taker that never claimed it), then run.
        ended = await wait_finished(client, execution_id, timeout=10 * LEASE_SECONDS)
        assert ended["status"] == "completed", ended
        events = (await client.get(f"/api/executions/{execution_id}/events")).json()["events"]
        check_log(events)
        assert [e["type"] for e in events].count("execution:started") == 1
    finally:
        await redis.aclose()


async def test_a_start_taken_before_its_record_exists_starts_once_its_record_is_announced(
    api_and_worker: tuple[Tap, httpx.AsyncClient, FlowcastServer], own_valkey: ValkeyServer
) -> None:
    """Issue 25: a worker that took a start whose record was still to be written reads
    it again as soon as the start's own announcement comes (sent once the record is
    written), not at its backoff's next turn (up to 100 ms by then). Measured by the
    servers' clock (the start's ``queuedMs`` from its creation), beside ordinary queued
    starts measured in the same test."""
    tap, client, _worker = api_and_worker
    keys = Keys("fc")
    redis = Redis.from_url(own_valkey.url)

    async def created_and_waited(execution_id: str) -> tuple[int, int]:
        """When the execution was created (ms since the epoch, the servers' clock), and
        how long it waited in line then (ms)."""
        ended = await wait_finished(client, execution_id, timeout=10 * LEASE_SECONDS)
        assert ended["status"] == "completed", ended
        events = (await client.get(f"/api/executions/{execution_id}/events")).json()["events"]
        check_log(events)
        first = next(e for e in events if e["type"] == "execution:started")
        return created_ms(ended["createdAt"]), int(first["data"]["queuedMs"])

    try:
        probes = []
        for _ in range(3):
            answer = await client.post("/api/workflows/quick/execute", json={"input": {}})
            assert answer.json()["status"] == "queued", answer.text
            execution_id = answer.json()["executionId"]
            probes.append((await created_and_waited(execution_id))[1])
        lags = []
        for _ in range(5):
            release = asyncio.Event()
            tap.hold(lambda data: b"}:meta" in data and b"}:state" in data, release=release)
            answer_task = asyncio.create_task(
                client.post("/api/workflows/quick/execute", json={"input": {}})
            )
            await asyncio.wait_for(tap.held.wait(), 20)
            # Queued, its record held back: work announced (as another process would)
            # has the worker take it and wait for its record.
            await redis.xadd(keys.queue_wake, {"queued": "1"})

            async def taken() -> bool:
                return bool(await redis.zcard(keys.taken))

            await until(taken, "the worker took the execution before it existed", 20)
            # A slow write, well within RECORD_WAIT_SECONDS: the worker's backoff grew.
            await asyncio.sleep(0.3)
            released = round(time.time() * 1000)
            release.set()
            accepted = await answer_task
            assert accepted.status_code == 202, accepted.text
            created, waited = await created_and_waited(accepted.json()["executionId"])
            lags.append(created + waited - released)
        # Read at the backoff's next turn, a start lags behind the release by up to
        # 100 ms (about 40 ms more than an ordinary start on average, by when the
        # release falls between two reads); read on the announcement, by about as long
        # as an ordinary queued start waits.
        assert sum(lags) / len(lags) < max(probes) + 20, (lags, probes)
    finally:
        await redis.aclose()


async def test_a_worker_killed_between_take_and_claim_gives_the_execution_back(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """SPEC §14: "A worker that dies after taking an execution gives it back within about
    FLOWCAST_LEASE_SECONDS" -- also when nothing else is due anywhere (no lease expires,
    no deadline passes) to set the other processes' janitors going."""
    api = replica(own_valkey, tmp_path, "api", FLOWCAST_WORKER_SLOTS="0")
    async with Tap(own_valkey.port) as tap:
        taker = replica(own_valkey, tmp_path, "taker", FLOWCAST_REDIS_URL=tap.url)
        other = replica(own_valkey, tmp_path, "other")
        await asyncio.gather(api.start(), taker.start())
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
                await put(client, quick_workflow("quick"))
                # The taker's claim (claim.lua "take") never reaches Redis: it dies there.
                tap.hold(lambda data: b"}:meta" in data and b"\r\ntake\r\n" in data)
                accepted = await client.post("/api/workflows/quick/execute", json={"input": {}})
                assert accepted.status_code == 202, accepted.text
                assert accepted.json()["status"] == "queued"
                execution_id = accepted.json()["executionId"]
                await asyncio.wait_for(tap.held.wait(), 20)
                await kill_replica(taker)
                killed = time.monotonic()
                await other.start()
                ended = await wait_finished(client, execution_id, timeout=20 * LEASE_SECONDS)
                given_back = time.monotonic() - killed
                assert ended["status"] == "completed", ended
                events = (await client.get(f"/api/executions/{execution_id}/events")).json()
                check_log(events["events"])
                # Within a few leases of the death (the taker's delivery lasts two).
                assert given_back < 5 * LEASE_SECONDS, given_back
        finally:
            await asyncio.gather(api.stop(), other.stop(), taker.stop())


async def test_a_worker_killed_between_its_claim_and_its_first_write_leaves_a_whole_log(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """SPEC §4 "Ids": id 1 is ``execution:started``, no gaps. A worker that claimed a
    queued start (claim.lua "take") and died before its first batch (which stores
    ``execution:started``) was stored: its claim had reserved id 1 for it, as start.lua
    does for a start shown live, so the next owner numbered above it and the log began
    at id 2 ``execution:recovered`` with id 1 recorded as dropped (a ``replay:gap`` for
    every client). A take now reserves nothing: the next owner starts the log itself.

    Found by the queue storm (stress/queue_storm.py, ``--long``: 1 of 61 kills)."""
    api = replica(own_valkey, tmp_path, "api", FLOWCAST_WORKER_SLOTS="0")
    async with Tap(own_valkey.port) as tap:
        taker = replica(own_valkey, tmp_path, "taker", FLOWCAST_REDIS_URL=tap.url)
        other = replica(own_valkey, tmp_path, "other")
        await api.start()
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
                await put(client, quick_workflow("quick"))
                accepted = await client.post("/api/workflows/quick/execute", json={"input": {}})
                assert accepted.status_code == 202, accepted.text
                assert accepted.json()["status"] == "queued"
                execution_id = accepted.json()["executionId"]
                # The taker claims it, then its first batch never reaches Redis: it dies.
                tap.hold(lambda data: b"}:events" in data and b"execution:started" in data)
                await taker.start()
                await asyncio.wait_for(tap.held.wait(), 20)
                await wait_status(client, execution_id, "running")
                await kill_replica(taker)
                await other.start()
                ended = await wait_finished(client, execution_id, timeout=20 * LEASE_SECONDS)
                assert ended["status"] == "completed", ended
                events = (await client.get(f"/api/executions/{execution_id}/events")).json()
                check_log(events["events"])
                kinds = [e["type"] for e in events["events"]]
                assert kinds[:2] == ["execution:started", "execution:recovered"], kinds
                async with client.stream(
                    "GET",
                    f"/api/executions/{execution_id}/stream",
                    headers={"Accept": "text/event-stream"},
                ) as stream:
                    text = (await stream.aread()).decode()
                assert "replay:gap" not in text, text
        finally:
            await asyncio.gather(api.stop(), other.stop(), taker.stop())


async def test_a_keyed_repeat_racing_its_first_request_leaves_the_execution_in_line(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Two requests with one Idempotency-Key both queue the one execution id they name;
    the one that finds it created by the other must not take it out of line (SPEC §3
    "Idempotency": "even when the repeats arrive concurrently")."""
    key = {"Idempotency-Key": "order-17"}
    body = {"input": {"n": 17}}
    async with Tap(own_valkey.port) as tap:
        a = replica(
            own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url, FLOWCAST_WORKER_SLOTS="0"
        )
        b = replica(own_valkey, tmp_path, "b", FLOWCAST_WORKER_SLOTS="0")
        worker = replica(own_valkey, tmp_path, "worker")
        await asyncio.gather(a.start(), b.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
            ):
                await put(on_b, quick_workflow("quick"))
                release = asyncio.Event()
                # A's start.lua is held after A queued the id; B's repeat creates it.
                tap.hold(lambda data: b"}:meta" in data and b"}:state" in data, release=release)
                url = "/api/workflows/quick/execute"
                first = asyncio.create_task(on_a.post(url, json=body, headers=key))
                await asyncio.wait_for(tap.held.wait(), 20)
                repeat = await on_b.post(url, json=body, headers=key)
                assert repeat.status_code == 202, repeat.text
                execution_id = repeat.json()["executionId"]
                release.set()
                answered = await first
                assert answered.status_code == 202, answered.text
                assert answered.json()["executionId"] == execution_id
                assert "execution created by another request" in a.logs()
                # A worker comes: the execution is still in line, and runs once.
                await worker.start()
                ended = await wait_finished(on_b, execution_id, timeout=10 * LEASE_SECONDS)
                assert ended["status"] == "completed", ended
                events = (await on_b.get(f"/api/executions/{execution_id}/events")).json()
                check_log(events["events"])
        finally:
            await asyncio.gather(a.stop(), b.stop(), worker.stop())


async def test_a_slow_taker_whose_delivery_was_queued_again_still_counts_for_its_tenant(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A taker slower than a lease between its take and its claim is presumed dead: its
    delivery is queued again and its admission taken back. If its claim then wins, the
    run must count for its tenant all the same, or the tenant runs past its cap (SPEC
    §14: "never more than FLOWCAST_MAX_RUNNING_PER_TENANT at once")."""
    caps = {"FLOWCAST_MAX_RUNNING_PER_TENANT": "1"}
    api = replica(own_valkey, tmp_path, "api", FLOWCAST_WORKER_SLOTS="0", **caps)
    async with Tap(own_valkey.port) as tap:
        taker = replica(own_valkey, tmp_path, "taker", FLOWCAST_REDIS_URL=tap.url, **caps)
        await asyncio.gather(api.start(), taker.start())
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
                await put(client, delay_workflow("slow", ms=2500))
                release = asyncio.Event()
                tap.hold(
                    lambda data: b"}:meta" in data and b"\r\ntake\r\n" in data, release=release
                )
                first = await client.post("/api/workflows/slow/execute", json={"input": {}})
                assert first.json()["status"] == "queued", first.text
                await asyncio.wait_for(tap.held.wait(), 20)

                # The API replica's round finds the delivery a lease old: queued again.
                def queued_again() -> bool:
                    return "taken by a dead worker; queued again" in api.logs()

                await until(queued_again, "the slow taker's delivery queued again", 20)
                release.set()  # the slow taker's claim wins after all
                first_id = first.json()["executionId"]
                await wait_status(client, first_id, "running")
                second = await client.post("/api/workflows/slow/execute", json={"input": {}})
                second_id = second.json()["executionId"]
                logs = [await run_log(client, eid) for eid in (first_id, second_id)]
                assert most_at_once(logs) == 1, [(log[0]["ts"], log[-1]["ts"]) for log in logs]
        finally:
            await asyncio.gather(api.stop(), taker.stop())
