"""``llm`` calls on a replica that gets SIGTERM: one waiting for a slot and one
streaming past the grace are handed off and complete elsewhere.

With real processes: Flowcast servers on the session's Valkey, the fake provider of
tests/support/llm.py.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.support.api import all_events, execute, put, until, wait_finished
from tests.support.llm import FakeLLM, Reply, fresh, llm, llm_block, one_block
from tests.support.servers import (
    ValkeyServer,
    authed,
    prefix,
    started_server,
)
from tests.support.timing import assert_below_timer

__all__ = ["fresh", "llm"]  # the module's fake provider (tests/support/llm.py)


# --------------------------------------------------------------------------- slots


async def test_a_call_waiting_for_a_slot_is_handed_off_on_sigterm_and_completes(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Probe: SIGTERM to a replica whose llm call waits in line for a slot held by
    another replica: it is handed off (not failed) and completes on the other one.
    Found by the step 12 review (round 2)."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        "FLOWCAST_LLM_PROVIDERS": providers,
        "FLOWCAST_LEASE_SECONDS": "3",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    one = await started_server(tmp_path, "h1", **env)
    two = await started_server(tmp_path, "h2", **env)
    try:
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            llm.default = Reply(pieces=[f"p{i} " for i in range(20)], piece_delay=0.15)
            holder = await execute(first, "ask", {"n": 1})
            await llm.wait_in_flight(1)
            waiter = await execute(second, "ask", {"n": 2})

            async def started() -> bool:
                events = await all_events(second, waiter)
                return any(e["type"] == "block:started" for e in events)

            await until(started, "the waiting call's block started", 10, every=0.05)
            llm.default = Reply(text="quick answer")
            assert await two.stop(signal.SIGTERM, timeout=15) in (0, -signal.SIGTERM)
            assert (await wait_finished(first, holder, timeout=15))["status"] == "completed"
            snapshot = await wait_finished(first, waiter, timeout=15)
            assert snapshot["status"] == "completed", snapshot
            events = await all_events(first, waiter)
            types = [e["type"] for e in events]
            assert "execution:failed" not in types, types
    finally:
        await one.stop()
        await two.stop()


async def test_a_streaming_call_cut_by_sigterm_runs_again_elsewhere_and_completes(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Probe: SIGTERM to the replica whose llm call streams past the grace: the call is
    cancelled, its slot released, and the other replica runs it again to completion.
    Found by the step 12 review (round 2)."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        "FLOWCAST_LLM_PROVIDERS": providers,
        "FLOWCAST_LEASE_SECONDS": "3",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    one = await started_server(tmp_path, "s1", **env)
    two = await started_server(tmp_path, "s2", **env)
    try:
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            llm.default = Reply(pieces=[f"p{i} " for i in range(100)], piece_delay=0.1)
            streaming = await execute(first, "ask", {"n": 1})
            await llm.wait_in_flight(1)
            llm.default = Reply(text="second run")
            at = time.monotonic()
            assert await one.stop(signal.SIGTERM, timeout=15) in (0, -signal.SIGTERM)
            snapshot = await wait_finished(second, streaming, timeout=15)
            assert snapshot["status"] == "completed", snapshot
            assert snapshot["output"]["draft"]["text"] == "second run"
            assert_below_timer(
                time.monotonic() - at,
                bound=8,
                timer="the 1 s grace and the 3 s lease",
                what="a streaming call cut by SIGTERM to its completion elsewhere",
            )
            events = await all_events(second, streaming)
            chunks = [e for e in events if e["type"] == "block:chunk"]
            last_start = max(i for i, e in enumerate(events) if e["type"] == "block:started")
            text = "".join(e["data"]["text"] for e in events[last_start:] if e in chunks)
            assert text == "second run"
    finally:
        await one.stop()
        await two.stop()
