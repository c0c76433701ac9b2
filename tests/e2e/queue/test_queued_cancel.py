"""A cancel of a queued execution, on real processes, against the races and deaths
around it (SPEC §4 "Queued": "An execution cancelled while queued still has id 1
execution:started (then execution:cancelled)"; SPEC §14: it never runs; SPEC §3: a 202
means it happens).

Found by the step 17 fresh-eyes review.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import (
    all_events,
    approval_workflow,
    delay_workflow,
    paused_execution,
    put,
    wait_finished,
)
from tests.support.faults import LEASE_SECONDS, kill_replica, replica
from tests.support.servers import ValkeyServer
from tests.support.tap import Tap

pytestmark = pytest.mark.timeout(90)


async def test_a_canceller_killed_before_storing_leaves_a_queued_execution_cancelled_from_id_1(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with Tap(own_valkey.port) as tap:
        # No process with slots yet: the execution stays queued.
        a = replica(
            own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url, FLOWCAST_WORKER_SLOTS="0"
        )
        b = replica(own_valkey, tmp_path, "b")
        await a.start()
        try:
            async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
                await put(on_a, delay_workflow("slow", ms=300))
                answer = await on_a.post("/api/workflows/slow/execute", json={"input": {"n": 1}})
                assert answer.json()["status"] == "queued", answer.text
                eid = answer.json()["executionId"]
                # A's write of the cancel's events never reaches Redis: A dies there.
                tap.hold(lambda data: b"EVALSHA" in data and b"execution:started" in data)
                cancel = await on_a.post(f"/api/executions/{eid}/cancel")
                assert cancel.status_code == 202, cancel.text
                await asyncio.wait_for(tap.held.wait(), 20)
                await kill_replica(a)
            await b.start()
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
                ended = await wait_finished(on_b, eid, timeout=20 * LEASE_SECONDS)
                assert ended["status"] == "cancelled", ended
                log = await all_events(on_b, eid)
                types = [event["type"] for event in log]
                # It never ran: no block started, and its log opens as every log does.
                assert not [t for t in types if t.startswith("block:")], types
                assert log[0]["id"] == 1 and types[0] == "execution:started", types
                assert types[-1] == "execution:cancelled", types
        finally:
            await asyncio.gather(a.stop(), b.stop())


async def test_a_cancel_that_read_a_pause_and_met_its_resume_in_line_only_ends_it(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """The cancel reads the execution paused; a resume on another replica puts it in
    line (paused -> queued, with no slot for it there); then the cancel's claim meets it
    queued. The execution has its log already: the cancel only ends it, it does not
    write a second execution:started."""
    async with Tap(own_valkey.port) as tap:
        a = replica(
            own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url, FLOWCAST_WORKER_SLOTS="0"
        )
        b = replica(own_valkey, tmp_path, "b", FLOWCAST_WORKER_SLOTS="0")
        worker = replica(own_valkey, tmp_path, "worker")
        await asyncio.gather(a.start(), b.start(), worker.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
            ):
                await put(on_b, approval_workflow("review"))
                eid = await paused_execution(on_b, "review")
                await worker.stop()  # nobody runs the resume: it stays in line
                release = asyncio.Event()
                tap.hold(
                    lambda data: b"}:meta" in data and b"\r\ncancel\r\n" in data, release=release
                )
                cancel = asyncio.create_task(on_a.post(f"/api/executions/{eid}/cancel"))
                await asyncio.wait_for(tap.held.wait(), 20)
                resumed = await on_b.post(f"/api/executions/{eid}/resume", json={"input": 1})
                assert resumed.status_code == 202, resumed.text
                assert resumed.json()["status"] == "queued", resumed.text
                release.set()
                assert (await cancel).status_code == 202
                ended = await wait_finished(on_b, eid, timeout=20 * LEASE_SECONDS)
                assert ended["status"] == "cancelled", ended
                log = await all_events(on_b, eid)
                types = [event["type"] for event in log]
                assert types.count("execution:started") == 1, types
                assert types[-1] == "execution:cancelled", types
                assert [event["id"] for event in log] == list(range(1, len(log) + 1))
        finally:
            await asyncio.gather(a.stop(), b.stop(), worker.stop())
