"""The connection time cap (``FLOWCAST_SSE_MAX_SECONDS``) on the live list: the server
ends the list's stream cleanly at the cap, as it does an execution's stream (one cap in
``app/sse.py`` for every SSE response), and a reconnect gets the whole list again. The
execution stream's side is ``tests/e2e/streams/test_cross_process.py``'s capped pair."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.api import put, wait_finished
from tests.support.servers import FlowcastServer, ValkeyServer, serving
from tests.support.sse import Frame, events

CAP_SECONDS = 1.0


@pytest.fixture(scope="module")
async def capped(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    async with serving(
        valkey, tmp_path_factory.mktemp("capped-list"), sse_max_seconds=str(CAP_SECONDS)
    ) as server:
        yield server


async def read_to_end(client: httpx.AsyncClient, url: str) -> tuple[list[Frame], float]:
    """The event frames of one connection, read until the server ends it, and its age."""
    opened = time.monotonic()
    # Without the cap the list never ends: this bound fails the test instead.
    async with asyncio.timeout(CAP_SECONDS * 20):
        async with client.stream("GET", url) as response:
            assert response.status_code == 200, await response.aread()
            received = [frame async for frame in events(response)]
    return received, time.monotonic() - opened


@pytest.mark.timeout(60)
async def test_the_live_list_ends_cleanly_at_the_time_cap_and_a_reconnect_lists_again(
    capped: FlowcastServer, unique: str
) -> None:
    workflow_id = f"capped-list-{unique}"
    async with httpx.AsyncClient(base_url=capped.url, timeout=20) as client:
        await put(
            client,
            {
                "id": workflow_id,
                "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
                "edges": [],
            },
        )
        started = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
        assert started.status_code == 202, started.text
        execution_id = started.json()["executionId"]
        await wait_finished(client, execution_id)

        url = f"/api/executions/live?workflowId={workflow_id}"
        for _ in range(2):  # the first connection, then the reconnect after its cap
            # A body cut short (not ended) would raise here, or end inside a frame.
            received, age = await read_to_end(client, url)
            assert [frame.event for frame in received] == ["executions"], received
            assert [row["id"] for row in received[0].json["executions"]] == [execution_id]
            assert age >= CAP_SECONDS * 0.8, age  # ended by the cap, not at once
