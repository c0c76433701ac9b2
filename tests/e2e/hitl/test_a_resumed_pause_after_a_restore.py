"""A pause resumed (202) and running on its owner, then Valkey comes back from a
snapshot taken while it was still paused, its approval deadline passed by then. The
owner re-asserts the run within the settle unless its loop is stalled for a moment (here
SIGSTOP for about two seconds, under half its lease): the accepted resume must still
take effect, never an ``approval_timeout`` (SPEC §3 "Every accepted request takes
effect", §6, §7 "a cancel or resume arriving at any instant"). Awake, the owner
re-asserts the run within the settle; stalled, it re-asserts it once awake, before any
deadline the restore brought back may expire (a store found behind holds deadlines for
about a lease: store.py, janitor.py).

Found by the step 15 fault review.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, put, until, wait_status
from tests.support.faults import FaultyValkey, crash_and_restore, replica, take_snapshot
from tests.support.logcheck import check_lossy_log
from tests.support.recovery import (
    dropped_ranges,
    finished,
    has_event,
    http_for,
    running,
    settled,
    valkey,
)
from tests.support.sse import follow

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(120)

LEASE = "5"  # seconds: the owner's stall below is well under half of it
DEADLINE_SECONDS = 2


def ask_then_work(workflow_id: str) -> dict[str, Any]:
    ask = {"prompt": "Go?", "schema": {}, "timeoutSeconds": DEADLINE_SECONDS}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "ask", "type": "approval", "config": ask},
            {"id": "work", "type": "delay", "config": {"ms": 6000}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [{"from": "ask", "to": "work"}, {"from": "work", "to": "done"}],
    }


@pytest.mark.parametrize("owner", ["awake", "stalled"])
async def test_an_accepted_resume_holds_when_a_restore_brings_back_the_expired_pause(
    valkey: FaultyValkey, tmp_path: Path, owner: str
) -> None:
    a = replica(valkey, tmp_path, "a", FLOWCAST_LEASE_SECONDS=LEASE)
    b = replica(valkey, tmp_path, "b", FLOWCAST_LEASE_SECONDS=LEASE)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = ask_then_work("resumedpause")
        await put(http_for(http, a), wf)
        started = await http_for(http, a).post(
            f"/api/workflows/{wf['id']}/execute", json={"input": {}}
        )
        assert started.status_code == 202, started.text
        eid = started.json()["executionId"]
        await wait_status(http_for(http, a), eid, "paused")
        paused_at = asyncio.get_running_loop().time()
        snap = await take_snapshot(valkey, tmp_path / "paused.rdb")
        answer = await http_for(http, a).post(
            f"/api/executions/{eid}/resume", json={"input": {"go": True}}
        )
        assert answer.status_code == 202, answer.text
        await until(lambda: has_event(http_for(http, a), eid, "block:started", "work"), "work")
        # Past the deadline the snapshot holds, the owner still busy with ``work``.
        await asyncio.sleep(
            max(0.0, paused_at + DEADLINE_SECONDS + 0.3 - asyncio.get_running_loop().time())
        )
        pid = a.pid
        if owner == "stalled":
            os.kill(pid, signal.SIGSTOP)
        try:
            await crash_and_restore(valkey, snap)
            with contextlib.suppress(AssertionError):  # it may hold: then A goes on
                await until(
                    lambda: has_event(http_for(http, b), eid, "execution:failed"),
                    "B ended the restored pause",
                    timeout=2.5,
                )
        finally:
            if owner == "stalled":
                os.kill(pid, signal.SIGCONT)
        snapshot = await finished(http_for(http, b), eid)
        log = await all_events(http_for(http, b), eid)
        replay = await follow(http_for(http, b), eid)
    types = [(event["id"], event["type"]) for event in log]
    # The events the restore lost are a dropped range (SPEC §4), written back around.
    check_lossy_log(log, dropped=dropped_ranges(replay))
    assert snapshot["status"] == "completed", (
        f"the resume was accepted (202) but the run ended {snapshot['status']} "
        f"({snapshot.get('error')}): {types}"
    )
