"""Executing workflows over HTTP: SSE framing, ids, replay on a second connection."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.support.api import all_events, put, streaming_workflow, wait_finished
from tests.support.logcheck import check_log, check_view
from tests.support.sse import collect, events


async def test_execute_with_event_stream_accept_streams_the_whole_execution(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"talk-{unique}"))
    response, frames = await collect(
        client,
        f"/api/workflows/talk-{unique}/execute",
        method="POST",
        json={"input": {"name": "ada"}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    execution_id = response.headers["x-execution-id"]
    envelopes = check_view(frames)
    check_log(envelopes)
    assert envelopes[0]["data"] == {"input": {"name": "ada"}, "queuedMs": 0}
    assert {e["executionId"] for e in envelopes} == {execution_id}
    assert {e["workflowId"] for e in envelopes} == {f"talk-{unique}"}
    chunks = [e["data"]["text"] for e in envelopes if e["type"] == "block:chunk"]
    assert "".join(chunks) == " ".join(f"w{i}" for i in range(30))
    assert envelopes[-1]["type"] == "execution:completed"
    assert envelopes[-1]["data"]["output"] == {"done": {"who": "ada"}}
    for envelope in envelopes:
        assert envelope["ts"].endswith("Z") and len(envelope["ts"]) == 24


async def test_every_frame_has_id_event_and_one_compact_data_line(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"frames-{unique}", words=5))
    _, frames = await collect(
        client, f"/api/workflows/frames-{unique}/execute", method="POST", json={"input": {}}
    )
    for frame in frames:
        lines = frame.raw.decode().split("\n")
        assert [line.split(":", 1)[0] for line in lines] == ["id", "event", "data"]
        assert ": " not in frame.data.split('"data"')[0]  # compact JSON, no spaces


async def test_execute_without_event_stream_accept_answers_202_and_the_stream_replays_it(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"later-{unique}", words=20, tps=200))
    response = await client.post(
        f"/api/workflows/later-{unique}/execute", json={"input": {"name": "b"}}
    )
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "running"
    assert body["streamUrl"] == f"/api/executions/{body['executionId']}/stream"
    assert body["streamToken"]
    # A second connection replays from the start and follows the live tail to the end.
    _, frames = await collect(client, body["streamUrl"])
    envelopes = check_view(frames)
    check_log(envelopes)
    assert envelopes[-1]["type"] == "execution:completed"


async def test_two_clients_on_one_live_execution_see_the_same_events_once(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"pair-{unique}", words=40, tps=200))
    started = (await client.post(f"/api/workflows/pair-{unique}/execute", json={})).json()
    url = started["streamUrl"]
    first, second = await asyncio.gather(collect(client, url), collect(client, url))
    a = check_view(first[1])
    b = check_view(second[1])
    check_log(a)
    assert a == b


async def test_stream_resumes_after_last_event_id_without_duplicates(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"resume-{unique}", words=40, tps=200))
    started = (await client.post(f"/api/workflows/resume-{unique}/execute", json={})).json()
    url = started["streamUrl"]
    seen: list[Any] = []
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        async for frame in events(response):
            seen.append(frame)
            if len(seen) == 7:
                break
    last = seen[-1].id
    _, rest = await collect(client, url, headers={"Last-Event-ID": last})
    envelopes = check_view(seen + rest)
    check_log(envelopes)
    # The query parameter works the same when there is no header.
    _, tail = await collect(client, f"{url}?lastEventId=3")
    assert check_view(tail, after=3) == envelopes[3:]


async def test_stream_at_the_terminal_event_answers_204_and_past_it_gets_the_terminal(
    client: httpx.AsyncClient, unique: str
) -> None:
    """A cursor past the stored terminal event saw ids that were never stored: it gets
    the terminal event, never a bare 204 (SPEC §5; step 15 fault review, F1)."""
    await put(client, streaming_workflow(f"end-{unique}", words=3))
    started = (await client.post(f"/api/workflows/end-{unique}/execute", json={})).json()
    snapshot = await wait_finished(client, started["executionId"])
    last = snapshot["lastEventId"]
    response = await client.get(started["streamUrl"], headers={"Last-Event-ID": str(last)})
    assert response.status_code == 204
    response, frames = await collect(
        client, started["streamUrl"], headers={"Last-Event-ID": str(last + 5)}
    )
    assert response.status_code == 200
    assert [(frame.id, frame.event) for frame in frames] == [(str(last), "execution:completed")]
    _, frames = await collect(
        client, started["streamUrl"], headers={"Last-Event-ID": str(last - 1)}
    )
    assert [frame.id for frame in frames] == [str(last)]


async def test_malformed_cursor_is_400(client: httpx.AsyncClient, unique: str) -> None:
    await put(client, streaming_workflow(f"cursor-{unique}", words=3))
    started = (await client.post(f"/api/workflows/cursor-{unique}/execute", json={})).json()
    for bad in ("-1", "abc", "1.5", "9" * 40):
        response = await client.get(started["streamUrl"], headers={"Last-Event-ID": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["code"] == "invalid_cursor"
    response = await client.get(f"{started['streamUrl']}?lastEventId=x")
    assert response.status_code == 400


async def test_events_page_and_snapshot_describe_the_stored_log(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"page-{unique}", words=25))
    started = (await client.post(f"/api/workflows/page-{unique}/execute", json={})).json()
    execution_id = started["executionId"]
    snapshot = await wait_finished(client, execution_id)
    assert snapshot["id"] == execution_id
    assert snapshot["workflowId"] == f"page-{unique}"
    assert snapshot["status"] == "completed"
    assert snapshot["output"] == {"done": {"who": None}}
    assert snapshot["firstRetainedEventId"] == 1
    assert snapshot["createdAt"] <= snapshot["updatedAt"]
    page = (await client.get(f"/api/executions/{execution_id}/events?after=2&limit=5")).json()
    assert [e["id"] for e in page["events"]] == [3, 4, 5, 6, 7]
    assert page["nextAfter"] == 7
    assert page["lastEventId"] == snapshot["lastEventId"]
    assert page["status"] == "completed"
    check_log(await all_events(client, execution_id))
    for query in ("after=-1", "limit=0", "limit=100000", "after=x"):
        response = await client.get(f"/api/executions/{execution_id}/events?{query}")
        assert response.status_code == 400, query


async def test_unknown_execution_and_workflow_are_404(client: httpx.AsyncClient) -> None:
    for url in (
        "/api/executions/ex_nope",
        "/api/executions/ex_nope/events",
        "/api/executions/ex_nope/stream",
    ):
        response = await client.get(url)
        assert response.status_code == 404, url
        assert response.json()["error"]["code"] == "execution_not_found"
    response = await client.post("/api/workflows/nope/execute", json={})
    assert response.status_code == 404


async def test_a_client_that_disconnects_does_not_cancel_the_execution(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"leave-{unique}", words=30, tps=100))
    headers = {"Accept": "text/event-stream"}
    async with client.stream(
        "POST", f"/api/workflows/leave-{unique}/execute", json={}, headers=headers
    ) as response:
        execution_id = response.headers["x-execution-id"]
        async for frame in events(response):
            if frame.event == "block:chunk":
                break
    snapshot = await wait_finished(client, execution_id)
    assert snapshot["status"] == "completed"
    check_log(await all_events(client, execution_id))


async def test_failing_block_ends_the_execution_with_execution_failed(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow = {
        "id": f"fails-{unique}",
        "blocks": [
            {"id": "boom", "type": "fail", "config": {"message": "no {{ input.what }}"}},
            {"id": "after", "type": "transform", "config": {"value": 1}},
        ],
        "edges": [{"from": "boom", "to": "after"}],
    }
    await put(client, workflow)
    _, frames = await collect(
        client,
        f"/api/workflows/fails-{unique}/execute",
        method="POST",
        json={"input": {"what": "luck"}},
    )
    envelopes = check_view(frames)
    check_log(envelopes)
    assert envelopes[-1]["type"] == "execution:failed"
    assert envelopes[-1]["data"]["error"]["blockId"] == "boom"
    assert envelopes[-1]["data"]["error"]["message"] == "no luck"
    snapshot = (await client.get(f"/api/executions/{envelopes[0]['executionId']}")).json()
    assert snapshot["status"] == "failed"
    assert snapshot["error"]["blockId"] == "boom"


async def test_executions_list_filters_by_workflow_and_status(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"listed-{unique}", words=2))
    ids = []
    for _ in range(3):
        started = (await client.post(f"/api/workflows/listed-{unique}/execute", json={})).json()
        ids.append(started["executionId"])
    for execution_id in ids:
        await wait_finished(client, execution_id)
    listed = (
        await client.get(f"/api/executions?workflowId=listed-{unique}&status=completed")
    ).json()
    assert [e["id"] for e in listed["executions"]] == ids[::-1]
    limited = (await client.get(f"/api/executions?workflowId=listed-{unique}&limit=2")).json()
    assert len(limited["executions"]) == 2
    assert (await client.get("/api/executions?status=bogus")).status_code == 400
