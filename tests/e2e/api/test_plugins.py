"""Python plugin blocks, loaded by a real server from FLOWCAST_PLUGINS."""

from __future__ import annotations

from pathlib import Path

import httpx

from lib.workflows.blocks.base import idempotency_key
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer
from tests.support.sse import collect


async def test_plugin_blocks_from_flowcast_plugins_run_and_stream(
    valkey_url: str, tmp_path: Path
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey_url,
            "FLOWCAST_PLUGINS": "tests.support.plugins",
            "FLOWCAST_REDIS_PREFIX": "plugins",
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            workflow = {
                "id": "loud",
                "blocks": [
                    {
                        "id": "say",
                        "type": "python",
                        "config": {"name": "shout", "args": {"text": "{{ input.text }}"}},
                    }
                ],
            }
            assert (await client.put("/api/workflows/loud", json=workflow)).status_code == 201
            unknown = {**workflow, "id": "quiet"}
            unknown["blocks"] = [{"id": "say", "type": "python", "config": {"name": "whisper"}}]
            response = await client.put("/api/workflows/quiet", json=unknown)
            assert response.status_code == 422
            assert "whisper" in response.text
            _, frames = await collect(
                client,
                "/api/workflows/loud/execute",
                method="POST",
                json={"input": {"text": "hello there"}},
            )
        envelopes = check_view(frames)
        check_log(envelopes)
        chunks = [e["data"]["text"] for e in envelopes if e["type"] == "block:chunk"]
        assert chunks == ["HELLO ", "THERE "]
        output = envelopes[-1]["data"]["output"]["say"]
        assert output == {"words": 2, "execution": envelopes[0]["executionId"]}
    finally:
        await server.stop()


async def test_plugin_handlers_see_their_attempt_and_idempotency_key(
    valkey_url: str, tmp_path: Path
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey_url,
            "FLOWCAST_PLUGINS": "tests.support.plugins",
            "FLOWCAST_REDIS_PREFIX": "plugins-attempts",
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            flaky = {"type": "python", "retry": {"attempts": 3, "backoffMs": 0}}
            workflow = {
                "id": "flaky",
                "blocks": [
                    {**flaky, "id": "one", "config": {"name": "flaky", "args": {"words": 1}}},
                    {**flaky, "id": "two", "config": {"name": "flaky", "args": {"words": 1}}},
                ],
            }
            assert (await client.put("/api/workflows/flaky", json=workflow)).status_code == 201
            _, frames = await collect(
                client, "/api/workflows/flaky/execute", method="POST", json={"input": None}
            )
        envelopes = check_view(frames)
        check_log(envelopes)
        execution_id = envelopes[0]["executionId"]
        output = envelopes[-1]["data"]["output"]
        for block_id in ("one", "two"):
            key = idempotency_key(execution_id, block_id)
            assert output[block_id] == {"attempt": 2, "idempotencyKey": key}
            of_block = [e for e in envelopes if e["data"].get("blockId") == block_id]
            started = [e["data"]["attempt"] for e in of_block if e["type"] == "block:started"]
            assert started == [1, 2]
            (failed,) = [e["data"] for e in of_block if e["type"] == "block:failed"]
            assert failed["error"]["message"] == f"attempt 1 with key {key} fails"
            chunks = [e["data"]["text"] for e in of_block if e["type"] == "block:chunk"]
            assert chunks == ["try1-w0 ", "try2-w0 "]
        assert output["one"]["idempotencyKey"] != output["two"]["idempotencyKey"]
    finally:
        await server.stop()
