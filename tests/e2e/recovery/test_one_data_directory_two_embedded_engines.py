"""Two ``flowcast serve`` processes on one data directory with the embedded engine (the
default when no Redis is configured). Were the second to start a Valkey of its own on
the same AOF files as the first one's, each would have a store of its own with the same
executions, and the second would take over the first one's run while the first goes on
running it: one execution run by two owners that never fence each other, its ids naming
different events on each (SPEC §4 "Ids", §7). So the second refuses to start, saying
why; the first is not disturbed.

Found by the step 15 fault review (the second started its engine and took the run over).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, delay_workflow, execute, put, until
from tests.support.recovery import finished, has_event
from tests.support.servers import FlowcastServer

pytestmark = pytest.mark.timeout(120)


async def test_a_second_server_on_the_data_directory_of_an_embedded_engine_refuses_to_start(
    tmp_path: Path,
) -> None:
    env = {"FLOWCAST_LEASE_SECONDS": "1", "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1"}
    first = FlowcastServer(data_dir=tmp_path / "node", env=env)
    second = FlowcastServer(data_dir=first.data_dir, env=env)
    try:
        await first.start()
        async with httpx.AsyncClient(base_url=first.url, timeout=20) as on_first:
            await put(on_first, delay_workflow("shared", ms=3000))
            eid = await execute(on_first, "shared")
            await until(lambda: has_event(on_first, eid, "block:started", "think"), "running")
            with pytest.raises(RuntimeError):
                await second.start()
            assert "another Flowcast process runs the embedded engine" in second.logs()
            ended = await finished(on_first, eid)
            log = await all_events(on_first, eid)
    finally:
        await asyncio.gather(first.stop(signal.SIGKILL), second.stop(signal.SIGKILL))
    assert ended["status"] == "completed", log
    assert [e["id"] for e in log] == list(range(1, len(log) + 1)), log
    assert not [e for e in log if e["type"] == "execution:recovered"], log
