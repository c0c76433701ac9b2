"""Human in the loop on real processes: pause, resume (here, elsewhere, after a restart),
concurrent resumes, streams that stay open through a pause, approval timeouts, and a
buffer outage on the resume path."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, execute, of_type, put, until
from tests.support.logcheck import TERMINAL, check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer, serving_pair
from tests.support.sse import Frame, frames
from tests.support.timing import hold_for

SCHEMA = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}, "note": {"type": "string"}},
}
SSE = {"Accept": "text/event-stream"}


def approval_workflow(
    workflow_id: str,
    *,
    lead_ms: int = 0,
    words: int = 5,
    tps: float = 0,
    timeout_seconds: int | None = None,
) -> dict[str, Any]:
    """lead (delay) → ask (approval) → talk (generate, only if approved) → done."""
    ask: dict[str, Any] = {"prompt": "Go on with {{ input.what }}?", "schema": SCHEMA}
    if timeout_seconds is not None:
        ask["timeoutSeconds"] = timeout_seconds
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "lead", "type": "delay", "config": {"ms": lead_ms}},
            {"id": "ask", "type": "approval", "config": ask},
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": tps}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [
            {"from": "lead", "to": "ask"},
            {"from": "ask", "to": "talk", "when": "blocks.ask.output.approved"},
            {"from": "talk", "to": "done"},
        ],
    }


class Follower:
    """Reads one open SSE response in steps, keeping every frame (pings included)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._frames = frames(response)
        self.seen: list[Frame] = []

    @property
    def events(self) -> list[Frame]:
        return [frame for frame in self.seen if frame.event is not None]

    async def until(self, matches: Callable[[Frame], bool], timeout: float = 20) -> Frame:
        """Read until a frame matches; fails if the stream ends first."""
        async with asyncio.timeout(timeout):
            async for frame in self._frames:
                self.seen.append(frame)
                if matches(frame):
                    return frame
        raise AssertionError(f"the stream ended first: {[f.event for f in self.seen]}")

    async def until_event(self, kind: str, timeout: float = 20) -> Frame:
        return await self.until(lambda frame: frame.event == kind, timeout)

    async def to_the_end(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Read to the terminal event and check the server closes right after it."""
        await self.until(lambda frame: frame.event in TERMINAL, timeout)
        async with asyncio.timeout(5):
            rest = [frame async for frame in self._frames]
        assert not [frame for frame in rest if frame.event is not None], rest
        return check_view(self.events)


def is_ping(frame: Frame) -> bool:
    return frame.event is None and frame.comments == ["ping"]


async def snapshot_when(
    client: httpx.AsyncClient,
    execution_id: str,
    condition: Callable[[dict[str, Any]], bool],
    timeout: float = 20,
) -> dict[str, Any]:
    """Poll the snapshot until ``condition`` holds (503s while the buffer restarts)."""

    async def holds() -> dict[str, Any] | None:
        response = await client.get(f"/api/executions/{execution_id}")
        if response.status_code != 200:
            assert response.status_code == 503, response.text
            return None
        snapshot: dict[str, Any] = response.json()
        return snapshot if condition(snapshot) else None

    found: dict[str, Any] = await until(holds, "the snapshot's condition", timeout)
    return found


async def paused(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    return await snapshot_when(client, execution_id, lambda s: s["status"] == "paused")


async def finished(
    client: httpx.AsyncClient, execution_id: str, timeout: float = 20
) -> dict[str, Any]:
    return await snapshot_when(
        client, execution_id, lambda s: s["status"] in _TERMINAL_STATUSES, timeout
    )


_TERMINAL_STATUSES = ("completed", "failed", "cancelled")


async def resume(client: httpx.AsyncClient, execution_id: str, **body: Any) -> httpx.Response:
    return await client.post(f"/api/executions/{execution_id}/resume", json=body)


@pytest.fixture(scope="module")
async def pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Servers A and B on one Valkey, with quick heartbeats."""
    root = tmp_path_factory.mktemp("hitl")
    async with serving_pair(valkey, root, sse_ping_seconds="0.5") as servers:
        yield servers


@pytest.fixture
async def clients(
    pair: tuple[FlowcastServer, FlowcastServer],
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        yield on_a, on_b


@pytest.fixture(scope="module")
async def quick(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    """A server with a one-second lease (janitor every half second), on its own prefix so
    its janitor watches only its own executions."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("quick"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": "fcquick",
            "FLOWCAST_LEASE_SECONDS": "1",
            "FLOWCAST_SSE_PING_SECONDS": "0.5",
        },
    )
    await server.start()
    yield server
    await server.stop()


# -- pausing ---------------------------------------------------------------------------


async def test_approval_block_emits_paused_and_the_snapshot_shows_the_pause(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"pause-{unique}"))
    async with on_a.stream(
        "POST", f"/api/workflows/pause-{unique}/execute", json={"input": {"what": "x"}}, headers=SSE
    ) as response:
        execution_id = response.headers["x-execution-id"]
        follower = Follower(response)
        pause_frame = await follower.until_event("execution:paused")
        assert pause_frame.json["data"] == {
            "blockId": "ask",
            "prompt": "Go on with x?",
            "schema": SCHEMA,
        }
        # The stream stays open while paused, with heartbeats only.
        await follower.until(is_ping)
        await follower.until(is_ping)
    # Both processes see the pause, stored with its event.
    for client in (on_a, on_b):
        snapshot = await paused(client, execution_id)
        assert snapshot["pause"] == pause_frame.json["data"]
        assert snapshot["lastEventId"] == int(pause_frame.id or 0)
        assert "output" not in snapshot and "error" not in snapshot
    stored = await all_events(on_a, execution_id)
    check_log(stored, complete=False)
    assert stored == check_view(follower.events)
    assert stored[-1]["type"] == "execution:paused"
    kinds = [(e["type"], e["data"].get("blockId")) for e in stored]
    assert ("block:completed", "lead") in kinds and ("block:started", "ask") in kinds
    assert ("block:completed", "ask") not in kinds


# -- refusals that change nothing --------------------------------------------------------


async def test_resume_input_failing_the_schema_is_422_with_the_problems_and_changes_nothing(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"schema-{unique}"))
    execution_id = await execute(on_a, f"schema-{unique}", {"what": "y"})
    before = await paused(on_a, execution_id)

    response = await resume(on_b, execution_id, input={"approved": "yes", "note": 3})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_input"
    assert sorted(p["path"] for p in error["problems"]) == ["$.input.approved", "$.input.note"]
    assert all(p["message"] for p in error["problems"])

    response = await resume(on_a, execution_id, input={"note": "no answer"})
    assert response.status_code == 422
    assert [p["path"] for p in response.json()["error"]["problems"]] == ["$.input"]
    assert "approved" in response.json()["error"]["problems"][0]["message"]

    response = await resume(on_a, execution_id)  # no input at all: null is not an object
    assert response.status_code == 422

    after = (await on_b.get(f"/api/executions/{execution_id}")).json()
    assert after == before
    # Still resumable.
    response = await resume(on_b, execution_id, input={"approved": True})
    assert response.status_code == 202, response.text
    assert response.json() == {"executionId": execution_id, "status": "running"}
    assert (await finished(on_a, execution_id))["status"] == "completed"
    check_log(await all_events(on_a, execution_id))


async def test_resume_at_another_block_is_409_with_the_status_and_changes_nothing(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"where-{unique}"))
    execution_id = await execute(on_a, f"where-{unique}", {})
    before = await paused(on_a, execution_id)
    for wrong in ("lead", "nope"):
        response = await resume(on_b, execution_id, blockId=wrong, input={"approved": True})
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["status"] == "paused"
        assert error["pausedAt"] == "ask"
    assert (await on_a.get(f"/api/executions/{execution_id}")).json() == before
    response = await resume(on_b, execution_id, blockId="ask", input={"approved": False})
    assert response.status_code == 202, response.text
    assert (await finished(on_a, execution_id))["status"] == "completed"


async def test_resume_of_a_running_or_finished_execution_is_409_with_its_status(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"busy-{unique}", lead_ms=1_500))
    execution_id = await execute(on_a, f"busy-{unique}", {})
    for client in (on_a, on_b):
        response = await resume(client, execution_id, input={"approved": True})
        assert response.status_code == 409, response.text
        assert response.json()["error"]["status"] == "running"
    await paused(on_a, execution_id)
    assert (await resume(on_a, execution_id, input={"approved": False})).status_code == 202
    assert (await finished(on_a, execution_id))["status"] == "completed"
    for client in (on_a, on_b):
        response = await resume(client, execution_id, input={"approved": True})
        assert response.status_code == 409, response.text
        assert response.json()["error"]["status"] == "completed"
    response = await resume(on_a, "ex_nope", input={"approved": True})
    assert response.status_code == 404


# -- concurrent resumes ----------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_of_fifty_concurrent_resumes_exactly_one_is_accepted(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], unique: str
) -> None:
    on_a, on_b = clients
    await put(on_a, approval_workflow(f"race-{unique}", words=20))
    execution_id = await execute(on_a, f"race-{unique}", {})
    before = await paused(on_a, execution_id)
    # Half through the process that paused, half through the other one.
    answers = await asyncio.gather(
        *(
            resume(on_a if i % 2 else on_b, execution_id, input={"approved": True, "note": str(i)})
            for i in range(50)
        )
    )
    statuses = sorted(response.status_code for response in answers)
    assert statuses == [202] + [409] * 49, statuses
    for response in answers:
        if response.status_code == 409:
            assert response.json()["error"]["status"] in ("running", "completed"), response.text
    winner = next(i for i, r in enumerate(answers) if r.status_code == 202)

    assert (await finished(on_b, execution_id))["status"] == "completed"
    log = await all_events(on_b, execution_id)
    check_log(log)
    resumed = of_type(log, "execution:resumed")
    assert len(resumed) == 1
    assert resumed[0]["id"] == before["lastEventId"] + 1
    assert resumed[0]["data"] == {
        "blockId": "ask",
        "input": {"approved": True, "note": str(winner)},
    }
    assert of_type(log, "execution:completed")[0]["data"]["output"] == {
        "done": {"approved": True, "note": str(winner)}
    }
    assert len(of_type(log, "execution:paused")) == 1


# -- streams that stay open through the pause ------------------------------------------


@pytest.mark.parametrize(
    ("stream_on", "resume_on"),
    [("a", "a"), ("a", "b"), ("b", "a")],
    ids=["stream-and-resume-on-the-runner", "resume-elsewhere", "stream-elsewhere"],
)
async def test_a_stream_opened_before_the_pause_carries_the_resumed_run_to_the_end(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
    unique: str,
    stream_on: str,
    resume_on: str,
) -> None:
    on_a, on_b = clients
    by_name = {"a": on_a, "b": on_b}
    workflow_id = f"open-{stream_on}{resume_on}-{unique}"
    # The lead block gives a reader on B time to attach before the pause.
    await put(on_a, approval_workflow(workflow_id, lead_ms=600, words=30, tps=100))
    url = f"/api/workflows/{workflow_id}/execute"
    async with on_a.stream("POST", url, json={"input": {}}, headers=SSE) as started:
        execution_id = started.headers["x-execution-id"]
        reader = by_name[stream_on]
        stream_url = f"/api/executions/{execution_id}/stream"
        async with reader.stream("GET", stream_url, headers=SSE) as opened:
            response = started if stream_on == "a" else opened
            follower = Follower(response)
            await follower.until(lambda f: f.event == "block:started")
            snapshot = (await on_a.get(f"/api/executions/{execution_id}")).json()
            assert snapshot["status"] == "running", "the reader attached after the pause"

            pause = await follower.until_event("execution:paused")
            await follower.until(is_ping)
            await follower.until(is_ping)
            await paused(on_a, execution_id)
            answer = await resume(by_name[resume_on], execution_id, input={"approved": True})
            assert answer.status_code == 202, answer.text
            resumed = await follower.until_event("execution:resumed")
            assert resumed.json["id"] == pause.json["id"] + 1
            view = await follower.to_the_end()

    check_log(view)
    assert view[-1]["type"] == "execution:completed"
    assert len(of_type(view, "execution:resumed")) == 1
    chunks = "".join(e["data"]["text"] for e in of_type(view, "block:chunk"))
    assert chunks == " ".join(f"w{i}" for i in range(30))
    assert view == await all_events(on_b, execution_id)


# -- resuming elsewhere, after a restart -------------------------------------------------


async def test_resume_through_another_process_feeds_the_input_to_downstream_conditions(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    on_a, on_b = clients
    outputs = {}
    for approved in (True, False):
        execution_id = await execute(on_a, "approve-refund", {"amount": 40, "customer": "Zed"})
        snapshot = await paused(on_b, execution_id)
        assert snapshot["pause"]["blockId"] == "review"
        assert snapshot["pause"]["prompt"] == "Refund 40 to Zed?"
        answer = {"approved": approved, "note": "checked"}
        response = await resume(on_b, execution_id, blockId="review", input=answer)
        assert response.status_code == 202, response.text
        done = await finished(on_a, execution_id)
        assert done["status"] == "completed", done
        log = await all_events(on_a, execution_id)
        check_log(log)
        reviewed = [e for e in of_type(log, "block:completed") if e["data"]["blockId"] == "review"]
        assert [e["data"]["output"] for e in reviewed] == [answer]
        skipped = [e["data"]["blockId"] for e in of_type(log, "block:skipped")]
        assert skipped == ([] if approved else ["issue"])
        outputs[approved] = done["output"]
    assert outputs[False] == {}
    assert set(outputs[True]) == {"issue"}
    assert str(outputs[True]["issue"]["refunded"]) == "40"
    assert outputs[True]["issue"]["note"] == "checked"


@pytest.mark.timeout(90)
async def test_resume_works_after_the_process_that_paused_was_restarted(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = {"FLOWCAST_REDIS_URL": valkey.url}
    first = FlowcastServer(data_dir=tmp_path / "one", env=env)
    await first.start()
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=20) as client:
            execution_id = await execute(client, "approve-refund", {"amount": 7})
            before = await paused(client, execution_id)
    finally:
        # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
        assert await first.stop() in (0, -signal.SIGTERM), first.logs()
    assert "Application shutdown complete." in first.logs()

    again = FlowcastServer(data_dir=tmp_path / "one", env=env)
    await again.start()
    try:
        async with httpx.AsyncClient(base_url=again.url, timeout=20) as client:
            assert (await client.get(f"/api/executions/{execution_id}")).json() == before
            response = await resume(client, execution_id, input={"approved": False})
            assert response.status_code == 202, response.text
            done = await finished(client, execution_id)
            log = await all_events(client, execution_id)
    finally:
        await again.stop()
    assert done["status"] == "completed", done
    assert done["output"] == {}
    check_log(log)
    assert [e["data"]["blockId"] for e in of_type(log, "block:skipped")] == ["issue"]
    assert of_type(log, "execution:resumed")[0]["id"] == before["lastEventId"] + 1
    # The draft computed before the restart is reused, not run again.
    drafted = [e for e in of_type(log, "block:completed") if e["data"]["blockId"] == "draft"]
    assert len(drafted) == 1 and drafted[0]["id"] < before["lastEventId"]


# -- approval timeout and a resume racing the end of the pausing task ---------------------


async def test_an_unanswered_approval_fails_the_execution_with_approval_timeout(
    quick: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=quick.url, timeout=20) as client:
        await put(client, approval_workflow(f"late-{unique}", timeout_seconds=1))
        execution_id = await execute(client, f"late-{unique}", {})
        pause = await paused(client, execution_id)
        done = await finished(client, execution_id, timeout=15)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "approval_timeout"
        log = await all_events(client, execution_id)
        check_log(log)
        assert log[-1]["type"] == "execution:failed"
        assert log[-1]["id"] == pause["lastEventId"] + 1
        response = await resume(client, execution_id, input={"approved": True})
        assert response.status_code == 409
        assert response.json()["error"]["status"] == "failed"


async def test_an_answered_approval_does_not_time_out_later(
    quick: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=quick.url, timeout=20) as client:
        # The resumed run outlives the deadline: the janitor must leave it alone.
        await put(
            client, approval_workflow(f"intime-{unique}", words=40, tps=20, timeout_seconds=1)
        )
        execution_id = await execute(client, f"intime-{unique}", {})
        await paused(client, execution_id)
        assert (await resume(client, execution_id, input={"approved": True})).status_code == 202
        done = await finished(client, execution_id)
        assert done["status"] == "completed", done
        check_log(await all_events(client, execution_id))


@pytest.mark.timeout(90)
async def test_a_resume_that_arrives_as_the_pause_is_stored_runs_to_the_end(
    quick: FlowcastServer, unique: str
) -> None:
    """Resumes fired from the moment the live ``execution:paused`` arrives, on the process
    that is still finishing the paused run: the accepted one must own its run (lease
    renewed, cancel reachable), not be forgotten by the task that paused."""
    async with httpx.AsyncClient(base_url=quick.url, timeout=20) as client:
        # The resumed run lasts three leases: a run nobody renews is taken over.
        await put(client, approval_workflow(f"seam-{unique}", words=60, tps=20))
        for _ in range(3):
            url = f"/api/workflows/seam-{unique}/execute"
            async with client.stream("POST", url, json={"input": {}}, headers=SSE) as response:
                execution_id = response.headers["x-execution-id"]
                follower = Follower(response)
                await follower.until_event("execution:paused")
                async with asyncio.timeout(10):
                    while True:
                        answer = await resume(client, execution_id, input={"approved": True})
                        if answer.status_code == 202:
                            break
                        assert answer.status_code == 409, answer.text
                view = await follower.to_the_end()
            assert view[-1]["type"] == "execution:completed", view[-1]
            check_log(view)
            assert view == await all_events(client, execution_id)


# -- a buffer outage on the resume path ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_buffer_outage_after_a_resume_degrades_to_live_delivery(
    tmp_path: Path, unique: str
) -> None:
    # Durable: the outage is the fault here, not writes the AOF had not taken yet.
    valkey = ValkeyServer(data_dir=tmp_path / "valkey", durable=True)
    await valkey.start()
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_SSE_PING_SECONDS": "0.5"},
    )
    words = 150
    try:
        await server.start()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, approval_workflow(f"dark-{unique}", words=words, tps=50))
            url = f"/api/workflows/{f'dark-{unique}'}/execute"
            async with client.stream("POST", url, json={"input": {}}, headers=SSE) as response:
                execution_id = response.headers["x-execution-id"]
                follower = Follower(response)
                await follower.until_event("execution:paused")
                await follower.until(is_ping)
                await paused(client, execution_id)
                answer = await resume(client, execution_id, input={"approved": True})
                assert answer.status_code == 202, answer.text
                await follower.until(lambda f: f.event == "block:chunk" and "w4 " in f.data)
                valkey.kill()
                # Shown live only under ids Redis reserved (SPEC §5 as amended in step
                # 15); the rest wait in memory and reach the same stream once it is back.
                await hold_for(40 / 50, "Valkey down while 40 chunks are emitted")
                await valkey.start()
                view = await follower.to_the_end()
            assert view[-1]["type"] == "execution:completed"
            check_log(view)
            chunks = "".join(e["data"]["text"] for e in of_type(view, "block:chunk"))
            assert chunks == " ".join(f"w{i}" for i in range(words))

            done = await finished(client, execution_id, timeout=30)
            assert done["status"] == "completed"
            assert done["lastEventId"] == view[-1]["id"]
            stored = await all_events(client, execution_id)
            assert stored == view, "the backlog was not stored after the outage"
    finally:
        await server.stop()
        await valkey.stop()
