"""Webhooks (SPEC §15): signed with Standard Webhooks, retried, stopped by 410, timed
out, never in an execution's way. Receivers are real HTTP servers on 127.0.0.1, so the
server here allows private addresses; the retries are short (the setting)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from redis.asyncio import Redis
from standardwebhooks import Webhook

from tests.support.api import (
    approval_workflow,
    execute,
    put,
    quick_workflow,
    until,
    wait_finished,
    within,
)
from tests.support.receiver import HANG, Received, receiving
from tests.support.servers import FlowcastServer, ValkeyServer, serving

RETRY = "0.3,0.3,0.3"
TIMEOUT_SECONDS = "1.5"


@pytest.fixture(scope="module")
async def hooked(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    async with serving(
        valkey,
        tmp_path_factory.mktemp("webhooks"),
        http_allow_private="true",
        webhook_retry_seconds=RETRY,
        webhook_timeout_seconds=TIMEOUT_SECONDS,
    ) as server:
        yield server


@pytest.fixture
async def client(hooked: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=hooked.url, timeout=20) as http:
        yield http


async def execute_hooked(client: httpx.AsyncClient, workflow_id: str, hook: dict[str, Any]) -> str:
    answer = await client.post(
        f"/api/workflows/{workflow_id}/execute", json={"input": {}, "webhook": hook}
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["executionId"])


async def deliveries_settled(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    """The snapshot's deliveries, once none is pending."""

    async def settled() -> list[dict[str, Any]] | None:
        view = (await client.get(f"/api/executions/{execution_id}")).json()
        hooks: list[dict[str, Any]] = view.get("webhooks") or []
        return hooks if hooks and all(h["state"] != "pending" for h in hooks) else None

    found: list[dict[str, Any]] = await until(settled, f"{execution_id}'s webhooks settled", 30)
    return found


def verified(secret: str, request: Received) -> dict[str, Any]:
    """The payload, as a receiver checks it with the ``standardwebhooks`` package."""
    payload: dict[str, Any] = Webhook(secret).verify(request.body, request.headers)
    return payload


