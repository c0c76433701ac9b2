"""Cancel (SPEC §7) on real processes: two servers on one Valkey. A cancel received by
either process reaches the owner (its control stream, ``XREAD BLOCK``), cancels the
running blocks and ends the execution with ``execution:cancelled``, last."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.support.api import (
    all_events,
    delay_workflow,
    execute,
    put,
    talking_workflow,
    until,
    wait_finished,
)
from tests.support.logcheck import TERMINAL, check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer, serving_pair
from tests.support.sse import Frame, events
from tests.support.timing import assert_below_timer, hold_for

Pair = tuple[FlowcastServer, FlowcastServer]


@pytest.fixture(scope="module")
async def pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Pair]:
    """Servers A and B on the session's Valkey, with the default lease (15 s): a cancel
    that lands fast cannot have come through a lease renewal."""
    root = tmp_path_factory.mktemp("cancel")
    async with serving_pair(valkey, root, sse_ping_seconds="0.5") as servers:
        yield servers


@pytest.fixture
async def clients(pair: Pair) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        yield on_a, on_b


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "draft", "type": "transform", "config": {"value": "ok"}},
            {
                "id": "review",
                "type": "approval",
                "config": {"prompt": "Go?", "schema": {"type": "object"}},
            },
            {"id": "send", "type": "transform", "config": {"value": 3}},
        ],
        "edges": [{"from": "draft", "to": "review"}, {"from": "review", "to": "send"}],
    }


async def wait_for_event(
    client: httpx.AsyncClient,
    execution_id: str,
    wanted: str,
    block_id: str | None = None,
    timeout: float = 10.0,
) -> None:
    """Poll the stored log until it holds an event of type ``wanted`` (for ``block_id``)."""

    async def stored() -> bool:
        return any(
            event["type"] == wanted
            and (block_id is None or event["data"].get("blockId") == block_id)
            for event in await all_events(client, execution_id)
        )

    await until(stored, f"a stored {wanted} ({block_id})", timeout)


class Follower:
    """An SSE client reading one execution's stream to its end, noting arrival times."""

    def __init__(self, client: httpx.AsyncClient, execution_id: str) -> None:
        self.received: list[tuple[Frame, float]] = []
        self.attached = asyncio.Event()
        self.closed_at: float | None = None
        self.task = asyncio.create_task(self._read(client, execution_id))

    async def _read(self, client: httpx.AsyncClient, execution_id: str) -> None:
        url = f"/api/executions/{execution_id}/stream"
        async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
            assert response.status_code == 200
            self.attached.set()
            async for frame in events(response):
                self.received.append((frame, time.monotonic()))
        self.closed_at = time.monotonic()

    async def finish(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Wait for the server to close the stream; returns the envelopes seen, checked."""
        await asyncio.wait_for(self.task, timeout)
        return check_view([frame for frame, _ in self.received])

    def arrival(self, event_type: str) -> float:
        return next(at for frame, at in self.received if frame.event == event_type)


def assert_cancelled(envelopes: list[dict[str, Any]], *, never_completed: str) -> None:
    check_log(envelopes)
    assert envelopes[-1]["type"] == "execution:cancelled", envelopes[-1]
    assert envelopes[-1]["data"] == {"reason": "cancelled"}
    completed = [e["data"]["blockId"] for e in envelopes if e["type"] == "block:completed"]
    assert never_completed not in completed, completed


@pytest.mark.parametrize("receiver", ["owner", "other"])
async def test_cancel_of_a_running_execution_ends_it_with_cancelled_on_every_stream(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str, receiver: str
) -> None:
    on_a, on_b = clients
    await put(on_a, delay_workflow(f"slow-{receiver}-{unique}"))
    execution_id = await execute(on_a, f"slow-{receiver}-{unique}", {})
    followers = [Follower(on_a, execution_id), Follower(on_b, execution_id)]
    await wait_for_event(on_a, execution_id, "block:started", "think")
    await asyncio.gather(*(follower.attached.wait() for follower in followers))

    response = await (on_a if receiver == "owner" else on_b).post(
        f"/api/executions/{execution_id}/cancel"
    )
    assert response.status_code == 202, response.text
    assert response.json() == {"executionId": execution_id, "status": "cancelling"}

    # The 202 says the cancel was accepted, not that its event is stored yet.
    snapshot = await wait_finished(on_b, execution_id)
    assert snapshot["status"] == "cancelled"
    stored = await all_events(on_b, execution_id)
    for follower in followers:
        # The server closes each stream right after the terminal event.
        assert await follower.finish() == stored
    assert_cancelled(stored, never_completed="think")
    assert snapshot["lastEventId"] == stored[-1]["id"]


async def test_cancel_received_by_another_process_lands_well_under_a_second(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, delay_workflow(f"quick-{unique}"))
    latencies = []
    for _ in range(5):
        execution_id = await execute(on_a, f"quick-{unique}", {})
        follower = Follower(on_b, execution_id)
        await wait_for_event(on_a, execution_id, "block:started", "think")
        await follower.attached.wait()
        sent = time.monotonic()
        response = await on_b.post(f"/api/executions/{execution_id}/cancel")
        assert response.status_code == 202, response.text
        assert_cancelled(await follower.finish(), never_completed="think")
        latencies.append(follower.arrival("execution:cancelled") - sent)
    print(
        f"\ncross-process cancel → terminal on a stream of the other process: "
        f"median {statistics.median(latencies) * 1000:.0f} ms, "
        f"max {max(latencies) * 1000:.0f} ms"
    )
    # The lease is 15 s: a cancel this fast came through the owner's control stream.
    assert_below_timer(
        max(latencies),
        bound=3.0,
        timer="the 15 s lease",
        what="slowest cross-process cancel to its terminal event",
        detail=str(latencies),
    )


@pytest.mark.parametrize("receiver", ["owner", "other"])
async def test_cancel_stops_a_streaming_generate_block_mid_text(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str, receiver: str
) -> None:
    on_a, on_b = clients
    await put(on_a, talking_workflow(f"talk-{receiver}-{unique}", words=300, tps=20))
    execution_id = await execute(on_a, f"talk-{receiver}-{unique}", {})
    follower = Follower(on_b, execution_id)
    await wait_for_event(on_a, execution_id, "block:chunk", "talk")
    response = await (on_a if receiver == "owner" else on_b).post(
        f"/api/executions/{execution_id}/cancel"
    )
    assert response.status_code == 202, response.text
    envelopes = await follower.finish()
    assert_cancelled(envelopes, never_completed="talk")
    chunks = [e for e in envelopes if e["type"] == "block:chunk"]
    assert 0 < len(chunks) < 300
    await hold_for(0.3, "a window for a chunk written after the terminal event: none may be")
    assert await all_events(on_a, execution_id) == envelopes


@pytest.mark.parametrize("receiver", ["owner", "other"])
async def test_cancel_of_a_paused_execution_ends_it_and_closes_the_open_stream(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str, receiver: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"pause-{receiver}-{unique}"))
    execution_id = await execute(on_a, f"pause-{receiver}-{unique}", {})
    followers = [Follower(on_a, execution_id), Follower(on_b, execution_id)]
    await wait_for_event(on_a, execution_id, "execution:paused")
    assert (await on_a.get(f"/api/executions/{execution_id}")).json()["status"] == "paused"
    await asyncio.gather(*(follower.attached.wait() for follower in followers))

    sent = time.monotonic()
    response = await (on_a if receiver == "owner" else on_b).post(
        f"/api/executions/{execution_id}/cancel"
    )
    assert response.status_code == 202, response.text
    stored = await asyncio.wait_for(wait_finished(on_a, execution_id), 10)
    assert stored["status"] == "cancelled"
    envelopes = await all_events(on_a, execution_id)
    for follower in followers:
        assert await follower.finish() == envelopes
        assert_below_timer(
            follower.arrival("execution:cancelled") - sent,
            bound=3.0,
            timer="the 15 s lease",
            what="cancel of a paused execution to its terminal event",
        )
    assert_cancelled(envelopes, never_completed="review")
    assert [e["type"] for e in envelopes][-2:] == ["execution:paused", "execution:cancelled"]
    # A paused execution can no longer be resumed once cancelled.
    resumed = await on_b.post(f"/api/executions/{execution_id}/resume", json={"input": {}})
    assert resumed.status_code == 409
    assert resumed.json()["error"]["status"] == "cancelled"


async def finished_execution(client: httpx.AsyncClient, unique: str, status: str) -> str:
    if status == "completed":
        await put(client, delay_workflow(f"done-{unique}", ms=0))
        execution_id = await execute(client, f"done-{unique}", {})
    elif status == "failed":
        workflow = {
            "id": f"broken-{unique}",
            "blocks": [{"id": "boom", "type": "fail", "config": {"message": "no"}}],
            "edges": [],
        }
        await put(client, workflow)
        execution_id = await execute(client, f"broken-{unique}", {})
    else:
        await put(client, delay_workflow(f"gone-{unique}"))
        execution_id = await execute(client, f"gone-{unique}", {})
        assert (await client.post(f"/api/executions/{execution_id}/cancel")).status_code == 202
    snapshot = await asyncio.wait_for(wait_finished(client, execution_id), 10)
    assert snapshot["status"] == status
    return execution_id


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled"])
async def test_cancel_of_a_finished_execution_is_409_with_its_status(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str, status: str
) -> None:
    on_a, on_b = clients
    execution_id = await finished_execution(on_a, unique, status)
    before = await all_events(on_a, execution_id)
    for client in (on_a, on_b):
        response = await client.post(f"/api/executions/{execution_id}/cancel")
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["status"] == status
        assert status in error["message"]
    # The refusal changed nothing.
    assert await all_events(on_b, execution_id) == before
    snapshot = (await on_b.get(f"/api/executions/{execution_id}")).json()
    assert snapshot["status"] == status


async def test_cancel_of_an_unknown_execution_is_404(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    for client in clients:
        response = await client.post("/api/executions/ex_doesnotexist/cancel")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "execution_not_found"


async def test_concurrent_cancels_on_both_processes_end_the_execution_once(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, delay_workflow(f"twice-{unique}"))
    execution_id = await execute(on_a, f"twice-{unique}", {})
    await wait_for_event(on_a, execution_id, "block:started", "think")
    answers = await asyncio.gather(
        *(client.post(f"/api/executions/{execution_id}/cancel") for client in (on_a, on_b) * 3)
    )
    # Each answer is either accepted or "already finished"; never an error or a 500.
    assert {answer.status_code for answer in answers} <= {202, 409}, [a.text for a in answers]
    assert any(answer.status_code == 202 for answer in answers)
    await asyncio.wait_for(wait_finished(on_b, execution_id), 10)
    envelopes = await all_events(on_b, execution_id)
    assert_cancelled(envelopes, never_completed="think")
    assert sum(e["type"] in TERMINAL for e in envelopes) == 1
