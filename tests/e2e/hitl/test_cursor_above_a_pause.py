"""A stream opened on a paused execution with a cursor above its stored log (a client
that saw live events the store never kept, or an odd one) stays open through the pause
and ends with the terminal event once the pause ends (resumed, or its deadline), on the
process that paused it and on another one (SPEC §4 "Cursor", §5, §6).

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, approval_workflow, put, wait_status
from tests.support.faults import FaultyValkey, replica
from tests.support.recovery import finished, http_for, running, settled, valkey
from tests.support.sse import follow
from tests.support.timing import hold_for

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("ending", ["resume", "deadline"])
@pytest.mark.parametrize("above", [2, 500])
async def test_a_cursor_above_a_paused_log_gets_the_rest_and_the_terminal_event(
    valkey: FaultyValkey, tmp_path: Path, above: int, ending: str
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = approval_workflow(f"above{above}{ending}")
        if ending == "deadline":
            # Long enough for both streams to open and idle (on a busy machine a 1 s
            # deadline passed first, and the run ended before the pause was looked at).
            wf["blocks"][0]["config"]["timeoutSeconds"] = 3
        await put(http_for(http, a), wf)
        started = await http_for(http, a).post(
            f"/api/workflows/{wf['id']}/execute", json={"input": {}}
        )
        assert started.status_code == 202, started.text
        eid = started.json()["executionId"]
        await wait_status(http_for(http, a), eid, "paused")
        paused_last = (await http_for(http, a).get(f"/api/executions/{eid}")).json()["lastEventId"]
        cursor = paused_last + above
        opened = [asyncio.Event(), asyncio.Event()]
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
        ):
            readers = [
                asyncio.create_task(follow(on_a, eid, cursor=cursor, started=opened[0])),
                asyncio.create_task(follow(on_b, eid, cursor=cursor, started=opened[1])),
            ]
            await asyncio.gather(*(event.wait() for event in opened))
            await hold_for(0.3, "both streams open and idle in the pause: neither may end")
            for task in readers:
                assert not task.done(), f"a stream ended during the pause: {task.result()}"
            if ending == "resume":
                answer = await http_for(http, b).post(
                    f"/api/executions/{eid}/resume", json={"input": {"ok": True}}
                )
                assert answer.status_code == 202, answer.text
            views = await asyncio.gather(*readers)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == ("completed" if ending == "resume" else "failed"), snapshot
    terminal = stored[-1]
    expected = [e["id"] for e in stored if e["id"] > cursor] or [terminal["id"]]
    for where, view in zip("AB", views, strict=True):
        ids = [int(frame.id) for frame in view if frame.id is not None]
        assert ids == expected, f"the stream on {where} (cursor {cursor}) got {ids}"
        assert view[-1].event == terminal["type"], (where, [f.event for f in view])
