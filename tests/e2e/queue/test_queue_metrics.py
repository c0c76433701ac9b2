"""The queue's figures on ``/metrics`` (SPEC §10, §14), the signals an autoscaler reads:
depth by state, the oldest queued execution's age, the wait from accepted to started,
worker slots used and total, reclaims and stale deliveries."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.e2e.api.test_observability import metric
from tests.support.api import (
    delay_workflow,
    figures_where,
    put,
    quick_workflow,
    until,
    wait_finished,
)
from tests.support.servers import FlowcastServer, ValkeyServer, authed, serving

TENANT = "default"  # the tenant of a server without API keys


async def execute(client: httpx.AsyncClient, workflow_id: str) -> dict[str, Any]:
    answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert answer.status_code == 202, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def figures(client: httpx.AsyncClient) -> str:
    answer = await client.get("/metrics")
    assert answer.status_code == 200
    return answer.text


def queue_key(server: FlowcastServer, name: str) -> str:
    return f"{server.env['FLOWCAST_REDIS_PREFIX']}:{{queue}}:{name}"


@pytest.mark.timeout(60)
async def test_metrics_show_the_backlog_its_age_the_waits_and_the_slots(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1", worker_slots="3") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=1500))
            await put(client, quick_workflow("quick"))
            blocker = await execute(client, "slow")
            assert blocker["status"] == "running"
            before = time.monotonic()
            queued = [await execute(client, "quick") for _ in range(2)]
            assert [q["status"] for q in queued] == ["queued", "queued"]

            text = await figures_where(
                client,
                lambda t: metric(t, "flowcast_queue_depth", 'state="queued"') == 2,
                "the two queued",
            )
            waited = time.monotonic() - before
            assert metric(text, "flowcast_queue_depth", 'state="running"') == 1
            # The oldest waited no longer than since just before it was queued (a
            # probe of this test's own clock; Redis's and ours are the same here).
            assert 0 < metric(text, "flowcast_queue_oldest_seconds") <= waited + 0.05
            assert metric(text, "flowcast_worker_slots") == 3
            assert metric(text, "flowcast_worker_slots_used") == 1

            ids = [blocker["executionId"], *(q["executionId"] for q in queued)]
            for eid in ids:
                assert (await wait_finished(client, eid))["status"] == "completed"
            text = await figures_where(
                client,
                lambda t: metric(t, "flowcast_queue_depth", 'state="queued"') == 0,
                "none queued",
            )
            assert metric(text, "flowcast_queue_oldest_seconds") == 0
            # One observation per start, each the queuedMs its execution:started says.
            waits = [await queued_ms(client, eid) for eid in ids]
            assert waits[0] == 0 and all(ms > 0 for ms in waits[1:])
            assert metric(text, "flowcast_queue_wait_seconds_count") == 3
            assert metric(text, "flowcast_queue_wait_seconds_sum") == pytest.approx(
                sum(waits) / 1000
            )
            assert metric(text, "flowcast_queue_stale_deliveries_total") == 0
            assert metric(text, "flowcast_queue_reclaims_total") == 0


async def queued_ms(client: httpx.AsyncClient, execution_id: str) -> int:
    log = (await client.get(f"/api/executions/{execution_id}/events")).json()["events"]
    assert log[0]["type"] == "execution:started"
    waited: int = log[0]["data"]["queuedMs"]
    return waited


@pytest.mark.timeout(60)
async def test_a_delivery_of_an_execution_cancelled_meanwhile_counts_as_stale(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=30_000))
            await put(client, quick_workflow("quick"))
            blocker = await execute(client, "slow")
            gone = (await execute(client, "quick"))["executionId"]
            assert (await client.post(f"/api/executions/{gone}/cancel")).status_code == 202
            assert (await wait_finished(client, gone))["status"] == "cancelled"
            # The fault: the cancel's dequeue was lost, so the line still holds it.
            await redis.zadd(queue_key(server, f"queued:{TENANT}"), {gone: 0})
            await redis.zadd(queue_key(server, "tenants"), {TENANT: 0})
            cancel = await client.post(f"/api/executions/{blocker['executionId']}/cancel")
            assert cancel.status_code == 202
            # Taken, refused by its claim (it is cancelled), dropped; the next one runs.
            after = await execute(client, "quick")
            assert (await wait_finished(client, after["executionId"]))["status"] == "completed"
            text = await figures(client)
            assert metric(text, "flowcast_queue_stale_deliveries_total") == 1
            log = (await client.get(f"/api/executions/{gone}/events")).json()["events"]
            assert [e["type"] for e in log] == ["execution:started", "execution:cancelled"]


@pytest.mark.timeout(60)
async def test_what_a_dead_worker_took_and_never_claimed_is_queued_again_and_counted(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1", lease_seconds="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=30_000))
            await put(client, quick_workflow("quick"))
            blocker = await execute(client, "slow")
            eid = (await execute(client, "quick"))["executionId"]
            # The fault: a worker took it from the line and died before its claim.
            await redis.zrem(queue_key(server, f"queued:{TENANT}"), eid)
            await redis.zrem(queue_key(server, "tenants"), TENANT)
            seconds, micros = await redis.time()
            past = seconds * 1000 + micros // 1000 - 1
            await redis.zadd(
                queue_key(server, "taken"), {f"{eid} dead-fence {past} {TENANT}": past}
            )

            async def reclaimed() -> bool:
                return metric(await figures(client), "flowcast_queue_reclaims_total") == 1

            await until(reclaimed, "the delivery queued again", 8)
            cancel = await client.post(f"/api/executions/{blocker['executionId']}/cancel")
            assert cancel.status_code == 202
            assert (await wait_finished(client, eid))["status"] == "completed"
