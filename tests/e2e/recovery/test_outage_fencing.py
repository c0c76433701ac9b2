"""Per-run lease renewals around an outage, with real processes: a renewal Redis
refuses for memory is an outage, not a fencing, and an owner that wakes from a stall
into an outage never shows ids it lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, delay_workflow, put, streaming_workflow, until, within
from tests.support.faults import stopped, wait_store_settled
from tests.support.logcheck import same_ids_same_events
from tests.support.recovery import has_event
from tests.support.servers import FlowcastServer, ValkeyServer, flowcast_on
from tests.support.sse import events

# ------------------------------------------------------------------ heartbeats


# ------------------------------------------------------------------ lease renewals


@pytest.mark.timeout(120)
async def test_a_renewal_refused_for_memory_is_an_outage_not_a_fencing(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Redis refusing writes for a moment (maxmemory reached: ``OOM command not
    allowed``; likewise ``READONLY`` during a failover, ``MISCONF``) while a run's lease
    is renewed: ``Ownership.renew`` turns every script error other than GONE/BEHIND into
    ``Conflict("fenced")`` (lib/execution/ownership.py ``renew``), and
    ``LeaseKeeper._renew`` stops the run as fenced (lib/workflows/leases.py). Nobody
    fenced it: its work is cancelled, it writes no last event ("the new owner writes the
    end"), ``_let_go`` releases its lease entry (settled, as fenced) and the renew loop
    skips it from then on. The metadata still names it owner of a ``running``
    execution, but no lease entry is watched any more: no janitor ever takes it over.
    The execution stays ``running`` forever (SPEC §7 "Nothing is ever stuck", "Redis
    refusing writes"), while the appends refused by the same OOM are (correctly) retried
    as an outage. Found by the step 13 review (round 2)."""
    server = await flowcast_on(own_valkey, tmp_path, lease_seconds="3")
    redis = Redis.from_url(own_valkey.url)
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            await put(client, delay_workflow("sit", ms=5_000))
            response = await client.post("/api/workflows/sit/execute", json={"input": {}})
            assert response.status_code == 202, response.text
            execution_id = response.json()["executionId"]
            await until(
                lambda: has_event(client, execution_id, "block:started", "think"),
                "the delay block started",
                20,
                every=0.05,
            )
            # Redis refuses writes until a renewal has met the refusal (either verdict).
            await redis.config_set("maxmemory", "1")
            try:

                async def renewal_met_it() -> bool:
                    logs = server.logs()
                    return "lease renewal failed" in logs or "execution taken over" in logs

                await until(renewal_met_it, "a renewal met the refusal", 15, every=0.05)
            finally:
                await redis.config_set("maxmemory", "0")
            # The delay ends 5 s after it began; a lease (3 s) and more on top.
            status = "running"

            async def moved_on() -> bool:
                nonlocal status
                status = (await client.get(f"/api/executions/{execution_id}")).json()["status"]
                return status != "running" or "execution taken over" in server.logs()

            await until(moved_on, "the run ended or was taken over", 30, every=0.1)

            async def ended() -> bool:
                nonlocal status
                status = (await client.get(f"/api/executions/{execution_id}")).json()["status"]
                return status != "running"

            if status == "running":
                # Given every chance: a lease and then some for a janitor to step in.
                await within(ended, 3 * 3 + 5, every=0.2)
            if status == "completed":
                return
            problems = [f"still {status!r} long after its only block ended"]
            # A cancel now: 202 means it will happen (SPEC §3), whatever raced with it.
            cancel = await client.post(f"/api/executions/{execution_id}/cancel")
            if cancel.status_code == 202:
                await within(ended, 3 * 3 + 5, every=0.2)
                if status == "running":
                    problems.append("a cancel answered 202 and the execution is still running")
            logged = [line for line in server.logs().splitlines() if execution_id in line]
            assert not problems, (problems, logged[-6:])
    finally:
        await redis.aclose()
        await server.stop()


# ------------------------------------------------------------------ the live gate


@pytest.mark.timeout(120)
async def test_an_owner_that_wakes_from_a_stall_into_an_outage_never_shows_ids_it_lost(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A stalls (SIGSTOP) for longer than its lease; B takes the execution over and
    stores ``execution:recovered`` and more under the next ids; then Valkey goes down,
    and A wakes up. A's renewals now fail as an outage, and ``LeaseKeeper._renew``
    (lib/workflows/leases.py, ``except FlowcastError``) sets ``checked_at = started``:
    that reopens A's live gate (log.py: ``time.monotonic() - renewed_at() <
    live_for_seconds``), so A goes on publishing its own events live to the clients
    attached to it, under the very ids B already gave to other events (the comment
    "nobody can take over while the buffer is unreachable" forgets the takeover that
    happened during the stall, before the outage). When Valkey is back A is fenced,
    but its clients have seen e.g. id 11 = A's ``block:chunk`` where the log has
    ``execution:recovered``: an id names two events (SPEC §4 "Ids": never, "not after
    the execution moved to another process"). A stalled owner must keep its gate shut
    until a renewal succeeds. Found by the step 13 review (round 2)."""
    env = {
        "FLOWCAST_REDIS_URL": own_valkey.url,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SSE_PING_SECONDS": "0.5",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    a = FlowcastServer(data_dir=tmp_path / "a", env=env)
    b = FlowcastServer(data_dir=tmp_path / "b", env=env)
    await asyncio.gather(a.start(), b.start())
    seen: list[dict[str, Any]] = []
    arrived = asyncio.Event()
    try:
        await wait_store_settled(own_valkey, timeout=30)
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
        ):
            await put(on_a, streaming_workflow("slow", words=400, tps=10))
            started_run = await on_a.post("/api/workflows/slow/execute", json={"input": {}})
            execution_id = started_run.json()["executionId"]

            async def follow() -> None:
                url = f"/api/executions/{execution_id}/stream"
                with contextlib.suppress(httpx.HTTPError):
                    async with on_a.stream("GET", url) as response:
                        async for frame in events(response):
                            seen.append(frame.json)
                            arrived.set()

            follower = asyncio.create_task(follow())
            try:
                async with asyncio.timeout(20):
                    while len(seen) < 10:
                        arrived.clear()
                        await arrived.wait()
                os.kill(a.pid, signal.SIGSTOP)

                async def a_stopped() -> bool:
                    return stopped(a.pid)

                await until(a_stopped, "A stopped", 5, every=0.01)
                before_stall = seen[-1]["id"]

                async def b_took_over() -> bool:
                    stored = await all_events(on_b, execution_id)
                    types = [event["type"] for event in stored]
                    return "execution:recovered" in types and len(stored) > before_stall + 3

                # B takes over and stores its own events under the next ids.
                await until(b_took_over, "B took over and stored more", 30, every=0.1)
                own_valkey.kill()
                os.kill(a.pid, signal.SIGCONT)
                # What A shows its clients from now on (a measurement window).
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and len(seen) < before_stall + 10:
                    arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrived.wait(), deadline - time.monotonic())
                await own_valkey.start()
                newest = max(event["id"] for event in seen)

                async def stored_past_newest() -> list[dict[str, Any]] | None:
                    stored = await all_events(on_b, execution_id)
                    return stored if stored[-1]["id"] >= newest else None

                stored = await until(stored_past_newest, "the log past A's ids", 30, every=0.1)
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
        same_ids_same_events(seen, stored)
    finally:
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(a.pid, signal.SIGCONT)
        await asyncio.gather(a.stop(), b.stop())  # both drain their run: side by side
