"""The ``llm`` cap across replicas while only the slot holder loses Redis (its own link
cut; the other replica keeps Redis): the holder cannot renew its slot, the slot's lease
ends in Redis and the next caller is granted. The cut-off holder must have stopped its
call by then, as an owner cut off stops showing events (F1): at most ``maxConcurrency``
calls in flight across all replicas (SPEC §2.1), with a cap of 1.

Found by the step 15 fault review (F4 as it stands: a holder stops when its renewal
finds the slot gone, but goes on calling when the renewal cannot reach Redis). With
retries, the stopped holder's next attempt cannot reach Redis either: it used to call
under its process's cap only after a lease (the long-outage fallback of ``Slots``),
beside the caller granted the slot; now it waits until Redis answers (SPEC §2.1).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.support.api import put, until
from tests.support.faults import replica
from tests.support.llm import FakeLLM, Reply
from tests.support.logcheck import TERMINAL
from tests.support.proxy import TcpLink
from tests.support.servers import ValkeyServer

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as fake:
        yield fake


def llm_workflow(workflow_id: str, attempts: int) -> dict[str, Any]:
    block = {
        "id": "draft",
        "type": "llm",
        "retry": {"attempts": attempts, "backoffMs": 10},
        "config": {"model": "fake-1", "messages": [{"role": "user", "content": "hi"}]},
    }
    return {"id": workflow_id, "blocks": [block], "edges": []}


async def execute(client: httpx.AsyncClient, workflow_id: str) -> str:
    started = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert started.status_code == 202, started.text
    return str(started.json()["executionId"])


async def ended(clients: list[httpx.AsyncClient], execution_id: str) -> str:
    """Poll any replica that answers until the log ends; its terminal event's type."""

    async def the_end() -> str | None:
        for client in clients:
            try:
                page = await client.get(f"/api/executions/{execution_id}/events?limit=1000")
            except httpx.TransportError:
                continue
            if page.status_code == 200:
                events = page.json()["events"]
                if events and events[-1]["type"] in TERMINAL:
                    return str(events[-1]["type"])
        return None

    found: str = await until(the_end, "a terminal event", None, every=0.05)
    return found


async def in_line(valkey: ValkeyServer, count: int) -> None:
    queue = Keys("fc").slots("default")[1]
    redis = Redis.from_url(valkey.url)
    try:

        async def queued() -> bool:
            return int(await redis.zcard(queue)) >= count

        await until(queued, f"{count} callers in line", None)
    finally:
        await redis.aclose()


@pytest.mark.parametrize("attempts", [1, 5])
async def test_a_holder_cut_from_redis_does_not_call_beside_the_next_one(
    llm: FakeLLM, own_valkey: ValkeyServer, tmp_path: Path, attempts: int
) -> None:
    llm.reset()
    env = {
        "FLOWCAST_LLM_PROVIDERS": json.dumps(
            {"default": {"baseUrl": llm.url, "maxConcurrency": 1}}
        ),
        "FLOWCAST_LEASE_SECONDS": "2",
    }
    async with TcpLink(own_valkey.port) as link:
        holder = replica(own_valkey, tmp_path, "holder", FLOWCAST_REDIS_URL=link.url, **env)
        other = replica(own_valkey, tmp_path, "other", **env)
        await asyncio.gather(holder.start(), other.start())
        try:
            async with (
                httpx.AsyncClient(base_url=holder.url, timeout=60) as on_holder,
                httpx.AsyncClient(base_url=other.url, timeout=60) as on_other,
            ):
                await put(on_other, llm_workflow("cut", attempts))
                # The holder's call streams for about 5 s (two and a half leases): had
                # it gone on past the cut, it would still stream when the slot lapses.
                # The next one's call (the other's) streams as long, for the holder's
                # next attempt to be caught if it called beside it; the holder's call
                # after that, once Redis answers again, comes last and answers at once.
                long = Reply(pieces=[f"w{i} " for i in range(25)], piece_delay=0.2)
                llm.script(long, long)
                first = await execute(on_holder, "cut")
                await llm.wait_in_flight(1, timeout=20)
                second = await execute(on_other, "cut")
                await asyncio.wait_for(in_line(own_valkey, 1), 20)
                link.cut()
                outcome = await asyncio.wait_for(ended([on_other], second), 60)
                link.heal()
                outcomes = [await asyncio.wait_for(ended([on_other, on_holder], first), 60)]
                outcomes.append(outcome)
        finally:
            await asyncio.gather(holder.stop(), other.stop())
    print(f"\npeak {llm.max_in_flight}, {len(llm.requests)} calls, outcomes {outcomes}")
    assert llm.max_in_flight == 1, f"{llm.max_in_flight} calls in flight with a cap of 1"
    # Stopped by its own clock, not by luck: the holder never reached Redis meanwhile.
    assert "a held slot could not be renewed in time" in holder.logs()
