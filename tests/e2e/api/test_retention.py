"""Retention end to end: once a finished execution's keys expire, the sweeper deletes its
values too, and the values route stops serving them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import put, within
from tests.support.logcheck import check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import collect

DEADLINE_SECONDS = 20.0


@pytest.fixture
async def short_retention(tmp_path: Path, valkey: ValkeyServer) -> AsyncIterator[FlowcastServer]:
    flowcast = FlowcastServer(
        data_dir=tmp_path / "server",
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"rt{uuid.uuid4().hex[:8]}",
            "FLOWCAST_RETENTION_SECONDS": "1",
            "FLOWCAST_SWEEP_SECONDS": "0.3",
            "FLOWCAST_LARGE_VALUE_BYTES": "100000",
        },
    )
    await flowcast.start()
    yield flowcast
    await flowcast.stop()


async def test_values_of_an_expired_execution_are_swept_and_no_longer_served(
    short_retention: FlowcastServer, redis: Redis
) -> None:
    server = short_retention
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        workflow = {
            "id": "short-lived",
            "blocks": [{"id": "big", "type": "payload", "config": {"bytes": 500_000}}],
        }
        await put(client, workflow)
        response, frames = await collect(
            client, "/api/workflows/short-lived/execute", method="POST", json={}
        )
        assert response.status_code == 200
        execution_id = response.headers["x-execution-id"]
        envelopes = check_view(frames)
        check_log(envelopes)
        ref = envelopes[-1]["data"]["output"]["big"]
        assert ref["$ref"] == "value"
        values_dir = server.data_dir / "values" / execution_id
        # Right after the end (well within the 1 s retention) the value is there.
        assert (values_dir / ref["id"]).is_file()
        url = f"/api/executions/{execution_id}/values/{ref['id']}"
        assert (await client.get(url)).status_code == 200

        prefix = server.env["FLOWCAST_REDIS_PREFIX"]
        keys = [f"{prefix}:{{{execution_id}}}:{name}" for name in ("events", "meta", "dropped")]

        async def gone() -> bool:
            return not await redis.exists(*keys) and not values_dir.exists()

        if not await within(gone, DEADLINE_SECONDS, every=0.05):
            raise AssertionError(
                f"after {DEADLINE_SECONDS}s: keys {await redis.exists(*keys)}, "
                f"values dir exists {values_dir.exists()}"
            )

        missing = await client.get(url)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "execution_not_found"
        assert (await client.get(f"/api/executions/{execution_id}")).status_code == 404
