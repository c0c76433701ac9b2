"""The ``llm`` cap across replicas holds through a stalled holder and a store that
comes back empty (SPEC §2.1: at most ``maxConcurrency`` calls per provider in flight
across all replicas), against a fake OpenAI-compatible server that counts the calls in
flight, with a cap of 1.

Found by the step 15 fault review (F4): a holder stalled past its lease (SIGSTOP)
renewed itself back in after the next caller got the freed slot, two calls in flight
(4 of 4); Redis restarted empty forgot the holders and granted a waiter while the old
call still streamed, peak 2 (about half the tries).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.support.api import put, until
from tests.support.faults import crash_and_wipe, replica
from tests.support.llm import FakeLLM, Reply
from tests.support.logcheck import TERMINAL
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.tap import Tap

PROVIDERS = "default"


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as fake:
        yield fake


@pytest.fixture(autouse=True)
def fresh(llm: FakeLLM) -> None:
    llm.reset()


def capped(llm: FakeLLM) -> str:
    return json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})


def llm_workflow(workflow_id: str) -> dict[str, Any]:
    block = {
        "id": "draft",
        "type": "llm",
        "retry": {"attempts": 5, "backoffMs": 10},
        "config": {"model": "fake-1", "messages": [{"role": "user", "content": "hi"}]},
    }
    return {"id": workflow_id, "blocks": [block], "edges": []}


async def execute(client: httpx.AsyncClient, workflow_id: str) -> str:
    started = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert started.status_code == 202, started.text
    return str(started.json()["executionId"])


async def ended(clients: list[httpx.AsyncClient], execution_id: str) -> list[dict[str, Any]]:
    """Poll until the execution's log ends with a terminal event (through any replica
    that answers: a store that came back empty knows it again once its owner wrote
    it back); its events."""

    async def the_end() -> list[dict[str, Any]] | None:
        for client in clients:
            try:
                page = await client.get(f"/api/executions/{execution_id}/events?limit=1000")
            except httpx.TransportError:
                continue
            if page.status_code == 200:
                events: list[dict[str, Any]] = page.json()["events"]
                if events and events[-1]["type"] in TERMINAL:
                    return events
        return None

    found: list[dict[str, Any]] = await until(the_end, "a terminal event", None, every=0.05)
    return found


def one_terminal(events: list[dict[str, Any]]) -> str:
    terminals = [event["type"] for event in events if event["type"] in TERMINAL]
    assert len(terminals) == 1, terminals
    return terminals[0]


async def queued(valkey: ValkeyServer, count: int) -> None:
    """Wait until ``count`` callers stand in the provider's line."""
    queue = Keys("fc").slots(PROVIDERS)[1]
    redis = Redis.from_url(valkey.url)
    try:

        async def in_line() -> bool:
            return int(await redis.zcard(queue)) >= count

        await until(in_line, f"{count} callers in line", None)
    finally:
        await redis.aclose()


@pytest.fixture
async def pair(
    llm: FakeLLM, own_valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[Tap, FlowcastServer, FlowcastServer]]:
    """Replica H (its Redis through a tap) and replica C, both on one Valkey, with a 2 s
    lease: a restart of Valkey on a busy machine stays well within one."""
    env = {"FLOWCAST_LLM_PROVIDERS": capped(llm), "FLOWCAST_LEASE_SECONDS": "2"}
    async with Tap(own_valkey.port) as tap:
        holder = replica(own_valkey, tmp_path, "holder", FLOWCAST_REDIS_URL=tap.url, **env)
        other = replica(own_valkey, tmp_path, "other", **env)
        await asyncio.gather(holder.start(), other.start())
        try:
            yield tap, holder, other
        finally:
            if holder._process is not None:
                os.kill(holder.pid, signal.SIGCONT)  # a failed test may leave it stopped
            await asyncio.gather(holder.stop(), other.stop())


@pytest.mark.timeout(120)
async def test_a_holder_stalled_past_its_lease_does_not_call_beside_the_next_one(
    llm: FakeLLM, pair: tuple[Tap, FlowcastServer, FlowcastServer]
) -> None:
    tap, holder, other = pair
    async with (
        httpx.AsyncClient(base_url=holder.url, timeout=60) as on_holder,
        httpx.AsyncClient(base_url=other.url, timeout=60) as on_other,
    ):
        await put(on_other, llm_workflow("stall"))
        # A first call loads slots.lua into Valkey: H's ask below is then the script
        # itself, not a NOSCRIPT refused before anything is granted.
        warm = await execute(on_holder, "stall")
        await asyncio.wait_for(ended([on_holder], warm), 30)
        llm.reset()
        # H stops the moment its ask for the slot goes out: the grant's reply waits in
        # its socket while its lease ends and the slot goes to C.
        stopped = asyncio.Event()

        def stop() -> None:
            os.kill(holder.pid, signal.SIGSTOP)
            stopped.set()

        tap.when(lambda data: b"acquire" in data and b"{llm:default}" in data, stop)
        llm.script(Reply(pieces=["held ", "by ", "C"], delay=3))
        # H may stop before its 202 goes out (a 202 waits for the first event to be
        # stored while the block already asks for its slot): it answers once it runs.
        answering = asyncio.create_task(execute(on_holder, "stall"))
        await asyncio.wait_for(stopped.wait(), 20)
        stopped_at = time.monotonic()
        second = await execute(on_other, "stall")
        await llm.wait_in_flight(1, timeout=20)  # C's call, after H's lease ended
        print(f"\nC called {time.monotonic() - stopped_at:.2f} s after H stopped")
        os.kill(holder.pid, signal.SIGCONT)
        first = await asyncio.wait_for(answering, 30)
        for execution_id in (first, second):
            events = await asyncio.wait_for(ended([on_other, on_holder], execution_id), 60)
            assert one_terminal(events) == "execution:completed", events[-1]
    assert llm.max_in_flight == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("waiter", ["in line before", "arriving after"])
async def test_a_store_back_empty_grants_no_slot_while_the_old_call_streams(
    llm: FakeLLM,
    own_valkey: ValkeyServer,
    pair: tuple[Tap, FlowcastServer, FlowcastServer],
    waiter: str,
) -> None:
    """Valkey killed and started with no data while H's call streams; C's call waits in
    line when that happens, or asks just after: either way C is granted only once H's
    call stopped (H's renewal finds its slot gone, its attempt is retried after C's)."""
    _tap, holder, other = pair
    async with (
        httpx.AsyncClient(base_url=holder.url, timeout=60) as on_holder,
        httpx.AsyncClient(base_url=other.url, timeout=60) as on_other,
    ):
        await put(on_other, llm_workflow("wiped"))
        # H's call and C's stream 3 s each; H's retried attempt, the last, answers at once.
        long = Reply(pieces=[f"w{i} " for i in range(30)], piece_delay=0.1)
        llm.script(long, long)
        first = await execute(on_holder, "wiped")
        await llm.wait_in_flight(1, timeout=20)
        if waiter == "in line before":
            second = await execute(on_other, "wiped")
            await asyncio.wait_for(queued(own_valkey, 1), 20)
            await crash_and_wipe(own_valkey)
        else:
            await crash_and_wipe(own_valkey)
            await put(on_other, llm_workflow("wiped"))  # the store forgot it too
            second = await execute(on_other, "wiped")
        for execution_id in (first, second):
            events = await asyncio.wait_for(ended([on_other, on_holder], execution_id), 90)
            one_terminal(events)
        print(f"\npeak {llm.max_in_flight}, {len(llm.requests)} calls")
    assert llm.max_in_flight == 1
