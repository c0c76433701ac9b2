"""An ``Idempotency-Key`` repeat of an execute that queued (SPEC §3 "Idempotency":
"returns the original outcome"; SPEC §14 "Accepting": 202 with ``status`` ``queued``).

A repeat that finds the execution created before the first request stored its answer
(the first is slow, or died) must answer what that execution is, ``queued`` with its
place, not ``running``: a client told ``running`` waits for a run that has not begun,
and the answer it stores is what every later repeat replays.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import put, quick_workflow, wait_finished
from tests.support.faults import LEASE_SECONDS, replica
from tests.support.servers import ValkeyServer
from tests.support.tap import Tap

pytestmark = pytest.mark.timeout(90)


async def test_a_keyed_repeat_of_a_queued_execute_answers_queued(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    key = {"Idempotency-Key": "order-24"}
    body = {"input": {"n": 24}}
    url = "/api/workflows/quick/execute"
    async with Tap(own_valkey.port) as tap:
        # Two API replicas without worker slots: every execute queues.
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
                # A created and queued the execution; its answer to the key is held.
                tap.hold(lambda data: b":idem:" in data and b'"status"' in data, release=release)
                first = asyncio.create_task(on_a.post(url, json=body, headers=key))
                await asyncio.wait_for(tap.held.wait(), 20)
                repeat = await on_b.post(url, json=body, headers=key)
                release.set()
                answered = await first
                assert answered.status_code == 202, answered.text
                assert answered.json()["status"] == "queued", answered.json()
                execution_id = answered.json()["executionId"]
                snapshot = (await on_b.get(f"/api/executions/{execution_id}")).json()
                assert snapshot["status"] == "queued", snapshot
                assert repeat.status_code == 202, repeat.text
                assert repeat.json()["executionId"] == execution_id
                assert repeat.json()["status"] == "queued", repeat.json()
                assert repeat.json()["ahead"] == 0, repeat.json()
                # A later repeat replays the first's outcome, and it runs once.
                again = await on_b.post(url, json=body, headers=key)
                assert again.json()["status"] == "queued", again.json()
                await worker.start()
                ended = await wait_finished(on_b, execution_id, timeout=10 * LEASE_SECONDS)
                assert ended["status"] == "completed", ended
                listed = (await on_b.get("/api/executions?workflowId=quick")).json()
                assert [row["id"] for row in listed["executions"]] == [execution_id]
        finally:
            await asyncio.gather(a.stop(), b.stop(), worker.stop())
