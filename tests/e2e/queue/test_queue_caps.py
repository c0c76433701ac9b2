"""What runs at once under the queue's caps, measured on real processes from each run's
stored events (SPEC §14: "never more than FLOWCAST_MAX_RUNNING_PER_TENANT at once";
"A worker takes executions while it has free slots (FLOWCAST_WORKER_SLOTS)").

Found by the step 17 fresh-eyes review.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import delay_workflow, put, wait_finished
from tests.support.logcheck import check_log
from tests.support.servers import ValkeyServer, authed, serving, serving_pair

pytestmark = pytest.mark.timeout(120)

DELAY_MS = 300


async def run_log(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    await wait_finished(client, execution_id)
    events: list[dict[str, Any]] = (
        await client.get(f"/api/executions/{execution_id}/events")
    ).json()["events"]
    check_log(events)
    assert events[-1]["type"] == "execution:completed", events[-1]
    return events


def most_at_once(logs: list[list[dict[str, Any]]]) -> int:
    """The most runs between their first and last stored event at one instant."""
    edges: list[tuple[datetime, int]] = []
    for events in logs:
        edges.append((datetime.fromisoformat(events[0]["ts"]), 1))
        edges.append((datetime.fromisoformat(events[-1]["ts"]), -1))
    edges.sort(key=lambda edge: (edge[0], edge[1]))  # an end before a start at one instant
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


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
