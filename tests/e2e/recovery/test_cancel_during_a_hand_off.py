"""A cancel accepted while the owner hands the run off at a SIGTERM (in its grace, or
just as it lets go) ends the execution cancelled, and nothing runs again after the
cancel's 202 (SPEC §3 "Every accepted request takes effect", §7; F5 for a hand-off).

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, execute, put, talking_workflow, until
from tests.support.faults import FaultyValkey, replica, terminate_replica
from tests.support.logcheck import check_log
from tests.support.recovery import finished, has_event, http_for, running, settled, valkey

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("when", [0.2, 0.9, 1.1, "exited"])
async def test_a_cancel_during_a_hand_off_ends_the_run_cancelled_and_runs_nothing_more(
    valkey: FaultyValkey, tmp_path: Path, when: float | str
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = talking_workflow(f"cancelho{str(when).replace('.', '')}", words=400, tps=40)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, b), eid, "block:chunk", "talk"), "talking")
        stopping = asyncio.create_task(terminate_replica(a))
        if when == "exited":
            await stopping
        else:
            assert isinstance(when, float)
            await asyncio.sleep(when)  # into A's 1 s grace (or just past it)
        cancel = await http_for(http, b).post(f"/api/executions/{eid}/cancel")
        accepted_at = max(e["id"] for e in await all_events(http_for(http, b), eid))
        await stopping
        snapshot = await finished(http_for(http, b), eid)
        log = await all_events(http_for(http, b), eid)
    check_log(log)
    if cancel.status_code == 409:
        # Only if the run had ended already; it cannot have (10 s of talk).
        raise AssertionError(f"cancel refused: {cancel.text}; log ends {log[-1]['type']}")
    assert cancel.status_code == 202, cancel.text
    assert snapshot["status"] == "cancelled", (snapshot, [e["type"] for e in log[-5:]])
    later = [e for e in log if e["id"] > accepted_at]
    started = [e for e in later if e["type"] == "block:started"]
    assert not started, f"blocks ran again after the cancel was accepted: {started}"
    assert log[-1]["type"] == "execution:cancelled"
