"""A start during store faults. A write pause (``CLIENT PAUSE WRITE``) as it sends its
batch only delays it: one admission, lease entry and listing, and a full log from id 1.
A start cut off by a Redis restart between its batch (the tenant's admission taken)
and start.lua: the execute answers 5xx, nothing was created, and the tenant at a cap of
1 has its room back within a few leases, not after the ten leases a leaked admission
counts for (SPEC §5: a refusal or failure changes nothing that lasts).

The step 15 second fault review: the start's undo ran while Redis was still away and
the admission was left behind; now the janitor's next pass takes it back. The seam is a
proxy between the replica and Valkey (tests/support/tap.py) that kills Valkey just
before start.lua goes out.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from lib.execution.admission import COUNTED_LEASES
from tests.support.api import all_events, delay_workflow, put, until, wait_finished
from tests.support.faults import LEASE_SECONDS, pause_writes, replica
from tests.support.logcheck import check_log
from tests.support.servers import ValkeyServer
from tests.support.tap import Tap


@pytest.mark.timeout(90)
async def test_a_start_cut_off_by_a_redis_restart_gives_its_tenant_room_back(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with Tap(own_valkey.port) as tap:
        server = replica(
            own_valkey,
            tmp_path,
            "a",
            FLOWCAST_REDIS_URL=tap.url,
            FLOWCAST_MAX_EXECUTIONS_PER_TENANT="1",
        )
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                await put(client, delay_workflow("short", ms=100))
                url = "/api/workflows/short/execute"
                tap.when(lambda data: b"}:meta" in data and b"}:state" in data, own_valkey.kill)
                cut = await client.post(url, json={"input": {}})
                assert cut.status_code >= 500, cut.text
                await own_valkey.start()
                back = time.monotonic()

                async def admitted() -> str | None:
                    with_room = await client.post(url, json={"input": {}})
                    if with_room.status_code == 202:
                        return str(with_room.json()["executionId"])
                    assert with_room.status_code in (429, 503), with_room.text
                    return None

                await until(admitted, "the tenant's room back", timeout=60)
                seconds = time.monotonic() - back
                print(f"\nroom back {seconds:.2f} s after Redis (lease {LEASE_SECONDS} s)")
                # A leaked admission counts COUNTED_LEASES leases past its lease's end.
                assert seconds < COUNTED_LEASES * LEASE_SECONDS / 2
        finally:
            await server.stop()


@pytest.mark.timeout(60)
async def test_a_start_during_a_write_pause_is_only_delayed(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """The step 15 second fault review: the start's batch (admission, lease entry,
    listing, version) and start.lua wait out a write pause and then happen once."""
    server = replica(own_valkey, tmp_path, "a", FLOWCAST_MAX_EXECUTIONS_PER_TENANT="2")
    await server.start()
    redis = Redis.from_url(own_valkey.url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, delay_workflow("short", ms=100))
            await pause_writes(own_valkey, 1500)
            response = await client.post("/api/workflows/short/execute", json={"input": {}})
            assert response.status_code == 202, response.text
            eid = response.json()["executionId"]
            keys = Keys(server.env.get("FLOWCAST_REDIS_PREFIX", "fc"))
            assert await redis.zcard(keys.index("default")) == 1
            assert (await wait_finished(client, eid, timeout=30))["status"] == "completed"
            check_log(await all_events(client, eid))
            # Finished: nothing of the start is left counting or watched. It stops
            # counting before its end is emitted, but its lease entry goes in the round
            # trip after its terminal event is stored (launcher.py, _let_go): a read
            # right after the snapshot shows it completed can come first (and a renewal
            # racing that release may list it again, for the janitor to drop within
            # about a lease: test_ownership's hand-off test).
            assert await redis.zcard(keys.running("default")) == 0

            async def unwatched() -> bool:
                return await redis.zcard(keys.leases) == 0

            await until(unwatched, "the run's lease entry released", 10 * LEASE_SECONDS)
    finally:
        await redis.aclose()
        await server.stop()