@pytest.mark.timeout(60)
async def test_a_delivery_verifies_with_standardwebhooks_also_after_a_rotation(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"hook-sign-{unique}"
    await put(client, quick_workflow(workflow_id))
    first = (await client.get("/api/webhooks/secret")).json()
    assert first["secret"].startswith("whsec_")
    async with receiving() as receiver:
        eid = await execute_hooked(client, workflow_id, {"url": receiver.url})
        [request] = await receiver.wait_for(1)
        payload = verified(first["secret"], request)
        assert payload["type"] == "execution:completed"
        assert payload["execution"]["id"] == eid
        assert payload["execution"]["status"] == "completed"
        assert request.headers["webhook-id"] == f"{eid}.{payload['id']}"
        assert [h["state"] for h in await deliveries_settled(client, eid)] == ["delivered"]

        rotated = (await client.post("/api/webhooks/secret/rotate")).json()
        assert rotated["secret"] != first["secret"]
        assert rotated["previous"] == first["secret"]
        again = await execute_hooked(client, workflow_id, {"url": receiver.url})
        request = (await receiver.wait_for(2))[1]
        assert len(request.headers["webhook-signature"].split(" ")) == 2
        # A receiver still on the old secret and one already on the new both verify it.
        assert verified(first["secret"], request)["execution"]["id"] == again
        assert verified(rotated["secret"], request)["execution"]["id"] == again
        with pytest.raises(Exception, match=r"(?i)signature"):
            Webhook("whsec_" + "A" * 32).verify(request.body, request.headers)


@pytest.mark.timeout(60)
async def test_a_workflows_webhook_is_retried_after_500s_with_the_same_id_until_delivered(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"hook-retry-{unique}"
    async with receiving(500, 500, then=200) as receiver:
        await put(client, {**quick_workflow(workflow_id), "webhooks": [{"url": receiver.url}]})
        answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
        eid = answer.json()["executionId"]
        requests = await receiver.wait_for(3)
        [hook] = await deliveries_settled(client, eid)
    assert {r.headers["webhook-id"] for r in requests} == {requests[0].headers["webhook-id"]}
    assert requests[0].headers["webhook-id"].startswith(f"{eid}.")
    assert hook["state"] == "delivered" and hook["attempts"] == 3, hook
    assert hook["lastAnswer"]["status"] == 200
    assert hook["event"] == "execution:completed"
    assert hook["webhookId"] == requests[0].headers["webhook-id"]


@pytest.mark.timeout(60)
async def test_410_stops_the_retries(client: httpx.AsyncClient, unique: str) -> None:
    workflow_id = f"hook-gone-{unique}"
    await put(client, quick_workflow(workflow_id))
    async with receiving(410, then=200) as receiver:
        eid = await execute_hooked(client, workflow_id, {"url": receiver.url})
        [hook] = await deliveries_settled(client, eid)
        assert hook["state"] == "failed" and hook["attempts"] == 1, hook
        assert hook["lastAnswer"]["status"] == 410
        # Several retry delays later, nothing more came.
        assert await within(lambda: len(receiver.received) > 1, 4 * 0.3 + 1) is None


@pytest.mark.timeout(60)
async def test_a_receiver_that_never_answers_times_out_and_is_tried_again(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"hook-hang-{unique}"
    await put(client, quick_workflow(workflow_id))
    async with receiving(HANG, then=200) as receiver:
        eid = await execute_hooked(client, workflow_id, {"url": receiver.url})
        requests = await receiver.wait_for(2)
        [hook] = await deliveries_settled(client, eid)
    assert hook["state"] == "delivered" and hook["attempts"] == 2, hook
    assert requests[0].headers["webhook-id"] == requests[1].headers["webhook-id"]


@pytest.mark.timeout(60)
async def test_retries_spent_leave_the_delivery_failed_with_its_last_answer(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"hook-spent-{unique}"
    await put(client, quick_workflow(workflow_id))
    async with receiving(then=503) as receiver:
        eid = await execute_hooked(client, workflow_id, {"url": receiver.url})
        [hook] = await deliveries_settled(client, eid)
        assert len(receiver.received) == 1 + len(RETRY.split(","))
    assert hook["state"] == "failed" and hook["lastAnswer"]["status"] == 503, hook
    assert hook["attempts"] == 1 + len(RETRY.split(","))
    metrics = (await client.get("/metrics")).text
    assert 'flowcast_webhook_deliveries_total{outcome="failed"}' in metrics
    assert "flowcast_webhook_oldest_pending_seconds" in metrics


@pytest.mark.timeout(60)
async def test_a_slow_receiver_does_not_delay_the_execution(
    client: httpx.AsyncClient, unique: str
) -> None:
    """Its started event is delivered while it runs, to a receiver that never answers:
    the run ends as soon as the same run without a webhook (the probe)."""
    workflow_id = f"hook-slow-{unique}"
    workflow = {
        "id": workflow_id,
        "blocks": [{"id": "wait", "type": "delay", "config": {"ms": 300}}],
        "edges": [],
    }
    await put(client, workflow)

    async def run(body: dict[str, Any]) -> float:
        began = time.monotonic()
        answer = await client.post(f"/api/workflows/{workflow_id}/execute", json=body)
        assert answer.status_code == 202, answer.text
        await wait_finished(client, answer.json()["executionId"], timeout=30)
        return time.monotonic() - began

    probe = await run({"input": {}})
    async with receiving(then=HANG) as receiver:
        hook = {"url": receiver.url, "events": ["execution:started", "execution:completed"]}
        slow = await run({"input": {}, "webhook": hook})
        await receiver.wait_for(1)
    # A slow receiver costs its attempt's 1.5 s timeout; the run is not waiting on it.
    assert slow < probe + 1.0, (slow, probe)


@pytest.mark.timeout(60)
async def test_a_private_url_is_refused_at_store_and_execute_unless_allowed(
    server: FlowcastServer, unique: str
) -> None:
    """The session's server does not allow private addresses."""
    workflow_id = f"hook-private-{unique}"
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        refused = await client.put(
            f"/api/workflows/{workflow_id}",
            json={**quick_workflow(workflow_id), "webhooks": [{"url": "http://127.0.0.1:9/x"}]},
        )
        assert refused.status_code == 422, refused.text
        paths = [d["path"] for d in refused.json()["error"]["problems"]]
        assert paths == ["$.webhooks[0].url"], refused.text
        await put(client, quick_workflow(workflow_id))
        for url in ("http://10.0.0.8/x", "http://localhost:9/x", "http://[::1]/x"):
            answer = await client.post(
                f"/api/workflows/{workflow_id}/execute",
                json={"input": {}, "webhook": {"url": url}},
            )
            assert answer.status_code == 422, answer.text
            assert "$.webhook.url" in answer.text
        bad = await client.post(
            f"/api/workflows/{workflow_id}/execute",
            json={"input": {}, "webhook": {"url": "ftp://x.example/", "events": ["nope"]}},
        )
        assert bad.status_code == 422, bad.text
        assert "webhook" in bad.text
        listed = (await client.get("/api/executions", params={"workflowId": workflow_id})).json()
        assert listed["executions"] == []


@pytest.mark.timeout(60)
async def test_a_pause_and_the_end_are_each_delivered_in_event_order(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"hook-pause-{unique}"
    async with receiving() as receiver:
        await put(client, {**approval_workflow(workflow_id), "webhooks": [{"url": receiver.url}]})
        stored = (await client.get(f"/api/workflows/{workflow_id}")).json()
        assert stored["webhooks"][0]["url"] == receiver.url
        eid = await execute(client, workflow_id)
        [paused] = await receiver.wait_for(1)
        assert orjson.loads(paused.body)["type"] == "execution:paused"
        assert orjson.loads(paused.body)["execution"]["status"] == "paused"
        resumed = await client.post(f"/api/executions/{eid}/resume", json={"input": {}})
        assert resumed.status_code == 202, resumed.text
        requests = await receiver.wait_for(2)
        hooks = await deliveries_settled(client, eid)
    assert [orjson.loads(r.body)["type"] for r in requests] == [
        "execution:paused",
        "execution:completed",
    ]
    assert [(h["event"], h["state"]) for h in hooks] == [
        ("execution:paused", "delivered"),
        ("execution:completed", "delivered"),
    ]
    assert len({r.headers["webhook-id"] for r in requests}) == 2


@pytest.mark.timeout(60)
async def test_a_paused_run_cancelled_has_its_cancel_delivered_after_its_pause(
    client: httpx.AsyncClient, unique: str
) -> None:
    """The cancel of a paused run is stored by the cancelling request's process, not by
    a run: it is owed a delivery all the same."""
    workflow_id = f"hook-cancel-{unique}"
    async with receiving() as receiver:
        await put(client, {**approval_workflow(workflow_id), "webhooks": [{"url": receiver.url}]})
        eid = await execute(client, workflow_id)
        await receiver.wait_for(1)
        cancelled = await client.post(f"/api/executions/{eid}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        requests = await receiver.wait_for(2)
        hooks = await deliveries_settled(client, eid)
    assert [orjson.loads(r.body)["type"] for r in requests] == [
        "execution:paused",
        "execution:cancelled",
    ]
    assert orjson.loads(requests[1].body)["execution"]["status"] == "cancelled"
    assert [h["state"] for h in hooks] == ["delivered", "delivered"]


@pytest.mark.timeout(60)
async def test_an_idle_deliverer_asks_redis_nothing_and_a_hint_wakes_it(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    """The deliverer of every process that runs work looked at the outbox four times a
    second (8 Redis commands), webhooks or not. It now waits until the earliest hint or
    delivery is due, or for a wake published with each: idle, it sends nothing; a run's
    webhook is still delivered."""
    async with (
        serving(valkey, tmp_path, http_allow_private="true") as server,
        httpx.AsyncClient(base_url=server.url, timeout=20) as client,
        Redis.from_url(valkey.url) as redis,
    ):
        outbox = f"{server.env['FLOWCAST_REDIS_PREFIX']}:{{webhooks}}"
        heard: list[str] = []
        async with redis.monitor() as monitor:

            async def listen() -> None:
                async for entry in monitor.listen():
                    if outbox in entry["command"]:
                        heard.append(entry["command"])

            listening = asyncio.create_task(listen())
            await asyncio.sleep(2.0)  # the window measured: 16 commands before
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
        assert heard == [], heard
        workflow_id = f"hook-idle-{unique}"
        await put(client, quick_workflow(workflow_id))
        async with receiving() as receiver:
            eid = await execute_hooked(client, workflow_id, {"url": receiver.url})
            [request] = await receiver.wait_for(1)
        assert orjson.loads(request.body)["execution"]["id"] == eid
