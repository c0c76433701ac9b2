"""A keyed ``execute`` whose first request is slow (not dead) between writing the key's
record and creating the execution, and a repeat on another replica meanwhile: the repeat
creates the execution the record names, the slow one then finds it created and answers
the same id, and the execution runs once (SPEC §3 "Idempotency": "even when the repeats
arrive concurrently"; F2's "a repeat on any replica finds or creates it").

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, delay_workflow, put, wait_finished
from tests.support.faults import replica
from tests.support.logcheck import check_log
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.tap import Tap

pytestmark = pytest.mark.timeout(90)

KEY = {"Idempotency-Key": "order-5678"}
BODY = {"input": {"amount": 7}}
WORKFLOW = "slow-first"


@pytest.fixture
async def tapped(
    own_valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[Tap, FlowcastServer, httpx.AsyncClient, httpx.AsyncClient]]:
    async with Tap(own_valkey.port) as tap:
        a = replica(own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url)
        b = replica(own_valkey, tmp_path, "b")
        await asyncio.gather(a.start(), b.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
            ):
                await put(on_b, delay_workflow(WORKFLOW, ms=300))
                yield tap, a, on_a, on_b
        finally:
            await asyncio.gather(a.stop(), b.stop())


async def test_a_repeat_beside_a_slow_first_request_creates_the_execution_once(
    tapped: tuple[Tap, FlowcastServer, httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    tap, a, on_a, on_b = tapped
    release = asyncio.Event()
    # start.lua writes the metadata and the run state together: A's is held there.
    tap.hold(lambda data: b"}:meta" in data and b"}:state" in data, release=release)
    url = f"/api/workflows/{WORKFLOW}/execute"
    first = asyncio.create_task(on_a.post(url, json=BODY, headers=KEY))
    await asyncio.wait_for(tap.held.wait(), 20)
    repeat = await on_b.post(url, json=BODY, headers=KEY)
    assert repeat.status_code == 202, repeat.text
    execution_id = repeat.json()["executionId"]
    release.set()
    answered = await first
    assert answered.status_code == 202, answered.text
    assert answered.json()["executionId"] == execution_id
    # The race was run: A's creation found the execution made by the repeat.
    assert "execution created by another request" in a.logs()
    assert (await wait_finished(on_b, execution_id, timeout=30))["status"] == "completed"
    log = await all_events(on_b, execution_id)
    check_log(log)
    types = [event["type"] for event in log]
    assert types.count("execution:started") == 1 and "execution:recovered" not in types, types
    again = await on_a.post(url, json=BODY, headers=KEY)
    assert again.json()["executionId"] == execution_id, again.text
    listed = await on_b.get(f"/api/executions?workflowId={WORKFLOW}&limit=50")
    assert [e["id"] for e in listed.json()["executions"]] == [execution_id]
