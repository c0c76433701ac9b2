"""A run is found by the filtered lists of the status it ended with, however its end
came about: a cancel sent at the instant it completes, on the replica that runs it or on
another (lib/execution/indexes.py; SPEC §3).

Real processes: two replicas on one Valkey; runs of a short ``delay`` cancelled through
either replica at offsets around the delay's end, so that some cancels win and some
arrive after the completion.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import delay_workflow, execute, put, wait_finished
from tests.support.servers import ValkeyServer, serving_pair

pytestmark = pytest.mark.timeout(180)

RUNS = 24
STATUSES = ("running", "paused", "completed", "failed", "cancelled")


async def listed(client: httpx.AsyncClient, **filters: str) -> set[str]:
    query = "&".join(f"{name}={value}" for name, value in filters.items())
    response = await client.get(f"/api/executions?limit=200&{query}")
    assert response.status_code == 200, response.text
    return {row["id"] for row in response.json()["executions"]}


async def raced(started: httpx.AsyncClient, canceller: httpx.AsyncClient, offset: float) -> str:
    """A 200 ms delay run started via one replica, cancelled via ``canceller`` ``offset``
    seconds after its start was answered."""
    run = await execute(started, "short")
    await asyncio.sleep(offset)  # the race's offset, not a readiness wait
    answer = await canceller.post(f"/api/executions/{run}/cancel")
    assert answer.status_code in (202, 409), answer.text
    return run


async def test_a_cancel_racing_completion_leaves_each_run_in_its_final_buckets(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """24 runs cancelled 0.15-0.35 s into a 0.2 s delay, via either replica: each run is
    listed under its final status (alone and with its workflow), under no other status,
    and in its workflow's list."""
    async with serving_pair(valkey, tmp_path) as (a, b):
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as via_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as via_b,
        ):
            await put(via_a, delay_workflow("short", ms=200))
            runs = await asyncio.gather(
                *(
                    raced(via_a, (via_a, via_b)[index % 2], 0.15 + 0.2 * index / RUNS)
                    for index in range(RUNS)
                )
            )
            final: dict[str, Any] = {
                run: (await wait_finished(via_a, run))["status"] for run in runs
            }
            problems = []
            for status in STATUSES:
                for client in (via_a, via_b):
                    alone = await listed(client, status=status)
                    together = await listed(client, status=status, workflowId="short")
                    for run, ended in final.items():
                        wanted = ended == status
                        if (run in alone) != wanted or (run in together) != wanted:
                            problems.append((run, ended, status, run in alone, run in together))
            every = await listed(via_b, workflowId="short")
    assert not problems, problems
    assert every == set(runs)
    assert {"completed", "cancelled"} <= set(final.values()), final
