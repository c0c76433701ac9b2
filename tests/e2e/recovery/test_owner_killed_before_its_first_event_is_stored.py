"""An owner killed right after the 202 of an execute, its first event shown live and
not stored (start.lua reserved id 1 with the creation, so ``execution:started`` goes to
clients as it is emitted): the takeover numbers above id 1, a client that reads from
the start is told id 1 was dropped (a ``replay:gap``, never another event under it), a
client that saw id 1 live and reconnects reads on from 2 with nothing lost unreported,
and the execution reaches one terminal event (SPEC §4 "Ids", §7). The 202 waits a
second at most for id 1 to be stored (then logs that it answers without it).

The step 15 second fault review: the attack on the start path's reserved first id. The
seam is a proxy between replica A and Valkey (tests/support/tap.py) that holds A's
first append, so A dies with id 1 shown and unstored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.api import all_events, delay_workflow, put, until, wait_finished
from tests.support.faults import kill_replica, replica
from tests.support.logcheck import TERMINAL, check_lossy_log, check_view, same_ids_same_events
from tests.support.recovery import LiveReader, dropped_ranges
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import follow
from tests.support.tap import Tap

WORKFLOW = "short-order"


@pytest.fixture
async def pair(
    own_valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[Tap, FlowcastServer, FlowcastServer]]:
    async with Tap(own_valkey.port) as tap:
        a = replica(own_valkey, tmp_path, "a", FLOWCAST_REDIS_URL=tap.url)
        b = replica(own_valkey, tmp_path, "b")
        await asyncio.gather(a.start(), b.start())
        try:
            yield tap, a, b
        finally:
            await asyncio.gather(a.stop(), b.stop())


@pytest.mark.timeout(90)
async def test_a_takeover_after_the_owner_died_with_id_1_unstored_numbers_above_it(
    pair: tuple[Tap, FlowcastServer, FlowcastServer],
) -> None:
    tap, a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
    ):
        await put(on_b, delay_workflow(WORKFLOW, ms=300))
        tap.hold(lambda data: b"execution:started" in data)
        response = await on_a.post(f"/api/workflows/{WORKFLOW}/execute", json={"input": {}})
        assert response.status_code == 202, response.text
        # The 202 waited its second for id 1 to be stored, then said it did not wait more.
        assert "answering a start whose first event is not stored yet" in (a.log_path.read_text())
        eid = response.json()["executionId"]
        await asyncio.wait_for(tap.held.wait(), 20)
        live = LiveReader(a, eid)
        try:
            await until(lambda: _saw_first(live), "the live client saw id 1", timeout=10)
            await kill_replica(a)
        finally:
            await live.close()
        seen = live.seen()
        assert [event["type"] for event in seen][:1] == ["execution:started"], seen
        assert seen[0]["id"] == 1

        assert (await wait_finished(on_b, eid, timeout=40))["status"] == "completed"
        stored = await all_events(on_b, eid)
        # Nothing stored under id 1 but the event the live client saw there.
        same_ids_same_events(seen, stored)
        from_start = await follow(on_b, eid)
        view = check_view(from_start)
        if not view or view[0]["id"] != 1:
            assert dropped_ranges(from_start)[:1] == [(1, view[0]["id"] - 1)], from_start
        check_lossy_log(stored, dropped=dropped_ranges(from_start))
        assert [e["type"] for e in view].count("execution:recovered") == 1, view
        assert sum(e["type"] in TERMINAL for e in view) == 1
        # The client that saw id 1 live reconnects with it: it is owed everything after.
        after = await follow(on_b, eid, cursor=1)
        rest = check_view(after, after=1)
        assert [e["id"] for e in rest] == [e["id"] for e in view if e["id"] > 1]
        print(f"\nstored ids {[e['id'] for e in stored]}, gaps {dropped_ranges(from_start)}")


async def _saw_first(live: LiveReader) -> bool:
    return live.last_id() >= 1
