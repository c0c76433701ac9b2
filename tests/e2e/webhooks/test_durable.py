"""Webhook deliveries are durable (SPEC §15): a replica SIGKILLed after an execution's
terminal event is stored, before its delivery is made (or while it is being made), has
it delivered by the replica that comes up after it, under the same ``webhook-id``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import put, quick_workflow, until
from tests.support.receiver import HANG, receiving
from tests.support.servers import FlowcastServer, ValkeyServer, env_on


def replicas(valkey: ValkeyServer, root: Path) -> tuple[FlowcastServer, FlowcastServer]:
    """Two replicas sharing a Redis prefix of their own and the secret key (the webhook
    secrets are encrypted with it); B is started by the test."""
    env = env_on(
        valkey,
        http_allow_private="true",
        webhook_retry_seconds="0.3,0.3,0.3",
        webhook_timeout_seconds="1.5",
        secret_key="webhooks-test-" + "k" * 32,
    )
    return FlowcastServer(data_dir=root / "a", env=env), FlowcastServer(
        data_dir=root / "b", env=env
    )


async def delivered(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    async def settled() -> dict[str, Any] | None:
        view = (await client.get(f"/api/executions/{execution_id}")).json()
        hooks = view.get("webhooks") or []
        return hooks[0] if hooks and hooks[0]["state"] == "delivered" else None

    found: dict[str, Any] = await until(settled, f"{execution_id}'s webhook delivered", 40)
    return found


async def start(client: httpx.AsyncClient, workflow_id: str, url: str) -> str:
    await put(client, quick_workflow(workflow_id))
    answer = await client.post(
        f"/api/workflows/{workflow_id}/execute", json={"input": {}, "webhook": {"url": url}}
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["executionId"])


@pytest.mark.timeout(90)
async def test_a_replica_killed_right_after_the_terminal_event_has_it_delivered_by_the_next(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    a, b = replicas(valkey, tmp_path)
    await a.start()
    try:
        async with (
            receiving() as receiver,
            httpx.AsyncClient(base_url=a.url) as client,
            Redis.from_url(valkey.url) as redis,
        ):
            eid = await start(client, "hook-kill", receiver.url)
            meta = f"{a.env['FLOWCAST_REDIS_PREFIX']}:{{{eid}}}:meta"

            async def completed() -> bool:
                return await redis.hget(meta, "status") == b"completed"

            # Read from the store itself, every few ms: A dies a moment after the
            # terminal event is stored, well before its deliverer looks (about 0.2 s on).
            await until(completed, f"{eid} completed", 20, every=0.005)
            await a.stop(signal.SIGKILL)
            await b.start()
            async with httpx.AsyncClient(base_url=b.url) as on_b:
                hook = await delivered(on_b, eid)
            ids = {request.headers["webhook-id"] for request in receiver.received}
            assert ids == {hook["webhookId"]}, ids
            assert hook["webhookId"].startswith(f"{eid}.")
    finally:
        await a.stop(signal.SIGKILL)
        await b.stop()


@pytest.mark.timeout(90)
async def test_a_replica_killed_during_an_attempt_has_it_made_again_with_the_same_id(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    a, b = replicas(valkey, tmp_path)
    await a.start()
    try:
        # The first attempt is never answered: A dies with it in flight.
        async with (
            receiving(HANG, then=200) as receiver,
            httpx.AsyncClient(base_url=a.url) as client,
        ):
            eid = await start(client, "hook-kill-mid", receiver.url)
            [first] = await receiver.wait_for(1)
            await a.stop(signal.SIGKILL)
            await b.start()
            async with httpx.AsyncClient(base_url=b.url) as on_b:
                hook = await delivered(on_b, eid)
            later = receiver.received[1:]
            assert later, "B made no attempt"
            assert {r.headers["webhook-id"] for r in later} == {first.headers["webhook-id"]}
            assert hook["webhookId"] == first.headers["webhook-id"]
            assert hook["lastAnswer"]["status"] == 200
    finally:
        await a.stop(signal.SIGKILL)
        await b.stop()
