"""A keyed ``execute`` whose replica dies half-way (SPEC §3 "Idempotency"): the key and
the execution it names hold together, so a repeat on another replica answers that
execution at once, and no repeat ever starts a second one.

Found by the step 15 fault review (F2): killed between creating the execution and
recording the outcome, a repeat on the other replica waited 30 s for a 409
``idempotency_in_progress``, and a repeat after 60 s started a second execution.

The seam is a proxy between replica A and Valkey (tests/support/tap.py) that holds one
command of A's, so A is killed at an exact point between two of its writes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.idempotency import WAIT_SECONDS
from tests.support.api import all_events, delay_workflow, put, wait_finished
from tests.support.faults import kill_replica, replica
from tests.support.logcheck import check_log
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.tap import Tap

KEY = {"Idempotency-Key": "order-1234"}
BODY = {"input": {"amount": 40}}
WORKFLOW = "slow-order"


class Replicas:
    """A behind the tap, B straight on Valkey, and a client for each."""

    def __init__(
        self, tap: Tap, server_a: FlowcastServer, a: httpx.AsyncClient, b: httpx.AsyncClient
    ) -> None:
        self.tap, self.server_a, self.a, self.b = tap, server_a, a, b


@pytest.fixture
async def replicas(own_valkey: ValkeyServer, tmp_path: Path) -> AsyncIterator[Replicas]:
    async with Tap(own_valkey.port) as tap:
        a = replica(own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url)
        b = replica(own_valkey, tmp_path, "b")
        await asyncio.gather(a.start(), b.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
            ):
                await put(on_b, delay_workflow(WORKFLOW, ms=500))
                yield Replicas(tap, a, on_a, on_b)
        finally:
            await asyncio.gather(a.stop(), b.stop())


async def killed_at(replicas: Replicas, match: Callable[[bytes], bool]) -> bytes:
    """Send the keyed execute to A, hold the command ``match`` picks, kill A there; the
    held command."""
    replicas.tap.hold(match)
    url = f"/api/workflows/{WORKFLOW}/execute"
    request = asyncio.create_task(replicas.a.post(url, json=BODY, headers=KEY))
    await asyncio.wait_for(replicas.tap.held.wait(), 20)
    await kill_replica(replicas.server_a)
    with pytest.raises(httpx.TransportError):
        await request  # A never answered
    return replicas.tap.held_command


async def repeat(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = await client.post(f"/api/workflows/{WORKFLOW}/execute", json=BODY, headers=KEY)
    return response, time.monotonic() - began


async def listed(client: httpx.AsyncClient) -> list[str]:
    response = await client.get(f"/api/executions?workflowId={WORKFLOW}&limit=200")
    assert response.status_code == 200, response.text
    return [execution["id"] for execution in response.json()["executions"]]


async def plain_execute_seconds(client: httpx.AsyncClient) -> float:
    """A probe: how long an execute without a key takes here, now (its run is left to
    finish on its own; it runs another workflow, not counted below)."""
    await put(client, delay_workflow("probe", ms=1))
    began = time.monotonic()
    response = await client.post("/api/workflows/probe/execute", json=BODY)
    assert response.status_code == 202, response.text
    return time.monotonic() - began


def of_type(log: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [envelope for envelope in log if envelope["type"] == kind]


def nth_command_on_the_key(n: int) -> Callable[[bytes], bool]:
    seen = 0

    def match(data: bytes) -> bool:
        nonlocal seen
        seen += data.count(b":idem:")
        return seen >= n

    return match


@pytest.mark.timeout(120)
async def test_a_repeat_after_the_replica_died_before_recording_the_outcome_returns_the_execution(
    replicas: Replicas,
) -> None:
    # A's first command on the key claims it; its second records the outcome: held, so
    # A dies with the execution created and its outcome never recorded.
    held = await killed_at(replicas, nth_command_on_the_key(2))
    assert held.startswith(b"*") and b"SET" in held.upper(), held
    probe = await plain_execute_seconds(replicas.b)
    response, seconds = await repeat(replicas.b)
    print(f"\nrepeat on B answered in {seconds:.3f} s (a plain execute: {probe:.3f} s)")
    assert response.status_code == 202, response.text
    execution_id = response.json()["executionId"]
    # Promptly: not after the wait for an "in progress" outcome.
    assert seconds < probe + WAIT_SECONDS / 3
    # A created it; B recovers it from A's expired lease and finishes it.
    assert (await wait_finished(replicas.b, execution_id))["status"] == "completed"
    log = await all_events(replicas.b, execution_id)
    check_log(log)
    assert len(of_type(log, "execution:recovered")) == 1
    later, _ = await repeat(replicas.b)
    assert later.status_code == 202, later.text
    assert later.json()["executionId"] == execution_id
    assert await listed(replicas.b) == [execution_id]


@pytest.mark.timeout(120)
async def test_a_repeat_after_the_replica_died_before_creating_the_execution_creates_it_once(
    replicas: Replicas,
) -> None:
    # start.lua is the one script that writes an execution's metadata and run state
    # together: held, A dies with the key's record written and no execution.
    held = await killed_at(replicas, lambda data: b"}:meta" in data and b"}:state" in data)
    named = re.search(rb"\{(ex_[A-Za-z0-9_-]+)\}:meta", held)
    assert named is not None, held
    probe = await plain_execute_seconds(replicas.b)
    response, seconds = await repeat(replicas.b)
    print(f"\nrepeat on B answered in {seconds:.3f} s (a plain execute: {probe:.3f} s)")
    assert response.status_code == 202, response.text
    execution_id = response.json()["executionId"]
    # The execution the key's record named before A died, created by the repeat.
    assert execution_id == named[1].decode()
    assert seconds < probe + WAIT_SECONDS / 3
    assert (await wait_finished(replicas.b, execution_id))["status"] == "completed"
    log = await all_events(replicas.b, execution_id)
    check_log(log)
    assert of_type(log, "execution:recovered") == []
    later, _ = await repeat(replicas.b)
    assert later.status_code == 202, later.text
    assert later.json()["executionId"] == execution_id
    assert await listed(replicas.b) == [execution_id]
