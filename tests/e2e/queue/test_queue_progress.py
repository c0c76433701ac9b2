"""A queued execution moves as soon as its tenant may run one more, wherever the slot
freed (SPEC §14 "Nothing stuck": "it runs as soon as any worker has a slot").

A run that ends wakes the dispatcher of its own process only. When that process takes
nothing (it drains after a SIGTERM, or has no worker slots), the others must be told,
or the tenant's backlog waits for their next round (every half lease).

Found by the step 17 fresh-eyes review (before the rounds existed, it waited until some
unrelated lease or deadline fell due: forever on a quiet system).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.support.api import put, quick_workflow
from tests.support.faults import replica, terminate_replica
from tests.support.queue import run_log
from tests.support.servers import ValkeyServer

pytestmark = pytest.mark.timeout(90)

ONE_SECOND = {"id": "think", "type": "delay", "config": {"ms": 1000}}
# A long lease: the others' rounds (every half lease) are far apart.
LEASE = 6.0


async def test_a_backlog_moves_at_once_when_a_draining_worker_frees_its_tenant(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    settings = {
        "FLOWCAST_MAX_RUNNING_PER_TENANT": "1",
        "FLOWCAST_LEASE_SECONDS": str(LEASE),
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "20",
    }
    draining = replica(own_valkey, tmp_path, "draining", **settings)
    other = replica(own_valkey, tmp_path, "other", **settings)
    await asyncio.gather(draining.start(), other.start())
    try:
        async with httpx.AsyncClient(base_url=draining.url, timeout=30) as client:
            # One block: it ends the run during the drain (nothing left to hand off).
            await put(client, {"id": "slow", "blocks": [ONE_SECOND], "edges": []})
            await put(client, quick_workflow("quick"))
            first = await client.post("/api/workflows/slow/execute", json={"input": {}})
            assert first.json()["status"] == "running", first.text
            second = await client.post("/api/workflows/quick/execute", json={"input": {}})
            assert second.json()["status"] == "queued", second.text
        # The first run ends within the grace, on a process that takes nothing more.
        stopping = asyncio.create_task(terminate_replica(draining))
        async with httpx.AsyncClient(base_url=other.url, timeout=30) as client:
            ended = await run_log(client, first.json()["executionId"])
            began = await run_log(client, second.json()["executionId"])
        await stopping
        waited = (
            datetime.fromisoformat(began[0]["ts"]) - datetime.fromisoformat(ended[-1]["ts"])
        ).total_seconds()
        assert waited < LEASE / 6, waited  # told at once, not at the next round
    finally:
        await asyncio.gather(draining.stop(), other.stop())
