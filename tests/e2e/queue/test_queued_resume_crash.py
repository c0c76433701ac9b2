"""A resume that waits in line (claim.lua "resume" to "queue") whose only worker is
SIGKILLed as it takes it, or after it claimed it and before its execution:resumed was
stored: a new worker runs the resume once (SPEC §14 "Nothing stuck, nothing lost"; SPEC
§3 "A 202 means it happens"): one execution:resumed, the answered block's successor run
once, completed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.api import approval_workflow, paused_execution, put, wait_finished
from tests.support.faults import LEASE_SECONDS, kill_replica, replica
from tests.support.logcheck import check_log
from tests.support.servers import ValkeyServer
from tests.support.tap import Tap

pytestmark = pytest.mark.timeout(90)

Moment = Callable[[str], Callable[[bytes], bool]]
MOMENTS: dict[str, Moment] = {
    # Its take's claim (queue.lua gave it the delivery; claim.lua "take" is held).
    "take": lambda eid: lambda data: eid.encode() in data and b"take" in data,
    # Claimed: its execution:resumed on the way to the store is held.
    "resumed": lambda eid: lambda data: b"execution:resumed" in data,
}


@pytest.mark.parametrize("moment", ["take", "resumed"])
async def test_a_resume_in_line_whose_worker_dies_runs_once_on_a_new_worker(
    own_valkey: ValkeyServer, tmp_path: Path, moment: str
) -> None:
    async with Tap(own_valkey.port) as tap:
        api = replica(own_valkey, tmp_path, "api", FLOWCAST_WORKER_SLOTS="0")
        first = replica(own_valkey, tmp_path, "w1", FLOWCAST_REDIS_URL=tap.url)
        second = replica(own_valkey, tmp_path, "w2")
        await asyncio.gather(api.start(), first.start())
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
                await put(client, approval_workflow("review"))
                eid = await paused_execution(client, "review")
                tap.hold(MOMENTS[moment](eid))
                answered = await client.post(
                    f"/api/executions/{eid}/resume", json={"input": {"approved": True}}
                )
                assert answered.status_code == 202, answered.text
                assert answered.json()["status"] == "queued", answered.json()
                await asyncio.wait_for(tap.held.wait(), 20)
                await kill_replica(first)
                await second.start()
                ended = await wait_finished(client, eid, timeout=20 * LEASE_SECONDS)
                assert ended["status"] == "completed", ended
                events = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
                check_log(events)
                kinds = [event["type"] for event in events]
                assert kinds.count("execution:resumed") == 1, kinds
                done = [
                    event
                    for event in events
                    if event["type"] == "block:completed" and event["data"]["blockId"] == "done"
                ]
                assert len(done) == 1, kinds
        finally:
            await asyncio.gather(api.stop(), first.stop(), second.stop())
