"""Buffer outages on real processes: Valkey is killed mid-run and started again.

Each test runs its own Valkey server (AOF on) and its own Flowcast server pointed at
it, so killing Valkey disturbs no other test. The client streams from the process that
runs the execution. While Redis is down that process shows only events under ids Redis
reserved for it (SPEC §5 as amended in step 15: past them, events wait in memory, so
that no other owner can ever number an event a client saw); once Redis is back it
stores the backlog and the client gets every event, in order, on the same stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import put, streaming_workflow, until
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, collect, events

WORDS = 200
TOKENS_PER_SECOND = 50
KILL_AT = 20  # events received before Valkey is killed
DOWN_SECONDS = 1.5  # how long Valkey stays down: 75 events are emitted meanwhile


@dataclass
class Stack:
    valkey: ValkeyServer
    flowcast: FlowcastServer
    client: httpx.AsyncClient


@asynccontextmanager
async def stack(tmp_path: Path, env: dict[str, str]) -> AsyncIterator[Stack]:
    # Durable: the outage is the fault here, not writes the AOF had not taken yet.
    valkey = ValkeyServer(data_dir=tmp_path / "valkey", durable=True)
    await valkey.start()
    flowcast = FlowcastServer(
        data_dir=tmp_path / "server",
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_SSE_PING_SECONDS": "1", **env},
    )
    try:
        await flowcast.start()
        async with httpx.AsyncClient(base_url=flowcast.url, timeout=30) as client:
            yield Stack(valkey, flowcast, client)
    finally:
        await flowcast.stop()
        await valkey.stop()


@pytest.fixture
async def outage_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with stack(tmp_path, {}) as running:
        yield running


@pytest.fixture
async def small_backlog_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with stack(tmp_path, {"FLOWCAST_MAX_PENDING_EVENTS": "20"}) as running:
        yield running


async def outage(valkey: ValkeyServer) -> None:
    """Valkey down for DOWN_SECONDS (the fault's length, not a wait for readiness)."""
    valkey.kill()
    await asyncio.sleep(DOWN_SECONDS)
    await valkey.start()


async def stream_through_an_outage(running: Stack, workflow_id: str) -> tuple[str, list[Frame]]:
    """Start an execution, kill Valkey mid-run, keep reading, start Valkey again."""
    await put(running.client, streaming_workflow(workflow_id, words=WORDS, tps=TOKENS_PER_SECOND))
    frames: list[Frame] = []
    down: asyncio.Task[None] | None = None
    async with running.client.stream(
        "POST",
        f"/api/workflows/{workflow_id}/execute",
        json={"input": {"name": "outage"}},
        headers={"Accept": "text/event-stream"},
    ) as response:
        assert response.status_code == 200
        execution_id = response.headers["x-execution-id"]
        try:
            async for frame in events(response):
                frames.append(frame)
                if down is None and len(frames) == KILL_AT:
                    down = asyncio.create_task(outage(running.valkey))
        finally:
            if down is not None:
                await down
    assert down is not None, f"the run ended after {len(frames)} events"
    assert frames[-1].event == "execution:completed"
    return execution_id, frames


async def wait_stored_to_the_end(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    """Poll the snapshot until the terminal status is stored (503s while reconnecting)."""

    async def stored_end() -> dict[str, Any] | None:
        response = await client.get(f"/api/executions/{execution_id}")
        if response.status_code != 200:
            assert response.status_code == 503, response.text
            return None
        snapshot: dict[str, Any] = response.json()
        return snapshot if snapshot["status"] in ("completed", "failed", "cancelled") else None

    found: dict[str, Any] = await until(stored_end, "the end stored", 30, every=0.05)
    return found


async def stored_page(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        response = await client.get(f"/api/executions/{execution_id}/events?after={after}")
        assert response.status_code == 200, response.text
        page = response.json()
        found += page["events"]
        if not page["events"]:
            return found
        after = page["nextAfter"]


def assert_live_view_is_whole(frames: list[Frame]) -> list[dict[str, Any]]:
    envelopes = check_view(frames)
    check_log(envelopes)
    assert not [frame for frame in frames if frame.event == "replay:gap"]
    assert envelopes[-1]["type"] == "execution:completed"
    chunks = [e["data"]["text"] for e in envelopes if e["type"] == "block:chunk"]
    assert "".join(chunks) == " ".join(f"w{i}" for i in range(WORDS))
    return envelopes


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_valkey_outage_mid_run_loses_no_event_live_or_replayed(
    outage_stack: Stack, unique: str
) -> None:
    client = outage_stack.client
    execution_id, frames = await stream_through_an_outage(outage_stack, f"outage-{unique}")
    live = assert_live_view_is_whole(frames)

    snapshot = await wait_stored_to_the_end(client, execution_id)
    assert snapshot["status"] == "completed"
    assert snapshot["lastEventId"] == live[-1]["id"]
    stored = await stored_page(client, execution_id)
    check_log(stored)
    assert stored == live

    response, replayed = await collect(client, f"/api/executions/{execution_id}/stream")
    assert response.status_code == 200
    assert not [frame for frame in replayed if frame.event == "replay:gap"]
    envelopes = check_view(replayed)
    check_log(envelopes)
    assert envelopes == live


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_past_the_pending_cap_an_outage_drops_events_and_live_and_replay_agree(
    small_backlog_stack: Stack, unique: str
) -> None:
    """Events past the reservation wait in memory during the outage, and past the
    pending cap the oldest are dropped before anyone saw them: the live client gets the
    same dropped gap as a replay, never an event the store does not have."""
    client = small_backlog_stack.client
    execution_id, frames = await stream_through_an_outage(small_backlog_stack, f"drop-{unique}")
    live = check_view(frames)
    live_gaps = [frame.json for frame in frames if frame.event == "replay:gap"]
    assert live_gaps and {gap["reason"] for gap in live_gaps} == {"dropped"}
    assert live[-1]["type"] == "execution:completed"

    snapshot = await wait_stored_to_the_end(client, execution_id)
    assert snapshot["status"] == "completed"
    assert snapshot["lastEventId"] == live[-1]["id"]
    stored = await stored_page(client, execution_id)
    assert stored == live
    by_id = {envelope["id"]: envelope for envelope in stored}
    assert stored[0]["type"] == "execution:started"
    assert stored[-1]["type"] == "execution:completed"

    response, replayed = await collect(client, f"/api/executions/{execution_id}/stream")
    assert response.status_code == 200
    gaps = [frame.json for frame in replayed if frame.event == "replay:gap"]
    assert gaps, "the replay skipped dropped events without a gap frame"
    assert {gap["reason"] for gap in gaps} == {"dropped"}
    envelopes = check_view(replayed)
    assert envelopes == stored
    assert envelopes[-1]["type"] == "execution:completed"
    # Every id not stored lies inside a gap reported, live and replayed alike.
    missing = set(range(1, stored[-1]["id"] + 1)) - set(by_id)
    assert missing, "nothing was dropped: is the pending cap applied?"
    reported = {i for gap in gaps for i in range(gap["after"] + 1, gap["resumeAt"])}
    assert missing == reported
    reported_live = {i for gap in live_gaps for i in range(gap["after"] + 1, gap["resumeAt"])}
    assert missing == reported_live
