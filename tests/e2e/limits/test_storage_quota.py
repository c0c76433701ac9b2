"""Each tenant's Redis footprint stays within FLOWCAST_TENANT_STORAGE_BYTES (SPEC §8
"Shares per tenant"; issue 24, row 6: one tenant added 1.07 GB in under a minute).

Real processes: a Flowcast server on the session's Valkey with a quota of a few hundred
KB, two tenants, runs whose inputs and outputs are tens of KB each. Past the quota a new
execution and a new workflow are refused 429 ``storage_quota`` with the figures; what
runs already finishes with every event stored; another tenant is unaffected; deleting
a workflow, or finished runs expiring, gives the room back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.backend import Keys
from tests.support.api import all_events, execute, put, until, wait_finished
from tests.support.servers import (
    ALPHA,
    BETA,
    ValkeyServer,
    authed,
    prefix,
    serving,
    serving_pair,
)

QUOTA = 400_000
SIZE = 20_000  # the text each run echoes: its input, its block's output, its output


def echo(workflow_id: str, *, delay_ms: int = 0) -> dict[str, Any]:
    """Echo ``input.s`` as the run's output (after ``delay_ms``, when given)."""
    blocks: list[dict[str, Any]] = [
        {"id": "echo", "type": "transform", "config": {"value": "{{ input.s }}"}}
    ]
    edges: list[dict[str, str]] = []
    if delay_ms:
        blocks.insert(0, {"id": "wait", "type": "delay", "config": {"ms": delay_ms}})
        edges.append({"from": "wait", "to": "echo"})
    return {"id": workflow_id, "blocks": blocks, "edges": edges}


def padded(workflow_id: str, size: int) -> dict[str, Any]:
    """A workflow of about ``size`` bytes (a constant it would output)."""
    block = {"id": "pad", "type": "transform", "config": {"value": "p" * size}}
    return {"id": workflow_id, "blocks": [block], "edges": []}


