"""``Idempotency-Key`` on execute, resume and cancel (SPEC §3), on real processes: a
repeat returns the first outcome and starts nothing, also when the repeats arrive at
once and through two processes; a reused key with another body is 422."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SESSION_PREFIX
from tests.support.api import (
    all_events,
    of_type,
    paused_execution,
    put,
    streaming_workflow,
    wait_finished,
)
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer, authed, serving
from tests.support.sse import collect

SCHEMA = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}},
}


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "ask", "type": "approval", "config": {"prompt": "ok?", "schema": SCHEMA}},
            {"id": "then", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [{"from": "ask", "to": "then"}],
    }


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def new_key() -> str:
    return f"key-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
async def other(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    """A second process on the session's Valkey, next to the session's server."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("idem-other"),
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": SESSION_PREFIX},
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def on_other(other: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=other.url, timeout=40) as client:
        yield client


async def listed(client: httpx.AsyncClient, workflow_id: str) -> list[str]:
    response = await client.get(f"/api/executions?workflowId={workflow_id}&limit=200")
    assert response.status_code == 200, response.text
    return [execution["id"] for execution in response.json()["executions"]]


# -- execute -----------------------------------------------------------------------------


async def test_execute_repeated_with_the_same_key_and_body_returns_the_first_execution(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"idem-{unique}"
    await put(client, streaming_workflow(workflow_id, words=3))
    key = new_key()
    url = f"/api/workflows/{workflow_id}/execute"
    first = await client.post(url, json={"input": {"n": 1}}, headers=keyed(key))
    assert first.status_code == 202, first.text
    execution_id = first.json()["executionId"]
    await wait_finished(client, execution_id)
    again = await client.post(url, json={"input": {"n": 1}}, headers=keyed(key))
    assert again.status_code == 202, again.text
    assert again.json()["executionId"] == execution_id
    assert again.json()["status"] == first.json()["status"]
    assert again.json()["streamUrl"] == first.json()["streamUrl"]
    # The same JSON serialized another way (spacing, key order) is the same request.
    respaced = await client.post(
        url,
        content=b'{ "input" : { "n" : 1 } }',
        headers={**keyed(key), "content-type": "application/json"},
    )
    assert respaced.status_code == 202, respaced.text
    assert respaced.json()["executionId"] == execution_id
    assert await listed(client, workflow_id) == [execution_id]


async def test_execute_with_the_same_key_and_another_body_is_422_and_starts_nothing(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"reuse-{unique}"
    await put(client, streaming_workflow(workflow_id, words=3))
    key = new_key()
    url = f"/api/workflows/{workflow_id}/execute"
    first = await client.post(url, json={"input": {"n": 1}}, headers=keyed(key))
    assert first.status_code == 202
    for body in ({"input": {"n": 2}}, {}, {"input": {"n": 1}, "inlineFiles": True}):
        response = await client.post(url, json=body, headers=keyed(key))
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "idempotency_key_reused"
    # The key is bound to the workflow too.
    await put(client, streaming_workflow(f"reuse2-{unique}", words=3))
    response = await client.post(
        f"/api/workflows/reuse2-{unique}/execute", json={"input": {"n": 1}}, headers=keyed(key)
    )
    assert response.status_code == 422
    assert await listed(client, workflow_id) == [first.json()["executionId"]]
    assert await listed(client, f"reuse2-{unique}") == []


async def test_execute_with_different_keys_starts_different_executions(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"keys-{unique}"
    await put(client, streaming_workflow(workflow_id, words=3))
    url = f"/api/workflows/{workflow_id}/execute"
    answers = [
        await client.post(url, json={"input": {}}, headers=keyed(new_key())) for _ in range(3)
    ]
    ids = {answer.json()["executionId"] for answer in answers}
    assert len(ids) == 3
    assert set(await listed(client, workflow_id)) == ids


@pytest.mark.timeout(90)
async def test_twenty_concurrent_repeats_of_execute_through_two_processes_start_one(
    client: httpx.AsyncClient, on_other: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"burst-{unique}"
    await put(client, streaming_workflow(workflow_id, words=10, tps=50))
    key = new_key()
    url = f"/api/workflows/{workflow_id}/execute"
    answers = await asyncio.gather(
        *(
            (client if i % 2 else on_other).post(url, json={"input": {"x": 1}}, headers=keyed(key))
            for i in range(20)
        )
    )
    assert [answer.status_code for answer in answers] == [202] * 20, [a.text for a in answers]
    ids = {answer.json()["executionId"] for answer in answers}
    assert len(ids) == 1
    (execution_id,) = ids
    assert await listed(client, workflow_id) == [execution_id]
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    check_log(await all_events(client, execution_id))
    assert await listed(on_other, workflow_id) == [execution_id]


async def test_execute_as_a_stream_repeated_with_a_key_streams_the_same_execution(
    client: httpx.AsyncClient, on_other: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"sse-{unique}"
    await put(client, streaming_workflow(workflow_id, words=20, tps=100))
    key = new_key()
    url = f"/api/workflows/{workflow_id}/execute"
    body = {"input": {"name": "k"}}
    (first, first_frames), (second, second_frames) = await asyncio.gather(
        collect(client, url, method="POST", json=body, headers=keyed(key)),
        collect(on_other, url, method="POST", json=body, headers=keyed(key)),
    )
    assert first.status_code == second.status_code == 200
    execution_id = first.headers["x-execution-id"]
    assert second.headers["x-execution-id"] == execution_id
    one, two = check_view(first_frames), check_view(second_frames)
    check_log(one)
    assert one == two == await all_events(client, execution_id)
    assert {envelope["executionId"] for envelope in one} == {execution_id}
    assert await listed(client, workflow_id) == [execution_id]
    # A later plain repeat with the key answers 202 with the same id.
    response = await client.post(url, json=body, headers=keyed(key))
    assert response.status_code == 202
    assert response.json()["executionId"] == execution_id


async def test_an_execute_error_is_replayed_for_the_same_key(
    client: httpx.AsyncClient, unique: str
) -> None:
    key = new_key()
    url = f"/api/workflows/later-{unique}/execute"
    first = await client.post(url, json={"input": {}}, headers=keyed(key))
    assert first.status_code == 404
    # The workflow exists now, but the key's outcome was the 404.
    await put(client, streaming_workflow(f"later-{unique}", words=3))
    again = await client.post(url, json={"input": {}}, headers=keyed(key))
    assert (again.status_code, again.json()) == (first.status_code, first.json())
    assert await listed(client, f"later-{unique}") == []


async def test_a_keyed_execute_refused_429_is_tried_again_by_its_repeat_once_there_is_room(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    """A client that follows ``Retry-After`` with the same key gets its execution once the
    tenant has room, not the 429 replayed for the key's whole lifetime; two repeats at
    once still start one execution. (Noticed in step 15: the 429 was remembered.)"""
    async with (
        serving(valkey, tmp_path, max_executions_per_tenant="1") as server,
        authed(server) as client,
    ):
        await put(client, approval_workflow(f"cap-{unique}"))
        blocker = await paused_execution(client, f"cap-{unique}")
        key, url = new_key(), f"/api/workflows/cap-{unique}/execute"
        refused = await client.post(url, json={"input": {}}, headers=keyed(key))
        assert refused.status_code == 429, refused.text
        again = await client.post(url, json={"input": {}}, headers=keyed(key))
        assert again.status_code == 429, again.text

        cancelled = await client.post(f"/api/executions/{blocker}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        await wait_finished(client, blocker)
        repeats = await asyncio.gather(
            *(client.post(url, json={"input": {}}, headers=keyed(key)) for _ in range(5))
        )
        assert {r.status_code for r in repeats} == {202}, [r.text for r in repeats]
        ids = {r.json()["executionId"] for r in repeats}
        assert len(ids) == 1, ids
        assert await listed(client, f"cap-{unique}") == [*ids, blocker]


async def test_an_idempotency_key_that_is_not_printable_or_too_long_is_400(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"badkey-{unique}", words=3))
    url = f"/api/workflows/badkey-{unique}/execute"
    response = await client.post(url, json={}, headers=keyed("k" * 256))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_idempotency_key"
    assert await listed(client, f"badkey-{unique}") == []


# -- resume ------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_resume_repeated_with_a_key_returns_the_first_outcome_even_concurrently(
    client: httpx.AsyncClient, on_other: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"resume-{unique}"
    await put(client, approval_workflow(workflow_id))
    execution_id = await paused_execution(client, workflow_id)
    key = new_key()
    url = f"/api/executions/{execution_id}/resume"
    body = {"input": {"approved": True}}
    answers = await asyncio.gather(
        *(
            (client if i % 2 else on_other).post(url, json=body, headers=keyed(key))
            for i in range(20)
        )
    )
    assert [answer.status_code for answer in answers] == [202] * 20, [a.text for a in answers]
    assert {answer.text for answer in answers} == {answers[0].text}
    assert answers[0].json() == {"executionId": execution_id, "status": "running"}
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    # After the end, the key still answers the original 202; without it, 409.
    late = await on_other.post(url, json=body, headers=keyed(key))
    assert (late.status_code, late.json()) == (202, answers[0].json())
    plain = await client.post(url, json=body)
    assert plain.status_code == 409
    other_body = await client.post(url, json={"input": {"approved": False}}, headers=keyed(key))
    assert other_body.status_code == 422
    assert other_body.json()["error"]["code"] == "idempotency_key_reused"
    log = await all_events(client, execution_id)
    check_log(log)
    assert len(of_type(log, "execution:resumed")) == 1


async def test_a_resume_error_is_replayed_identically_for_the_same_key(
    client: httpx.AsyncClient, on_other: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"resume-err-{unique}"
    await put(client, approval_workflow(workflow_id))
    execution_id = await paused_execution(client, workflow_id)
    key = new_key()
    url = f"/api/executions/{execution_id}/resume"
    bad = {"input": {"approved": "maybe"}}
    first = await client.post(url, json=bad, headers=keyed(key))
    assert first.status_code == 422, first.text
    assert first.json()["error"]["code"] == "invalid_input"
    assert [p["path"] for p in first.json()["error"]["problems"]] == ["$.input.approved"]
    for repeat in (client, on_other):
        again = await repeat.post(url, json=bad, headers=keyed(key))
        assert again.status_code == first.status_code
        assert again.content == first.content
    # The same key cannot be used for a good answer; another key can.
    reused = await client.post(url, json={"input": {"approved": True}}, headers=keyed(key))
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert (await client.get(f"/api/executions/{execution_id}")).json()["status"] == "paused"
    good = await client.post(url, json={"input": {"approved": True}}, headers=keyed(new_key()))
    assert good.status_code == 202, good.text
    assert (await wait_finished(client, execution_id))["status"] == "completed"


async def test_a_conflict_outcome_is_replayed_for_the_same_key(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"resume-409-{unique}"
    await put(client, approval_workflow(workflow_id))
    execution_id = await paused_execution(client, workflow_id)
    url = f"/api/executions/{execution_id}/resume"
    body = {"blockId": "then", "input": {"approved": True}}
    key = new_key()
    first = await client.post(url, json=body, headers=keyed(key))
    assert first.status_code == 409, first.text
    again = await client.post(url, json=body, headers=keyed(key))
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert (await client.get(f"/api/executions/{execution_id}")).json()["status"] == "paused"


# -- cancel ------------------------------------------------------------------------------


async def test_cancel_repeated_with_a_key_returns_the_first_outcome_and_cancels_once(
    client: httpx.AsyncClient, on_other: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"cancel-{unique}"
    await put(client, approval_workflow(workflow_id))
    execution_id = await paused_execution(client, workflow_id)
    key = new_key()
    url = f"/api/executions/{execution_id}/cancel"
    answers = await asyncio.gather(
        *((client if i % 2 else on_other).post(url, headers=keyed(key)) for i in range(20))
    )
    assert [answer.status_code for answer in answers] == [202] * 20, [a.text for a in answers]
    assert {answer.content for answer in answers} == {answers[0].content}
    assert answers[0].json()["executionId"] == execution_id
    assert (await wait_finished(client, execution_id))["status"] == "cancelled"
    late = await client.post(url, headers=keyed(key))
    assert (late.status_code, late.content) == (202, answers[0].content)
    plain = await client.post(url)
    assert plain.status_code == 409
    assert plain.json()["error"]["status"] == "cancelled"
    log = await all_events(client, execution_id)
    check_log(log)
    assert len(of_type(log, "execution:cancelled")) == 1
    assert log[-1]["type"] == "execution:cancelled"
