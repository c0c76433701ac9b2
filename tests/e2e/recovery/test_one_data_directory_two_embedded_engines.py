"""Two ``flowcast serve`` processes on one data directory with the embedded engine (the
default when no Redis is configured): the second cannot get the node lock, yet it starts
a Valkey of its own on the same AOF files as the first one's. Each then has a store of
its own with the same executions, and the second takes over the first one's run, which
the first goes on running: one execution run by two owners that never fence each other,
its ids naming different events on each (SPEC §4 "Ids", §7 "a fencing token changes
with every change of owner; a stalled old owner can never append after that").

Found by the step 15 fault review.
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


@pytest.mark.xfail(
    strict=True,
    reason="a second server on a data directory whose node lock it cannot get still "
    "starts its own embedded engine there, and takes the first one's run over",
)
async def test_a_second_server_on_the_data_directory_shares_the_first_ones_execution_log(
    tmp_path: Path,
) -> None:
    env = {"FLOWCAST_LEASE_SECONDS": "1", "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1"}
    first = FlowcastServer(data_dir=tmp_path / "node", env=env)
    second = FlowcastServer(data_dir=first.data_dir, env=env)
    try:
        await first.start()
        async with (
            httpx.AsyncClient(base_url=first.url, timeout=20) as on_first,
            httpx.AsyncClient(base_url=second.url, timeout=20) as on_second,
        ):
            await put(on_first, delay_workflow("shared", ms=6000))
            eid = await execute(on_first, "shared")
            await until(lambda: has_event(on_first, eid, "block:started", "think"), "running")
            await second.start()
            assert "another live process uses this data directory" in second.logs()

            async def known_to_second() -> bool:
                return (await on_second.get(f"/api/executions/{eid}")).status_code == 200

            await until(known_to_second, "the second server knows the execution")
            ended_first = await finished(on_first, eid)
            log_first = await all_events(on_first, eid)
            ended_second = await finished(on_second, eid)
            log_second = await all_events(on_second, eid)
    finally:
        await asyncio.gather(first.stop(signal.SIGKILL), second.stop(signal.SIGKILL))
    summary = (
        f"first: {[(e['id'], e['type']) for e in log_first]}; "
        f"second: {[(e['id'], e['type']) for e in log_second]}"
    )
    assert (ended_first["status"], ended_second["status"]) == ("completed", "completed"), summary
    assert log_first == log_second, f"one execution, two logs: {summary}"
    assert not [e for e in log_second if e["type"] == "execution:recovered"], summary
