"""Bad input: every limit answers 4xx with a clear message and changes nothing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from lib.parsing import parse_json
from tests.support.api import put, streaming_workflow, wait_finished, wait_status
from tests.support.servers import FlowcastServer, ValkeyServer


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_a_body_past_the_cap_is_413_with_or_without_content_length(
    client: httpx.AsyncClient, unique: str
) -> None:
    big = b'{"input": "' + b"x" * (11 * 1024 * 1024) + b'"}'
    response = await client.post(
        "/api/workflows/stream-story/execute",
        content=big,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(12):
            yield b" " * (1024 * 1024)

    response = await client.put(
        f"/api/workflows/chunked-{unique}",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    assert (await client.get(f"/api/workflows/chunked-{unique}")).status_code == 404


async def test_inputs_and_workflows_nested_too_deep_are_refused(
    client: httpx.AsyncClient, unique: str
) -> None:
    response = await client.post("/api/workflows/stream-story/execute", json={"input": nested(100)})
    assert response.status_code == 422
    assert "deeper" in response.text
    workflow = streaming_workflow(f"deep-{unique}")
    workflow["blocks"][0]["config"]["value"] = nested(100)
    response = await client.put(f"/api/workflows/deep-{unique}", json=workflow)
    assert response.status_code == 422
    assert "deeper" in response.text
    assert (await client.get(f"/api/workflows/deep-{unique}")).status_code == 404


async def test_very_long_templates_are_refused(client: httpx.AsyncClient, unique: str) -> None:
    workflow = streaming_workflow(f"long-{unique}")
    workflow["blocks"][0]["config"]["value"] = "{{ input }}" + "x" * 70_000
    response = await client.put(f"/api/workflows/long-{unique}", json=workflow)
    assert response.status_code == 422
    assert response.json()["error"]["problems"][0]["path"] == "$.blocks[0].config.value"


async def test_malformed_json_and_wrong_content_types_are_4xx(
    client: httpx.AsyncClient, unique: str
) -> None:
    for content, content_type in [
        (b"{not json", "application/json"),
        (b"\xff\xfe", "application/json"),
        (b"input=1", "application/x-www-form-urlencoded"),
        (b"<xml/>", "text/xml"),
    ]:
        response = await client.post(
            "/api/workflows/stream-story/execute",
            content=content,
            headers={"content-type": content_type},
        )
        assert 400 <= response.status_code < 500, (content, response.status_code)
        assert "error" in response.json()


async def test_unicode_and_path_tricks_in_ids_are_404_not_errors(
    client: httpx.AsyncClient,
) -> None:
    for workflow_id in ("%2e%2e%2fetc", "caf%C3%A9", "%00", "a" * 300, "..%5C..%5Cwin"):
        response = await client.get(f"/api/workflows/{workflow_id}")
        assert response.status_code == 404, workflow_id
        response = await client.get(f"/api/executions/{workflow_id}/values/{workflow_id}")
        assert response.status_code == 404, workflow_id


async def test_huge_headers_are_refused_without_a_server_error(
    client: httpx.AsyncClient,
) -> None:
    try:
        response = await client.get("/api/workflows", headers={"X-Big": "x" * 200_000})
    except httpx.RemoteProtocolError:
        return  # the server closed the connection: also a refusal
    assert 400 <= response.status_code < 500


async def test_a_tenant_past_its_concurrent_executions_gets_429_with_retry_after(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"cap{uuid.uuid4().hex[:6]}",
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "2",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "0",
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            slow = {"id": "slow", "blocks": [{"id": "d", "type": "delay", "config": {"ms": 20000}}]}
            await put(client, slow)
            running = []
            for _ in range(2):
                response = await client.post("/api/workflows/slow/execute", json={})
                assert response.status_code == 202
                running.append(response.json()["executionId"])
            refused = await client.post("/api/workflows/slow/execute", json={})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "too_many_executions"
            assert int(refused.headers["retry-after"]) >= 1
            assert (
                len((await client.get("/api/executions?workflowId=slow")).json()["executions"]) == 2
            )
            assert (await client.post(f"/api/executions/{running[0]}/cancel")).status_code == 202
            await wait_finished(client, running[0])
            response = await client.post("/api/workflows/slow/execute", json={})
            assert response.status_code == 202
    finally:
        await server.stop()


async def test_cursors_too_large_for_the_buffer_are_400_not_503(
    client: httpx.AsyncClient, unique: str
) -> None:
    # Found by the fuzz test: the buffer's Lua printed after + 1 as "1e+14" and Redis
    # refused it as a stream id, so a client's bad cursor came back as a 503.
    await put(client, streaming_workflow(f"cursor-{unique}", words=3))
    started = await client.post(f"/api/workflows/cursor-{unique}/execute", json={})
    execution_id = started.json()["executionId"]
    await wait_finished(client, execution_id)
    events = f"/api/executions/{execution_id}/events"
    largest = 10**14 - 2
    page = await client.get(events, params={"after": largest})
    assert page.status_code == 200, page.text
    assert page.json()["events"] == []
    stream = f"/api/executions/{execution_id}/stream"
    # Far above the log yet still a cursor: the client gets the terminal event alone
    # (SPEC §5: never a bare end; 204 is for a cursor at the terminal id).
    above = await client.get(stream, params={"lastEventId": largest})
    assert above.status_code == 200, above.text
    assert "event: execution:completed" in above.text and above.text.count("\nid: ") <= 1
    for cursor in (largest + 1, 9007199254740989, 999999999999999998):
        response = await client.get(events, params={"after": cursor})
        assert response.status_code == 400, (cursor, response.text)
        assert response.json()["error"]["code"] == "invalid_cursor"
        response = await client.get(stream, headers={"Last-Event-ID": str(cursor)})
        assert response.status_code == 400, (cursor, response.text)


async def test_numbers_and_strings_json_can_carry_but_we_cannot_store_are_422(
    client: httpx.AsyncClient, unique: str
) -> None:
    # Found by the fuzz test: the standard library parses integers of any size and lone
    # surrogates, orjson refuses both, and it did so while the execution was being
    # created: a 500 instead of a 422.
    json = {"content-type": "application/json"}
    workflow_id = f"store-{unique}"
    await put(client, streaming_workflow(workflow_id, words=3))
    for bad in (b"123456789012345678901234567890", b'"\\ud800"'):
        response = await client.post(
            f"/api/workflows/{workflow_id}/execute",
            content=b'{"input": [' + bad + b"]}",
            headers=json,
        )
        assert response.status_code == 422, response.text
        assert "cannot be stored" in response.text
        block = b'{"id": "a", "type": "transform", "config": {"value": ' + bad + b"}}"
        response = await client.put(
            f"/api/workflows/bad-{unique}", content=b'{"blocks": [' + block + b"]}", headers=json
        )
        assert response.status_code == 422, response.text
        assert response.json()["error"]["problems"][0]["path"] == "$"
    assert (await client.get(f"/api/workflows/bad-{unique}")).status_code == 404
    listed = await client.get("/api/executions", params={"workflowId": workflow_id})
    assert listed.json()["executions"] == []

    started = await client.post("/api/workflows/approve-refund/execute", json={"input": {}})
    execution_id = started.json()["executionId"]
    await wait_status(client, execution_id, "paused", timeout=None)
    # The pause's schema allows more properties, so only the encoding can refuse this.
    answer = b'{"input": {"approved": true, "extra": 123456789012345678901234567890}}'
    response = await client.post(
        f"/api/executions/{execution_id}/resume", content=answer, headers=json
    )
    assert response.status_code == 422, response.text
    assert (await client.get(f"/api/executions/{execution_id}")).json()["status"] == "paused"


def test_a_body_parsed_by_orjson_reads_as_the_standard_library_reads_it() -> None:
    """Step 16's review (row 1): the standard library parsed a 10 MB input on the event
    loop in most of a second; orjson takes a fifth of that. What orjson refuses (NaN, a
    lone surrogate) or would read otherwise (an integer past 64 bits, as a float) goes
    to the standard library, so a body means what it meant: a large integer is still
    refused when stored, a NaN still read."""
    for body in (
        b'{"input": {"a": [1, 2.5, "x", null, true], "b": {"c": -0.0}}}',
        b"[123456789012345678901234567890]",
        b"[9223372036854775807, -9223372036854775808]",
        b"[NaN, Infinity]",
        b'["\\ud800"]',
        b'{"a": 1, "a": 2}',
    ):
        assert repr(parse_json(body)) == repr(json.loads(body)), body
    for broken in (b"[1,", b"{'a': 1}", b""):
        with pytest.raises(json.JSONDecodeError):
            parse_json(broken)
