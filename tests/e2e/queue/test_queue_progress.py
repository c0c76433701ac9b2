"""A queued execution moves as soon as its tenant may run one more, wherever the slot
freed (SPEC §14 "Nothing stuck": "it runs as soon as any worker has a slot").

A run that ends wakes the dispatcher of its own process only. When that process takes
no work (``FLOWCAST_WORKER_SLOTS=0``: a resume still runs where it was asked, SPEC §14
is not built for resumes yet), the workers must still find the tenant's backlog.

Found by the step 17 fresh-eyes review.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.support.api import put, wait_finished, wait_status
from tests.support.faults import LEASE_SECONDS, replica
from tests.support.servers import ValkeyServer

pytestmark = pytest.mark.timeout(90)

APPROVE_THEN_WAIT = {
    "id": "approve-then-wait",
    "blocks": [
        {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": {}}},
        {"id": "think", "type": "delay", "config": {"ms": 1500}},
    ],
    "edges": [{"from": "review", "to": "think"}],
}
QUICK = {"id": "quick", "blocks": [{"id": "only", "type": "transform", "config": {}}]}


async def test_a_backlog_held_by_a_run_on_an_api_replica_moves_when_it_ends(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    caps = {"FLOWCAST_MAX_RUNNING_PER_TENANT": "1"}
    api = replica(own_valkey, tmp_path, "api", FLOWCAST_WORKER_SLOTS="0", **caps)
    worker = replica(own_valkey, tmp_path, "worker", **caps)
    await asyncio.gather(api.start(), worker.start())
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
            await put(client, APPROVE_THEN_WAIT)
            await put(client, {**QUICK, "edges": []})
            answer = await client.post("/api/workflows/approve-then-wait/execute", json={})
            paused = answer.json()["executionId"]
            await wait_status(client, paused, "paused")
            resumed = await client.post(f"/api/executions/{paused}/resume", json={"input": 1})
            assert resumed.status_code == 202, resumed.text
            await wait_status(client, paused, "running")
            # The tenant runs one (the resumed run, here on the API replica): queued.
            queued = await client.post("/api/workflows/quick/execute", json={"input": {}})
            assert queued.json()["status"] == "queued", queued.text
            queued_id = queued.json()["executionId"]
            await wait_finished(client, paused)
            ended = time.monotonic()
            await wait_finished(client, queued_id, timeout=10 * LEASE_SECONDS)
            waited = time.monotonic() - ended
            # Within about a lease of the slot freeing (the workers look every half lease).
            assert waited < 2 * LEASE_SECONDS, waited
    finally:
        await asyncio.gather(api.stop(), worker.stop())
