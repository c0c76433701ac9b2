"""A server started on the data directory of one that is stopped (SIGSTOP), not dead,
cannot get the node lock, so it takes nothing of the stopped one's early: the stopped
one, let go within its lease, finishes its own run with no recovery (SPEC §7; the node
lock of F6 proves a death, and a stall is not one).

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, delay_workflow, execute, put, until
from tests.support.logcheck import check_log
from tests.support.recovery import finished, has_event
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.timing import hold_for

pytestmark = pytest.mark.timeout(120)


async def test_a_server_on_the_data_directory_of_a_stopped_one_takes_none_of_its_runs(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = {"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": f"nl{uuid.uuid4().hex[:6]}"}
    first = FlowcastServer(data_dir=tmp_path / "node", env=env)
    second = FlowcastServer(data_dir=first.data_dir, env=env)
    stopped = False
    try:
        await first.start()
        async with httpx.AsyncClient(base_url=first.url, timeout=20) as client:
            await put(client, delay_workflow("mine", ms=4000))
            eid = await execute(client, "mine")
            await until(lambda: has_event(client, eid, "block:started", "think"), "running")
        os.kill(first.pid, signal.SIGSTOP)
        stopped = True
        await second.start()
        async with httpx.AsyncClient(base_url=second.url, timeout=20) as client:
            await hold_for(1.5, "janitor passes (every 0.25 s) of the second: none may take it")
            assert not await has_event(client, eid, "execution:recovered")
            os.kill(first.pid, signal.SIGCONT)
            stopped = False
            snapshot = await finished(client, eid)
            log = await all_events(client, eid)
        assert "another live process uses this data directory" in second.logs()
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
        await asyncio.gather(first.stop(signal.SIGKILL), second.stop(signal.SIGKILL))
    check_log(log)
    assert snapshot["status"] == "completed", snapshot
    assert not [e for e in log if e["type"] == "execution:recovered"], log
