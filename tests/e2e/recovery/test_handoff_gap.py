"""A graceful hand-off right after a burst reports no gap: ids reserved are not ids lost.

Found by the step 15 fault review (F3). A burst of events makes the owner's appends
reserve ids ahead of what it emitted (it shows a burst as it is emitted, SPEC §5). The
owner then gets SIGTERM: it stores every event and hands the execution off. The next
owner used to number from the reservation and report the ids in between, which no
event ever had, as a ``dropped`` gap of hundreds or thousands of ids. The hand-off now
records the last id the owner showed: the next owner numbers from there, and a gap is
reported only where events were lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, put, until
from tests.support.faults import replica, terminate_replica
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events

pytestmark = pytest.mark.timeout(120)

DEADLINE = 40.0


def burst_then_delay(workflow_id: str) -> dict[str, Any]:
    """talk (3000 chunks as fast as they come: bursts) → rest (a delay) → end."""
    text = " ".join(f"w{i}" for i in range(3000))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": 0}},
            {"id": "rest", "type": "delay", "config": {"ms": 3_000}},
            {"id": "end", "type": "transform", "config": {"value": "{{ blocks.talk.output }}"}},
        ],
        "edges": [{"from": "talk", "to": "rest"}, {"from": "rest", "to": "end"}],
    }


@contextlib.asynccontextmanager
async def pair(
    valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    try:
        await asyncio.gather(a.start(), b.start())
        yield a, b
    finally:
        await asyncio.gather(a.stop(signal.SIGKILL), b.stop(signal.SIGKILL))


async def meta(valkey: ValkeyServer, execution_id: str) -> dict[bytes, bytes]:
    redis = Redis.from_url(valkey.url)
    try:
        fields: dict[bytes, bytes] = await redis.hgetall(f"fc:{{{execution_id}}}:meta")
        return fields
    finally:
        await redis.aclose()


async def read_to_end(client: httpx.AsyncClient, execution_id: str) -> list[Frame]:
    url = f"/api/executions/{execution_id}/stream"
    async with asyncio.timeout(DEADLINE):
        async with client.stream("GET", url, headers={"Last-Event-ID": "0"}) as response:
            assert response.status_code == 200, await response.aread()
            return [frame async for frame in events(response)]


async def test_a_sigterm_hand_off_right_after_a_burst_reports_no_gap(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    async with (
        pair(valkey, tmp_path) as (a, b),
        httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
    ):
        workflow = burst_then_delay(f"burst-{unique}")
        await put(on_a, workflow)
        response = await on_a.post(f"/api/workflows/{workflow['id']}/execute", json={})
        assert response.status_code == 202, response.text
        execution_id = response.json()["executionId"]

        async def resting() -> bool:
            stored = await all_events(on_b, execution_id)
            return any(
                e["type"] == "block:started" and e["data"]["blockId"] == "rest" for e in stored
            )

        await until(resting, "the burst is stored and the run rests")
        fields = await meta(valkey, execution_id)
        reserved, last = int(fields.get(b"reserved", 0)), int(fields[b"lastId"])
        # The scenario: the burst left ids reserved ahead of the last one given out.
        assert reserved > last, (reserved, last)
        await terminate_replica(a)

        async def completed() -> bool:
            snapshot = (await on_b.get(f"/api/executions/{execution_id}")).json()
            return bool(snapshot["status"] == "completed")

        await until(completed, "B completed the execution after the hand-off")
        stored = await all_events(on_b, execution_id)
        frames = await read_to_end(on_b, execution_id)
    gaps = [frame.json for frame in frames if frame.event == "replay:gap"]
    assert gaps == [], f"a gap though no event was lost (reserved {reserved}, last {last})"
    check_log(stored)  # ids 1..terminal, contiguous
    assert check_view(frames) == stored
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert [e["data"]["reason"] for e in recovered] == ["handoff"]
    assert recovered[0]["id"] == last + 1
