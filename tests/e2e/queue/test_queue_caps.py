"""What runs at once under the queue's caps, measured on real processes from each run's
stored events (SPEC §14: "never more than FLOWCAST_MAX_RUNNING_PER_TENANT at once";
"A worker takes executions while it has free slots (FLOWCAST_WORKER_SLOTS)").

Found by the step 17 fresh-eyes review.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import delay_workflow, put, wait_status
from tests.support.faults import fresh_replica, replica, terminate_replica
from tests.support.queue import most_at_once, run_log
from tests.support.servers import ValkeyServer, authed, serving, serving_pair

pytestmark = pytest.mark.timeout(120)

DELAY_MS = 300


async def fire(clients: list[httpx.AsyncClient], count: int) -> list[tuple[httpx.AsyncClient, str]]:
    """``count`` executes of "slow" at the same instant, spread over ``clients``."""

    async def one(client: httpx.AsyncClient) -> tuple[httpx.AsyncClient, str]:
        answer = await client.post("/api/workflows/slow/execute", json={"input": {}})
        assert answer.status_code == 202, answer.text
        return client, answer.json()["executionId"]

    return await asyncio.gather(*(one(clients[n % len(clients)]) for n in range(count)))


async def test_executes_at_the_same_instant_on_two_replicas_run_one_at_a_time(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving_pair(valkey, tmp_path, max_running_per_tenant="1") as (a, b):
        async with authed(a) as on_a, authed(b) as on_b:
            await put(on_a, delay_workflow("slow", ms=DELAY_MS))
            started = await fire([on_a, on_b], 12)
            logs = await asyncio.gather(*(run_log(client, eid) for client, eid in started))
            assert most_at_once(logs) == 1


async def test_a_burst_at_one_replica_runs_no_more_than_its_worker_slots(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, worker_slots="2", max_running_per_tenant="0") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=DELAY_MS))
            started = await fire([client], 12)
            logs = await asyncio.gather(*(run_log(c, eid) for c, eid in started))
            assert most_at_once(logs) <= 2


async def test_a_run_handed_off_at_a_restart_still_counts_for_its_tenant(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A lone replica stopped (SIGTERM) hands its run off; started again, it takes the
    run over and the tenant's queued execution waits for it: the hand-off must not free
    the tenant's running slot before the run's takeover fills it again."""
    server = replica(own_valkey, tmp_path, "a", FLOWCAST_MAX_RUNNING_PER_TENANT="1")
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, delay_workflow("slow", ms=2500))
            first = await client.post("/api/workflows/slow/execute", json={"input": {}})
            second = await client.post("/api/workflows/slow/execute", json={"input": {}})
            assert [first.json()["status"], second.json()["status"]] == ["running", "queued"]
            ids = [first.json()["executionId"], second.json()["executionId"]]
            await wait_status(client, ids[0], "running")
        await terminate_replica(server)  # the delay outlasts the grace: handed off
        server = await fresh_replica(server)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            logs = [await run_log(client, eid) for eid in ids]
            assert "execution:recovered" in [event["type"] for event in logs[0]]
            assert most_at_once(logs) == 1, [(log[0]["ts"], log[-1]["ts"]) for log in logs]
    finally:
        await server.stop()
