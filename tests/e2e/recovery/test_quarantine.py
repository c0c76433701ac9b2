"""A run that kills every process it lands on is quarantined; the runs that died beside it
are recovered, never failed for it (SPEC §7, §8 "Shares per tenant"; lib/execution/blame.py).

Found by the step 16 hostile-tenant review (issue 24, row 4): with a container's memory
limit, one execution OOM-killed replicas 4 times, and 2 of another tenant's 4 plain
``delay`` runs that happened to be on the dying replicas ended ``worker_lost``. Here the
OOM kill is a test-only plugin block (tests/support/plugins.py ``crash``) that SIGKILLs
its own process each time it runs; four replicas share one Valkey (lease 2 s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, execute, put, until
from tests.support.faults import FaultyValkey, replica
from tests.support.live_list import live
from tests.support.logcheck import check_log
from tests.support.recovery import (
    DEADLINE,
    chain,
    check_recovered,
    finished,
    meta_field,
    running,
    settled,
    valkey,
)
from tests.support.servers import ALPHA, BETA, FlowcastServer, bearer

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(150)


def killer(workflow_id: str) -> dict[str, Any]:
    """warm (a short delay) → boom: kills its process 600 ms into every run of it."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "warm", "type": "delay", "config": {"ms": 100}},
            {"id": "boom", "type": "python", "config": {"name": "crash", "args": {"ms": 600}}},
        ],
        "edges": [{"from": "warm", "to": "boom"}],
    }


def client(server: FlowcastServer, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=bearer(key), timeout=30)


def dead(server: FlowcastServer) -> bool:
    process = server._process
    return process is not None and process.poll() is not None


async def test_a_killer_is_quarantined_at_its_third_death_and_its_neighbours_complete(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Tenant A's killer starts on replica a beside 3 of tenant B's plain runs; b, c and d
    run 2 more of B's runs each. The killer's first kill charges nobody (4 ran, none
    suspected) and makes nobody a suspect: one death is no sign, and a lost replica's
    runs are all taken over at once. Its second kill makes it (and whatever died beside
    it twice) a suspect; each replica takes one suspect at a time, so wherever the
    killer lands next it is that process's only suspect beside B's runs, and its third
    kill is charged to it alone: it ends ``failed`` with code ``quarantined`` after
    exactly 3 deaths (FLOWCAST_MAX_RECOVERIES is 3: it used to kill 4), and A's live
    list shows it failed with that code. Every one of B's 9 runs completes, its log
    whole, none charged a crash."""
    # A lease of 2 s: the killer kills ~0.7 s after it lands, well inside the probation
    # (a lease) it runs under as a process's suspect, even on a busy machine.
    env = {
        "FLOWCAST_PLUGINS": "tests.support.plugins",
        "FLOWCAST_API_KEYS": f"{ALPHA},{BETA}",
        "FLOWCAST_LEASE_SECONDS": "2",
    }
    a, b, c, d = (replica(valkey, tmp_path, name, **env) for name in "abcd")
    async with running(a, b, c, d) as servers:
        async with client(b, ALPHA) as on_b_as_a, client(b, BETA) as on_b:
            await put(on_b_as_a, killer("killer"))
            await put(on_b, chain("plain", blocks=4, ms=500))
            await put(on_b, chain("neighbour", blocks=24, ms=500))
        neighbours: list[str] = []
        for server in (b, c, d):
            async with client(server, BETA) as http:
                neighbours += [await execute(http, "neighbour", {}) for _ in range(2)]
        async with client(a, BETA) as on_a, client(a, ALPHA) as on_a_as_a:
            plain = [await execute(on_a, "plain", {}) for _ in range(3)]
            killer_id = await execute(on_a_as_a, "killer", {})

        others = (b, c, d)
        await until(lambda: dead(a), "the killer killed replica a", timeout=DEADLINE)
        await until(
            lambda: sum(dead(s) for s in others) >= 2, "the killer killed two more", DEADLINE
        )
        survivor = next(s for s in others if not dead(s))
        async with client(survivor, ALPHA) as as_a, client(survivor, BETA) as as_b:
            ended = await finished(as_a, killer_id)
            endings = await asyncio.gather(*(finished(as_b, eid) for eid in plain + neighbours))
            killer_log = await all_events(as_a, killer_id)
            async with live(as_a, "status=failed") as listed:
                rows = await listed.rows()
            logs = await asyncio.gather(*(all_events(as_b, eid) for eid in plain + neighbours))
        assert [s for s in servers if not dead(s)] == [survivor]

    assert ended["status"] == "failed", ended
    assert ended["error"]["code"] == "quarantined", ended
    assert "died 3 times" in ended["error"]["message"], ended
    check_log(killer_log)
    recovered = [e["data"] for e in killer_log if e["type"] == "execution:recovered"]
    assert [r["reason"] for r in recovered] == ["worker_lost"] * 2, recovered
    assert killer_log[-1]["data"]["error"]["code"] == "quarantined"
    assert await meta_field(valkey, killer_id, "deaths") == b"3"
    shown = [(row["id"], row["status"], row.get("errorCode")) for row in rows]
    assert shown == [(killer_id, "failed", "quarantined")], rows

    assert [e["status"] for e in endings] == ["completed"] * 9, endings
    for eid, stored in zip(plain + neighbours, logs, strict=True):
        check_recovered(stored)
        assert await meta_field(valkey, eid, "crashes") in (None, b"0"), eid
