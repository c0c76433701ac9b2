"""A tenant's cap on unfinished executions (FLOWCAST_MAX_EXECUTIONS_PER_TENANT) holds
exactly when executes reach two replicas at the same instant, keyed repeats among them
(SPEC §5): as many 202s as the cap, one execution per key, a 429 that leaves nothing
behind (no admission, no lease entry, no listing), and room again once they finish.

The step 15 second fault review: the start sends its admission, lease entry, listing
and workflow version in one batch before start.lua; this attacks that batch at the cap.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from app.auth import DEFAULT_TENANT
from lib.backend import Keys
from tests.support.api import put, wait_finished
from tests.support.servers import ValkeyServer, authed, serving_pair

CAP = 3


@pytest.mark.timeout(90)
async def test_concurrent_executes_on_two_replicas_admit_exactly_the_cap(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    workflow = {"id": "slow", "blocks": [{"id": "d", "type": "delay", "config": {"ms": 30000}}]}
    url = "/api/workflows/slow/execute"
    key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
    async with (
        serving_pair(valkey, tmp_path, max_executions_per_tenant=str(CAP)) as (a, b),
        authed(a) as on_a,
        authed(b) as on_b,
    ):
        keys = Keys(a.env["FLOWCAST_REDIS_PREFIX"])
        redis = Redis.from_url(valkey.url)
        try:
            await put(on_a, workflow)
            # 20 plain executes and 6 repeats of one key, half on each replica, at once.
            requests = [
                (on_a if i % 2 else on_b).post(
                    url, json={"input": {}}, headers=key if i < 6 else {}
                )
                for i in range(26)
            ]
            answers = await asyncio.gather(*requests)
            statuses = sorted({answer.status_code for answer in answers})
            assert statuses in ([202, 429], [202]), [a.text for a in answers]
            admitted = {a.json()["executionId"] for a in answers if a.status_code == 202}
            assert len(admitted) == CAP, (len(admitted), [a.text for a in answers])
            keyed = {a.json()["executionId"] for a in answers[:6] if a.status_code == 202}
            assert len(keyed) <= 1, keyed
            tenant = DEFAULT_TENANT
            assert await redis.zcard(keys.running(tenant)) == CAP
            assert await redis.zcard(keys.leases) == CAP
            listed = {member.decode() for member in await redis.zrange(keys.index(tenant), 0, -1)}
            assert listed == admitted, listed - admitted

            for execution_id in admitted:
                cancelled = await on_a.post(f"/api/executions/{execution_id}/cancel")
                assert cancelled.status_code == 202, cancelled.text
            for execution_id in admitted:
                await wait_finished(on_b, execution_id, timeout=30)
            # Nothing leaked: the tenant has its whole cap again, on either replica.
            again = await asyncio.gather(
                *((on_a if i % 2 else on_b).post(url, json={"input": {}}) for i in range(CAP))
            )
            assert [answer.status_code for answer in again] == [202] * CAP, [
                answer.text for answer in again
            ]
            for answer in again:
                await on_a.post(f"/api/executions/{answer.json()['executionId']}/cancel")
        finally:
            await redis.aclose()