async def run_echo(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/api/workflows/echo/execute", json={"input": {"s": "e" * SIZE}})


async def fill_with_runs(client: httpx.AsyncClient) -> httpx.Response:
    """Run ``echo`` to its end again and again until a start is refused; the refusal."""
    for _ in range(40):
        response = await run_echo(client)
        if response.status_code != 202:
            return response
        await wait_finished(client, response.json()["executionId"])
    raise AssertionError("40 runs of 80 KB each were never refused")


async def kept_in_redis(redis: Redis, own: str, tenant: str, execution_ids: list[str]) -> int:
    """What the tenant's data takes in Redis (MEMORY USAGE): its workflows, its
    executions' keys and the workflow versions stored (only this tenant ran any)."""
    keys = Keys(own)
    names = [keys.workflows(tenant), keys.secrets(tenant)]
    names += [name for eid in execution_ids for name in keys.execution(eid)]
    names += [name.decode() async for name in redis.scan_iter(match=f"{own}:workflow-version:*")]
    return sum([await redis.memory_usage(name, samples=0) or 0 for name in names])


def assert_over_quota(response: httpx.Response) -> dict[str, Any]:
    """A 429 storage_quota with the figures in the body and the message."""
    assert response.status_code == 429, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "storage_quota"
    assert error["limitBytes"] == QUOTA
    assert error["usedBytes"] + error["neededBytes"] > QUOTA
    assert str(error["usedBytes"]) in error["message"] and str(QUOTA) in error["message"]
    assert int(response.headers["Retry-After"]) >= 1
    return error


@pytest.mark.timeout(120)
async def test_a_tenant_past_its_storage_quota_is_refused_new_work_while_its_runs_finish(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    """Past its quota, tenant A's new execution and new workflow are refused (429
    storage_quota, with what it keeps and the limit) and nothing is written; what A
    keeps in Redis (MEMORY USAGE) is then within 10% of the figure and of the quota;
    A's run accepted before finishes with all its events stored; tenant B still starts
    runs; once A deletes a workflow it may start again."""
    own = prefix()
    async with (
        serving(
            valkey,
            tmp_path,
            api_keys=f"{ALPHA},{BETA}",
            tenant_storage_bytes=str(QUOTA),
            redis_prefix=own,
        ) as server,
        authed(server, ALPHA) as alpha,
        authed(server, BETA) as beta,
    ):
        await put(alpha, echo("echo"))
        await put(alpha, echo("slow", delay_ms=4000))
        await put(alpha, padded("pad", 150_000))
        await put(beta, echo("echo"))
        slow = await execute(alpha, "slow", {"s": "s" * SIZE})

        refused = await fill_with_runs(alpha)
        error = assert_over_quota(refused)
        assert (await alpha.get(f"/api/executions/{slow}")).json()["status"] == "running"
        listed = (await alpha.get("/api/executions?limit=100")).json()
        ids = [row["id"] for row in listed["executions"]]
        kept = await kept_in_redis(redis, own, tenant_of_key(ALPHA), ids)
        assert abs(error["usedBytes"] - kept) < kept / 10, (error, kept)
        assert kept < QUOTA * 1.1, kept
        # A refused start counted nothing: its ledger names no more things after it
        # (the figures of runs still ending may move meanwhile: they finish).
        ledger, _sizes = Keys(own).quota(tenant_of_key(ALPHA))
        counted = await redis.zcard(ledger)
        assert_over_quota(await run_echo(alpha))
        assert await redis.zcard(ledger) == counted
        assert_over_quota(await alpha.put("/api/workflows/more", json=padded("more", 40_000)))
        assert (await alpha.get("/api/workflows/more")).status_code == 404
        # A refused start created nothing (the same runs; a run still ending meanwhile
        # changes its own row's status and times, and one did in a clean-clone run).
        again = (await alpha.get("/api/executions?limit=100")).json()
        assert [row["id"] for row in again["executions"]] == ids, (again, listed)

        # Another tenant is not held back by A's quota.
        other = await execute(beta, "echo", {"s": "b" * SIZE})
        assert (await wait_finished(beta, other))["status"] == "completed"

        # A's run accepted before the quota was reached ends, and every event is stored.
        assert (await wait_finished(alpha, slow))["status"] == "completed"
        events = await all_events(alpha, slow)
        assert [event["id"] for event in events] == list(range(1, len(events) + 1))
        assert events[-1]["type"] == "execution:completed"
        assert events[-1]["data"]["output"] == {"echo": "s" * SIZE}

        # Deleting a workflow gives its room back.
        assert (await alpha.delete("/api/workflows/pad")).status_code == 204
        again = await run_echo(alpha)
        assert again.status_code == 202, (again.text, error)


@pytest.mark.timeout(120)
async def test_a_tenant_past_its_storage_quota_may_start_again_once_its_runs_expire(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Finished runs count until their retention (FLOWCAST_RETENTION_SECONDS) ends:
    then the room they took comes back without anything deleted."""
    async with (
        serving(
            valkey,
            tmp_path,
            api_keys=ALPHA,
            tenant_storage_bytes=str(QUOTA),
            retention_seconds="3",
        ) as server,
        authed(server, ALPHA) as alpha,
    ):
        await put(alpha, echo("echo"))
        assert_over_quota(await fill_with_runs(alpha))

        async def accepted() -> str | None:
            response = await run_echo(alpha)
            return str(response.json()["executionId"]) if response.status_code == 202 else None

        started = await until(accepted, "a start accepted once the runs expired", 60, every=0.25)
        assert (await wait_finished(alpha, started))["status"] == "completed"


@pytest.mark.timeout(60)
async def test_a_start_refused_for_another_cap_leaves_nothing_counted(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    """The storage figure a start counts in its round trip is taken back when the
    start is refused after it (here by FLOWCAST_MAX_EXECUTIONS_PER_TENANT): the ledger
    holds the running execution, its workflow version and the workflow, nothing of the
    refused start."""
    own = prefix()
    async with (
        serving(
            valkey,
            tmp_path,
            api_keys=ALPHA,
            redis_prefix=own,
            max_executions_per_tenant="1",
        ) as server,
        authed(server, ALPHA) as alpha,
    ):
        await put(alpha, echo("slow", delay_ms=3000))
        slow = await execute(alpha, "slow", {"s": "s"})
        response = await alpha.post("/api/workflows/slow/execute", json={"input": {"s": "t"}})
        assert response.json()["error"]["code"] == "too_many_executions"
        _ledger, sizes = Keys(own).quota(tenant_of_key(ALPHA))
        counted = {name.decode() for name in await redis.hkeys(sizes)}
        assert {name for name in counted if not name.startswith("v:")} == {
            "total", "w:slow", f"e:{slow}",
        }  # fmt: skip
        await wait_finished(alpha, slow)


@pytest.mark.timeout(180)
async def test_racing_puts_of_one_workflow_leave_the_stored_one_counted(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    """A large and a small PUT of the same workflow fired at the same instant at two
    replicas, for 30 workflow ids: whichever version stays stored is the one counted, so
    the ledger's figure of each workflow is the size of the version stored, and what
    the tenant keeps stays within its quota."""
    own = prefix()
    async with (
        serving_pair(
            valkey, tmp_path, api_keys=ALPHA, tenant_storage_bytes=str(QUOTA), redis_prefix=own
        ) as (a, b),
        authed(a, ALPHA) as via_a,
        authed(b, ALPHA) as via_b,
    ):
        for index in range(60):
            wid = f"race{index % 30}"
            big, small = (via_a, via_b) if index % 2 else (via_b, via_a)
            await asyncio.gather(
                big.put(f"/api/workflows/{wid}", json=padded(wid, 100_000)),
                small.put(f"/api/workflows/{wid}", json=padded(wid, 10)),
            )
        tenant = tenant_of_key(ALPHA)
        stored = await redis.hgetall(Keys(own).workflows(tenant))
        figures = await redis.hgetall(Keys(own).quota(tenant)[1])
    kept = {wid.decode(): len(raw) + len(wid) for wid, raw in stored.items()}
    counted = {name.decode()[2:]: int(size) for name, size in figures.items() if name != b"total"}
    assert counted == kept
    assert sum(kept.values()) <= QUOTA, kept


@pytest.mark.xfail(
    strict=True,
    reason="a start is admitted on its figure at admission (input, run state, 4 KiB); "
    "what it stores after is never refused, so 30 starts at the same instant, each "
    "admitted at ~5 KB and storing ~100 KB of outputs, kept 9.1 MB against 400 KB (23x)",
)
@pytest.mark.timeout(120)
async def test_many_starts_at_the_same_instant_keep_the_tenant_near_its_quota(
    valkey: ValkeyServer, tmp_path: Path, redis: Redis
) -> None:
    """30 starts fired at the same instant by a tenant whose ledger is nearly empty, each
    run storing ~100 KB after its admission (a 100,000-character output after a short
    delay): what the tenant keeps in Redis once they ended stays within twice its quota."""
    own = prefix()
    async with (
        serving(
            valkey, tmp_path, api_keys=ALPHA, tenant_storage_bytes=str(QUOTA), redis_prefix=own
        ) as server,
        authed(server, ALPHA) as alpha,
    ):
        blocks = [
            {"id": "wait", "type": "delay", "config": {"ms": 1500}},
            {"id": "grow", "type": "transform", "config": {"value": "{{ 'x' * 100000 }}"}},
        ]
        await put(
            alpha, {"id": "grow", "blocks": blocks, "edges": [{"from": "wait", "to": "grow"}]}
        )
        answers = await asyncio.gather(
            *(alpha.post("/api/workflows/grow/execute", json={"input": {}}) for _ in range(30))
        )
        started = [answer.json()["executionId"] for answer in answers if answer.status_code == 202]
        for execution_id in started:
            await wait_finished(alpha, execution_id)
        kept = await kept_in_redis(redis, own, tenant_of_key(ALPHA), started)
    print(f"{len(started)} of 30 admitted; kept {kept} bytes, quota {QUOTA}")
    assert kept < 2 * QUOTA, f"{len(started)} of 30 admitted; kept {kept} bytes"
