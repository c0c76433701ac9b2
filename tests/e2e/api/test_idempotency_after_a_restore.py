"""A keyed ``execute`` repeated after Valkey came back from a snapshot taken before the
first request: the execution runs on (its owner, awake, wrote it back once the store
settled), but the key's record is gone with the snapshot. The repeat must still return
that execution and start nothing new (SPEC §3 "Idempotency": "returns the original
outcome (same execution id) and starts nothing new"; SPEC §4 on a store restored from
an older snapshot): the owner writes the key's record back before the execution.

Found by the step 15 fault review.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from app.idempotency import WriteBack
from tests.support.api import delay_workflow, put, until
from tests.support.faults import FaultyValkey, crash_and_restore, replica, take_snapshot
from tests.support.recovery import (
    finished,
    has_event,
    http_for,
    running,
    settled,
    settled_store,
    valkey,
)

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(90)

KEY = {"Idempotency-Key": "restored-1"}
BODY = {"input": {"n": 1}}


async def test_a_keyed_execute_repeated_after_a_restore_returns_the_running_execution(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = delay_workflow("keyedrestore", ms=6000)
        await put(http_for(http, a), wf)
        snap = await take_snapshot(valkey, tmp_path / "before.rdb")
        url = f"/api/workflows/{wf['id']}/execute"
        first = await http_for(http, a).post(url, json=BODY, headers=KEY)
        assert first.status_code == 202, first.text
        eid = first.json()["executionId"]
        await until(lambda: has_event(http_for(http, a), eid, "block:started", "think"), "think")
        await crash_and_restore(valkey, snap)
        await put(http_for(http, b), wf)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)

        async def known_again() -> bool:
            response = await http_for(http, b).get(f"/api/executions/{eid}")
            return response.status_code == 200

        await until(known_again, "the owner wrote its execution back")
        repeat = await http_for(http, b).post(url, json=BODY, headers=KEY)
        assert repeat.status_code == 202, repeat.text
        other = repeat.json()["executionId"]
        first_end = await finished(http_for(http, b), eid)
        if other != eid:
            await finished(http_for(http, b), other)
    assert first_end["status"] == "completed", first_end
    assert other == eid, f"the repeat started a second execution {other} beside {eid}"


async def test_the_write_back_restores_the_record_for_what_was_left_of_its_time(
    valkey: FaultyValkey,
) -> None:
    """What the owner writes back: the record as written, never in place of another
    one (a repeat that came first made its own), never past its first time to live."""
    redis = Redis.from_url(valkey.url)
    try:
        record = b'{"fingerprint":"f","executionId":"ex_1"}'
        await WriteBack(redis, "k:lost", record, time.monotonic() + 30)()
        assert await redis.get("k:lost") == record
        assert 25_000 < await redis.pttl("k:lost") <= 30_000
        await redis.set("k:taken", b"another")
        await WriteBack(redis, "k:taken", record, time.monotonic() + 30)()
        assert await redis.get("k:taken") == b"another"
        await WriteBack(redis, "k:expired", record, time.monotonic() - 1)()
        assert await redis.exists("k:expired") == 0
    finally:
        await redis.aclose()
