"""Calls waiting in line for a provider's slot (the cross-replica cap): a cancelled
waiter gives its place up at once, and a waiter does not spin on Redis after the
store came back empty.

With real processes: Flowcast servers on the session's Valkey, the fake provider of
tests/support/llm.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from redis.asyncio import Redis

from tests.support.api import execute, put, until, wait_finished
from tests.support.llm import FakeLLM, Reply, fresh, llm, llm_block, one_block, slow_reply
from tests.support.servers import (
    FlowcastServer,
    ValkeyServer,
    authed,
    prefix,
    started_server,
)
from tests.support.timing import assert_below_timer, hold_for

__all__ = ["fresh", "llm"]  # the module's fake provider (tests/support/llm.py)


async def test_cancelling_a_call_waiting_for_a_slot_gives_its_place_up_at_once(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break: a call cancelled while it waits in line in Redis (``Slots._acquire``, so a
    call of another replica than the holder's) leaves its ticket in the provider's queue
    and its waiter entry alive for a whole lease: when the holder finishes, the next
    live waiter (behind the dead ticket at rank 0) is not granted the slot until that
    entry expires, ~``FLOWCAST_LEASE_SECONDS`` later (15 s by default), instead of at
    once. ``Slots.hold`` releases only after a successful acquire. Found by the step 12 review."""
    key_prefix = prefix()
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": key_prefix,
        "FLOWCAST_LLM_PROVIDERS": providers,
        "FLOWCAST_LEASE_SECONDS": "15",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    one = await started_server(tmp_path, "cancel1", **env)
    two = await started_server(tmp_path, "cancel2", **env)
    redis = Redis.from_url(valkey.url)
    queue = f"{key_prefix}:{{llm:default}}:queue"
    try:
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            llm.default = slow_reply(pieces=10, every=0.2)  # the holder: about 2 s
            holder = await execute(first, "ask", {"n": 1})
            await llm.wait_in_flight(1)
            cancelled = await execute(second, "ask", {"n": 2})
            await until(lambda: redis.zcard(queue), "the second call waits in line", 10, every=0.05)
            # Behind it, on the same replica (it waits for that replica's own cap first).
            behind = await execute(second, "ask", {"n": 3})
            llm.default = Reply(text="quick")
            assert (await second.post(f"/api/executions/{cancelled}/cancel")).status_code == 202
            assert (await wait_finished(second, cancelled, timeout=5))["status"] == "cancelled"
            assert (await wait_finished(first, holder, timeout=20))["status"] == "completed"
            done_at = time.monotonic()
            # The slot is free and only `behind` wants it: it should be called at once.
            await llm.wait_requests(2, timeout=5)
            assert_below_timer(
                time.monotonic() - done_at,
                bound=5,
                timer="the 15 s lease a dead waiter's entry lives",
                what="the freed slot to the call behind",
            )
            assert (await wait_finished(second, behind, timeout=10))["status"] == "completed"
    finally:
        await redis.aclose()
        await one.stop()
        await two.stop()


async def test_a_waiter_does_not_spin_on_redis_after_it_came_back_empty(
    llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break: after Redis restarts empty (or the ``freed`` stream expires after an idle
    minute) the acquire script answers ``freed = "0-0"``, which is below the ``seen``
    id the process remembered, so ``Slots._acquire`` never waits (``seen <= after`` is
    false) and asks again at once, in a hot loop (thousands of EVALSHA a second) for as
    long as the slot stays taken (slots.py: the ``_stream_id(line.seen) <= after`` test).
    Found by the step 12 review."""
    from tests.support import faults

    own = ValkeyServer(data_dir=tmp_path / "valkey")
    await own.start()
    servers: list[FlowcastServer] = []
    redis = None
    try:
        providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
        env = {
            "FLOWCAST_REDIS_URL": own.url,
            "FLOWCAST_LLM_PROVIDERS": providers,
            "FLOWCAST_LEASE_SECONDS": "2",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        }
        one = await started_server(tmp_path, "one", **env)
        servers.append(one)
        two = await started_server(tmp_path, "two", **env)
        servers.append(two)
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            # Warm up: a call of `two` waits for one of `one`, so `two` has seen a freed id.
            llm.default = slow_reply(pieces=5, every=0.1)
            warm_one = await execute(first, "ask", {})
            await llm.wait_in_flight(1)
            warm_two = await execute(second, "ask", {})
            await wait_finished(second, warm_two, timeout=20)
            await wait_finished(first, warm_one, timeout=20)
            # Now `one` holds the slot for ~6 s and a call of `two` waits for it.
            llm.reset()
            llm.default = slow_reply(pieces=60, every=0.1)
            holder = await execute(first, "ask", {})
            await llm.wait_in_flight(1)
            llm.default = Reply(text="quick")
            waiter = await execute(second, "ask", {})
            async with Redis.from_url(own.url) as look:
                queue = "fc:{llm:default}:queue"
                await until(
                    lambda: look.zcard(queue), "the call of `two` waits in line", 10, every=0.05
                )
            await faults.crash_and_wipe(own)
            redis = Redis.from_url(own.url)

            async def calls() -> int:
                stats = await redis.info("commandstats")
                return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

            before, at = await calls(), time.monotonic()
            await hold_for(2, "a window measuring the waiter's calls to Redis")
            rate = (await calls() - before) / (time.monotonic() - at)
            await wait_finished(first, holder, timeout=30)
            await wait_finished(second, waiter, timeout=30)
            # A waiter asks about 3 times a lease; a holder renews 3 times a lease.
            assert rate < 50, f"{rate:.0f} EVALSHA/s while one call waits"
    finally:
        if redis is not None:
            await redis.aclose()
        for server in servers:
            await server.stop()
        await own.stop()
