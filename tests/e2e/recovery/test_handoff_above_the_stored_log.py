"""A SIGTERM hand-off while the owner's client has seen ids above the stored log (shown
under ids Redis reserved, not stored yet: writes are paused): the next owner numbers
above every id that client saw, and the hand-off leaves no gap where no event was lost
(SPEC §4 "Ids", §5, §7 "Shutdown"; the F3 fix hands back only ids never shown).

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, execute, put, talking_workflow, until
from tests.support.faults import FaultyValkey, pause_writes, replica, terminate_replica
from tests.support.logcheck import check_lossy_log, same_ids_same_events
from tests.support.recovery import (
    LiveReader,
    dropped_ranges,
    finished,
    has_event,
    http_for,
    meta_field,
    running,
    settled,
    valkey,
)
from tests.support.sse import follow

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(120)


async def test_a_hand_off_numbers_above_what_the_owners_client_saw_ahead_of_the_store(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = talking_workflow("aboveterm", words=6000, tps=1000)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        live = LiveReader(a, eid)
        try:

            async def saw(n: int) -> bool:
                return live.last_id() >= n

            await until(lambda: saw(50), "the client saw the stream")
            await pause_writes(valkey, 300)

            async def reserved_ahead() -> bool:
                reserved = int(await meta_field(valkey, eid, "reserved") or 0)
                return reserved > int(await meta_field(valkey, eid, "lastId") or 0) + 60

            await until(reserved_ahead, "a burst reserved ids ahead")
            await pause_writes(valkey, 2_500)
            stored_before = int(await meta_field(valkey, eid, "lastId") or 0)
            await until(lambda: saw(stored_before + 6), "the client saw unstored ids", 20)
            # SIGTERM while the writes are still paused: the drain waits for them.
            stopping = asyncio.create_task(terminate_replica(a))
            await until(
                lambda: has_event(http_for(http, b), eid, "execution:recovered"), "B took over"
            )
            await stopping
            seen = live.seen()
        finally:
            await live.close()
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        replay = await follow(http_for(http, b), eid)
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert [e["data"]["reason"] for e in recovered] == ["handoff"], recovered
    assert max(e["id"] for e in seen) > stored_before
    same_ids_same_events(seen, stored)
    assert recovered[0]["id"] > max(e["id"] for e in seen), (recovered[0]["id"], seen[-1]["id"])
    check_lossy_log(stored, dropped=dropped_ranges(replay))
    assert snapshot["status"] == "completed", snapshot
    print(
        f"\nstored before {stored_before}, seen up to {seen[-1]['id']}, "
        f"recovered at {recovered[0]['id']}, gaps {dropped_ranges(replay)}"
    )
