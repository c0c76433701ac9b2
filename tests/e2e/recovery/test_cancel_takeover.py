"""A cancel accepted for a run whose owner then died is honoured by the takeover
before anything runs again (SPEC §7): two replicas on one Valkey with a 1 s lease.

Found by the step 15 fault review (F5): the recovered run started the in-flight block
again (a ``generate`` even streamed chunks) before it ended cancelled.

The window (the cancel accepted, the owner dead before it wrote the cancel) is hit every
time without a hook in the server: the owner is stopped (SIGSTOP) before the cancel is
sent to the other replica, and killed while stopped, so it can never act on the cancel.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, put, talking_workflow, until, wait_finished
from tests.support.faults import kill_replica, replica
from tests.support.logcheck import check_log
from tests.support.servers import ValkeyServer

pytestmark = pytest.mark.timeout(90)


async def stored(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    return await all_events(client, execution_id)


async def streaming(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    """Wait until the stored log holds a few chunks of the running block; the log."""

    async def chunks() -> list[dict[str, Any]] | None:
        log = await stored(client, execution_id)
        return log if sum(1 for event in log if event["type"] == "block:chunk") >= 3 else None

    found: list[dict[str, Any]] = await until(chunks, "three chunks stored", 20)
    return found


@pytest.mark.parametrize("attempt", range(3))
async def test_a_takeover_ends_an_accepted_cancel_before_running_any_block(
    valkey: ValkeyServer, tmp_path: Path, attempt: int
) -> None:
    prefix = f"ct{uuid.uuid4().hex[:6]}"
    a = replica(valkey, tmp_path, "a", FLOWCAST_REDIS_PREFIX=prefix)
    b = replica(valkey, tmp_path, "b", FLOWCAST_REDIS_PREFIX=prefix)
    await asyncio.gather(a.start(), b.start())
    try:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            workflow_id = f"talk-{prefix}"
            await put(on_a, talking_workflow(workflow_id, words=400, tps=40))
            response = await on_a.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
            assert response.status_code == 202, response.text
            execution_id = response.json()["executionId"]
            await streaming(on_b, execution_id)

            os.kill(a.pid, signal.SIGSTOP)
            before_cancel = (await stored(on_b, execution_id))[-1]["id"]
            cancel = await on_b.post(f"/api/executions/{execution_id}/cancel")
            assert cancel.status_code == 202, cancel.text
            await kill_replica(a)  # stopped, then killed: it never wrote the cancel

            async with asyncio.timeout(30):
                done = await wait_finished(on_b, execution_id)
            assert done["status"] == "cancelled", done
            log = await stored(on_b, execution_id)
    finally:
        await asyncio.gather(kill_replica(a), kill_replica(b))

    check_log(log)
    after = [event for event in log if event["id"] > before_cancel]
    ran_again = [e for e in after if e["type"] in ("block:started", "block:chunk")]
    assert not ran_again, f"the takeover ran blocks after the accepted cancel: {ran_again[:3]}"
    types = [event["type"] for event in after]
    assert types == ["execution:recovered", "execution:cancelled"], types
    recovered = after[0]["data"]
    assert recovered["reason"] == "worker_lost"
    assert recovered["rerun"] == [], recovered
    assert log[-1]["data"] == {"reason": "cancelled"}
