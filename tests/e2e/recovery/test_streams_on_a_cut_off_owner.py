"""A stream on a replica cut off from Redis for good (its own link; the other replica
keeps Redis), on an execution that ends on the other replica meanwhile: the stream
must still end, within about a lease plus grace of the end, so that its client
reconnects (through a load balancer, to a replica that can tell it the end) instead of
hearing heartbeats for ever (SPEC §7 "Nothing is ever stuck": "every open stream on it
ends, within about FLOWCAST_LEASE_SECONDS plus the grace").

Found by the step 15 fault review.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import put, until
from tests.support.faults import LEASE_SECONDS, replica
from tests.support.proxy import TcpLink
from tests.support.recovery import finished, has_event
from tests.support.servers import ValkeyServer
from tests.support.sse import events

pytestmark = pytest.mark.timeout(120)

GRACE_SECONDS = 1.0  # replica()'s


def slow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "first", "type": "delay", "config": {"ms": 300}},
            {"id": "long", "type": "delay", "config": {"ms": 4000}},
        ],
        "edges": [{"from": "first", "to": "long"}],
    }


async def test_a_stream_on_a_replica_cut_off_for_good_ends_once_the_run_ended_elsewhere(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with TcpLink(valkey.port) as link:
        a = replica(valkey, tmp_path, "a", FLOWCAST_REDIS_URL=link.url)
        b = replica(valkey, tmp_path, "b")
        await asyncio.gather(a.start(), b.start())
        try:
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=60) as on_a,
                httpx.AsyncClient(base_url=b.url, timeout=60) as on_b,
            ):
                await put(on_a, slow("cutoff"))
                started = await on_a.post("/api/workflows/cutoff/execute", json={"input": {}})
                assert started.status_code == 202, started.text
                eid = started.json()["executionId"]
                opened = [asyncio.Event(), asyncio.Event()]
                closed: dict[str, float] = {}

                async def read(name: str, client: httpx.AsyncClient, ready: asyncio.Event) -> None:
                    with contextlib.suppress(httpx.HTTPError):
                        url = f"/api/executions/{eid}/stream"
                        async with client.stream("GET", url) as response:
                            ready.set()
                            async for _frame in events(response):
                                pass
                    closed[name] = time.monotonic()

                # The probe: a stream on B, which ends with the terminal event.
                readers = [
                    asyncio.create_task(read("a", on_a, opened[0])),
                    asyncio.create_task(read("b", on_b, opened[1])),
                ]
                await asyncio.gather(*(event.wait() for event in opened))
                await until(lambda: has_event(on_b, eid, "block:started", "long"), "long")
                link.cut()
                await finished(on_b, eid)  # B took it over and ran it to its end
                await asyncio.wait_for(asyncio.shield(readers[1]), 20)
                bound = 4 * (LEASE_SECONDS + GRACE_SECONDS)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(readers[0]), bound)
                still_open = not readers[0].done()
                for task in readers:
                    task.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
        finally:
            link.heal()
            await asyncio.gather(a.stop(), b.stop())
    assert not still_open, (
        f"the stream on the cut-off replica was still open {bound:.0f} s after the one on "
        "the other replica got the end"
    )
    assert closed["a"] - closed["b"] < bound, closed
