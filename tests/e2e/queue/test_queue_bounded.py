"""What the queue keeps in Redis is its backlog, nothing of what it ran (SPEC §14
"Bounded": queue memory proportional to the backlog; nothing grows with executions ever
run or workers ever started). 150 one-block executions go through an API replica that
runs no work and a worker, then 150 more through a second worker that replaced the
first: once each batch ended, every key under the queue's hash tag is the same size,
and no line, delivery or waiting tenant is left."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from lib.execution.control import QUEUE_MAXLEN
from tests.support.api import put, quick_workflow, wait_finished
from tests.support.servers import FlowcastServer, ValkeyServer, authed, env_on

BATCH = 150


async def queue_keys(redis: Redis, prefix: str) -> dict[str, int]:
    """Each key of the queue (its ``{queue}`` and ``{control}:queue`` keys) and its
    element count."""
    sizes: dict[str, int] = {}
    for pattern in (f"{prefix}:{{queue}}:*", f"{prefix}:{{control}}:queue"):
        async for raw in redis.scan_iter(match=pattern, count=1000):
            name = raw.decode()
            kind = (await redis.type(name)).decode()
            count: Any = {
                "zset": redis.zcard,
                "hash": redis.hlen,
                "stream": redis.xlen,
                "set": redis.scard,
                "list": redis.llen,
            }.get(kind)
            sizes[name] = int(await count(name)) if count else 1
    return sizes


async def run_batch(api: FlowcastServer, worker: FlowcastServer) -> None:
    await worker.start()
    try:
        async with authed(api) as client:
            answers = await asyncio.gather(
                *(client.post("/api/workflows/q/execute", json={"input": {}}) for _ in range(BATCH))
            )
            assert all(answer.status_code == 202 for answer in answers), answers[0].text
            for answer in answers:
                ended = await wait_finished(client, answer.json()["executionId"], timeout=60)
                assert ended["status"] == "completed", ended
    finally:
        await worker.stop()


@pytest.mark.timeout(180)
async def test_the_queue_keeps_its_backlog_and_nothing_of_what_it_ran(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey, max_running_per_tenant="4")
    prefix = env["FLOWCAST_REDIS_PREFIX"]
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    await api.start()
    redis = Redis.from_url(valkey.url)
    try:
        async with authed(api) as client:
            await put(client, quick_workflow("q"))
        worker = {**env, "FLOWCAST_WORKER_SLOTS": "4"}
        await run_batch(api, FlowcastServer(data_dir=tmp_path / "w1", env=worker))
        after_one = await queue_keys(redis, prefix)
        await run_batch(api, FlowcastServer(data_dir=tmp_path / "w2", env=worker))
        after_two = await queue_keys(redis, prefix)
    finally:
        await redis.aclose()
        await api.stop()
    # No line, no delivery, no waiting tenant: the fair clock and weights (per tenant,
    # not per execution) and the wake-up stream, capped at QUEUE_MAXLEN (approximately:
    # by whole nodes of 100 entries).
    wake, fair = f"{prefix}:{{control}}:queue", Keys(prefix).fair
    assert set(after_two) <= {wake, fair}, after_two
    assert after_two.get(fair) == after_one.get(fair), (after_one, after_two)
    assert after_two.get(wake, 0) <= QUEUE_MAXLEN + 100, after_two
