"""A list reads what it returns (issue 24 row 13): the indexes by workflow and status
bucket (lib/execution/indexes.py) on a real Valkey of the test's own, whose
``INFO commandstats`` counts what each read cost; the faults at the one seam where a
process can die between the final event and what follows it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from lib.errors import BufferUnavailable, CancelWins
from lib.execution import indexes
from lib.execution.buffer import EventBuffer
from lib.execution.events import Event
from lib.execution.indexes import Listed
from tests.support.filled import OWNER, calls, finish, stored_run, stored_runs
from tests.support.servers import ValkeyServer

TENANT = "t_idx"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def buffer(own_valkey: ValkeyServer) -> AsyncIterator[EventBuffer]:
    client = Redis.from_url(own_valkey.url)
    yield EventBuffer(redis=client, prefix=f"i{uuid.uuid4().hex[:6]}")
    await client.aclose()


def ids(metas: list[object]) -> list[str]:
    return [meta.id for meta in metas]  # type: ignore[attr-defined]


async def test_filtered_lists_read_about_limit_records_beside_many_runs_of_another_workflow(
    buffer: EventBuffer,
) -> None:
    """Was a break (issue 24 row 13): ``?workflowId=x`` read and parsed every stored run
    (up to 5,000) until ``limit`` matched. Beside 1,000 finished runs of another
    workflow (five pages of an index, ``indexes.PAGE``; such a scan would read them
    all), each filtered list reads no more records than it may return, combined
    filters too. What the server does beside 3,000 runs, timed, is
    tests/e2e/api/test_list_filters.py."""
    await stored_runs(buffer, TENANT, "busy", 1_000, status="completed")
    # Each a millisecond apart and after the busy runs: two created in the same
    # millisecond would list in the order of their random ids (a flake in CI).
    at = iter(range(int(time.time() * 1000) + 1_000, 2**62))
    done = [
        await stored_run(buffer, TENANT, "x", status="completed", created_ms=next(at))
        for _ in range(3)
    ]
    running = [await stored_run(buffer, TENANT, "x", created_ms=next(at)) for _ in range(2)]
    paused = [
        await stored_run(buffer, TENANT, "gate", status="paused", created_ms=next(at))
        for _ in range(2)
    ]
    # The tenant's first filtered list lists what older code stored (none here) once.
    await buffer.recent_metas(TENANT, limit=1, workflow_id="none")

    cases = [
        ({"workflow_id": "x"}, [*running[::-1], *done[::-1]]),
        ({"status": "paused"}, paused[::-1]),
        ({"workflow_id": "x", "status": "running"}, running[::-1]),
        ({"workflow_id": "x", "status": "completed"}, done[::-1]),
        ({"workflow_id": "gate", "status": "paused"}, paused[::-1]),
        ({"workflow_id": "busy", "status": "paused"}, []),
        ({"workflow_id": "nothing"}, []),
    ]
    for filters, expected in cases:
        before = await calls(buffer, "hgetall")
        found = await buffer.recent_metas(TENANT, limit=10, **filters)  # type: ignore[arg-type]
        read = await calls(buffer, "hgetall") - before
        assert ids(found) == expected, filters
        # The open bucket holds the tenant's unfinished runs: 4 here, read whole.
        assert read <= max(len(expected), 4), (filters, read)

    before = await calls(buffer, "hgetall")
    newest = await buffer.recent_metas(TENANT, limit=10, status="completed")
    assert len(newest) == 10 and all(meta.status == "completed" for meta in newest)
    assert ids(newest)[:3] == done[::-1]
    assert await calls(buffer, "hgetall") - before == 10


class DiesAfterTheFinalEvent(EventBuffer):
    """A buffer whose process dies the moment its final event is stored: nothing after
    the append runs (the seam of a SIGKILL there)."""

    async def _finished(self, execution_id: str, listed: Listed) -> None:
        raise SystemExit("killed right after the final event")


async def test_a_run_whose_owner_died_right_after_its_final_event_is_listed_by_that_status(
    buffer: EventBuffer,
) -> None:
    """The brief's fault: the owner SIGKILLed between the terminal event and any index
    write after it. The final bucket is written before the event, so the run is found
    by its final status; its stale ``open`` entry is dropped by the next read of it."""
    execution_id = await stored_run(buffer, TENANT, "x")
    dying = DiesAfterTheFinalEvent(redis=buffer.redis, prefix=buffer.prefix)
    with pytest.raises(SystemExit):
        await finish(dying, execution_id, "x", "failed")
    opened = buffer.keys.listing(TENANT, workflow_id=None, bucket=indexes.OPEN)
    assert await buffer.redis.zscore(opened, execution_id) is not None  # never taken out

    assert ids(await buffer.recent_metas(TENANT, limit=5, status="failed")) == [execution_id]
    found = await buffer.recent_metas(TENANT, limit=5, workflow_id="x", status="failed")
    assert ids(found) == [execution_id]
    assert await buffer.recent_metas(TENANT, limit=5, status="running") == []
    assert await buffer.redis.zscore(opened, execution_id) is None  # dropped by that read
    assert ids(await buffer.recent_metas(TENANT, limit=5, workflow_id="x")) == [execution_id]


async def test_a_final_status_that_a_cancel_overruled_lists_the_run_as_cancelled_only(
    buffer: EventBuffer,
) -> None:
    """``completed`` is listed before its append, which a cancel refuses (CancelWins):
    the run ends ``cancelled``, is listed there, and the ``completed`` entry is dropped
    by the first read that meets it, never shown."""
    execution_id = await stored_run(buffer, TENANT, "x")
    await buffer.redis.hset(buffer.keys.meta(execution_id), "cancelRequested", "1")
    with pytest.raises(CancelWins):
        await finish(buffer, execution_id, "x", "completed")
    completed = buffer.keys.listing(TENANT, workflow_id=None, bucket="completed")
    assert await buffer.redis.zscore(completed, execution_id) is not None  # written ahead
    # While the record is unfinished the entry stays: that final event may still come.
    assert await buffer.recent_metas(TENANT, limit=5, status="completed") == []
    assert await buffer.redis.zscore(completed, execution_id) is not None

    await finish(buffer, execution_id, "x", "cancelled")
    assert await buffer.recent_metas(TENANT, limit=5, status="completed") == []
    assert await buffer.redis.zscore(completed, execution_id) is None
    assert ids(await buffer.recent_metas(TENANT, limit=5, status="cancelled")) == [execution_id]
    assert await buffer.recent_metas(TENANT, limit=5, status="running") == []


async def test_entries_of_expired_runs_leave_an_index_that_no_read_reaches(
    buffer: EventBuffer,
) -> None:
    """Retention: a read meets only the newest entries, so expired ones deep in an index
    stayed for good. Random entries are checked at each read and final event: 100
    expired entries under 10 live ones leave while lists read only the newest."""
    live = [await stored_run(buffer, TENANT, "x", status="completed") for _ in range(10)]
    old_ms = int((time.time() - 2 * indexes.INDEX_GRACE_SECONDS) * 1000)
    expired = [
        await stored_run(buffer, TENANT, "x", status="completed", created_ms=old_ms + n)
        for n in range(100)
    ]
    await buffer.redis.delete(*(buffer.keys.meta(execution_id) for execution_id in expired))
    by_workflow = buffer.keys.listing(TENANT, workflow_id="x", bucket=None)
    assert await buffer.redis.zcard(by_workflow) == 110

    reads = 0
    while await buffer.redis.zcard(by_workflow) > 15 and reads < 400:
        found = await buffer.recent_metas(TENANT, limit=5, workflow_id="x")
        assert ids(found) == live[::-1][:5]
        reads += 1
    assert await buffer.redis.zcard(by_workflow) <= 15, f"after {reads} reads"
    listed = {member.decode() for member in await buffer.redis.zrange(by_workflow, 0, -1)}
    assert set(live) <= listed  # live entries never leave


async def test_filtered_lists_of_an_upgraded_store_name_the_runs_stored_before_the_indexes(
    buffer: EventBuffer,
) -> None:
    """Existing data: older code listed a run only in its tenant's index. The tenant's
    first filtered list lists those runs in the new indexes, once; every list then
    names them, and later lists read only what they return."""
    done = [await stored_run(buffer, TENANT, "x", status="completed") for _ in range(3)]
    paused = await stored_run(buffer, TENANT, "gate", status="paused")
    other = await stored_runs(buffer, TENANT, "busy", 200, status="failed")
    tagged = [key async for key in buffer.redis.scan_iter(f"{buffer.prefix}:{{t:{TENANT}}}:*")]
    await buffer.redis.delete(*tagged)  # what older code stored: the tenant's index only

    assert ids(await buffer.recent_metas(TENANT, limit=5, workflow_id="x")) == done[::-1]
    assert await buffer.redis.get(buffer.keys.indexed(TENANT)) == b"1"
    before = await calls(buffer, "hgetall"), await calls(buffer, "hmget")
    assert ids(await buffer.recent_metas(TENANT, limit=5, status="paused")) == [paused]
    found = await buffer.recent_metas(TENANT, limit=5, workflow_id="busy", status="failed")
    assert len(found) == 5 and set(ids(found)) <= set(other)  # started at once: ties
    assert ids(await buffer.recent_metas(TENANT, limit=5, status="completed")) == done[::-1]
    after = await calls(buffer, "hgetall"), await calls(buffer, "hmget")
    assert after[0] - before[0] <= 1 + 5 + 3 and after[1] == before[1]  # no second backfill


async def test_a_list_read_while_another_process_lists_older_runs_reads_the_whole_index(
    buffer: EventBuffer,
) -> None:
    """While one process lists a tenant's older runs, another's filtered list must not
    read the incomplete indexes: it reads the tenant's whole index, as before."""
    done = await stored_run(buffer, TENANT, "x", status="completed")
    await buffer.redis.delete(buffer.keys.listing(TENANT, workflow_id="x", bucket=None))
    await buffer.redis.set(buffer.keys.indexed(TENANT), b"building")
    assert ids(await buffer.recent_metas(TENANT, limit=5, workflow_id="x")) == [done]
    assert await buffer.redis.get(buffer.keys.indexed(TENANT)) == b"building"


async def test_a_listing_of_older_runs_cut_off_by_an_error_is_done_by_the_next_list(
    buffer: EventBuffer,
) -> None:
    """A tenant's first filtered list fails half way through listing its older runs (a
    record Redis refuses to read): the list fails with that error, and the next list
    lists them, instead of every list reading the whole index until the marker expires."""
    done = await stored_run(buffer, TENANT, "x", status="completed")
    tagged = [key async for key in buffer.redis.scan_iter(f"{buffer.prefix}:{{t:{TENANT}}}:*")]
    await buffer.redis.delete(*tagged)
    broken = "ex_broken"
    await buffer.redis.zadd(buffer.keys.index(TENANT), {broken: time.time() * 1000})
    await buffer.redis.set(buffer.keys.meta(broken), "not a hash")  # HMGET: WRONGTYPE
    with pytest.raises(BufferUnavailable, match="WRONGTYPE"):
        await buffer.recent_metas(TENANT, limit=5, workflow_id="x")
    assert await buffer.redis.get(buffer.keys.indexed(TENANT)) is None

    await buffer.redis.delete(buffer.keys.meta(broken))
    assert ids(await buffer.recent_metas(TENANT, limit=5, workflow_id="x")) == [done]
    assert await buffer.redis.get(buffer.keys.indexed(TENANT)) == b"1"


async def test_a_final_event_looks_up_no_index_entry_listed_within_the_grace(
    buffer: EventBuffer,
) -> None:
    """The worker's cost per execution (issue 25): the final event's sweep samples the
    indexes in the round trip that takes the run out of ``open``, and looks up only
    entries listed before the grace (no other could be dropped); an old expired entry
    beside recent live ones is still looked up and dropped."""
    live = [await stored_run(buffer, TENANT, "x") for _ in range(6)]
    exists, zscores = await calls(buffer, "exists"), await calls(buffer, "zscore")
    for execution_id in live:
        await finish(buffer, execution_id, "x", "completed")
    assert (await calls(buffer, "exists"), await calls(buffer, "zscore")) == (exists, zscores)
    opened = buffer.keys.listing(TENANT, workflow_id=None, bucket=indexes.OPEN)
    assert await buffer.redis.zcard(opened) == 0

    old_ms = int((time.time() - 2 * indexes.INDEX_GRACE_SECONDS) * 1000)
    expired = await stored_run(buffer, TENANT, "x", status="completed", created_ms=old_ms)
    await buffer.redis.delete(buffer.keys.meta(expired))
    by_workflow = buffer.keys.listing(TENANT, workflow_id="x", bucket=None)
    runs = 0
    while await buffer.redis.zscore(by_workflow, expired) is not None and runs < 200:
        execution_id = await stored_run(buffer, TENANT, "x")
        await finish(buffer, execution_id, "x", "completed")
        runs += 1
    assert await buffer.redis.zscore(by_workflow, expired) is None, f"after {runs} runs"
    assert await calls(buffer, "exists") > exists
    listed = {member.decode() for member in await buffer.redis.zrange(by_workflow, 0, -1)}
    assert set(live) <= listed


async def test_a_final_event_whose_writer_knows_the_runs_identity_reads_no_record_first(
    buffer: EventBuffer,
) -> None:
    """The writer passes the identity it holds (flush.py): the final status is listed in
    its bucket before it is stored, with no HMGET of the record first (one round trip
    less per execution, issue 25); without it, the record is read as before."""
    hmgets: list[int] = []
    runs: list[str] = []
    for known in (True, False):
        execution_id = await stored_run(buffer, TENANT, "x")
        stored = await buffer.redis.hgetall(buffer.keys.meta(execution_id))
        identity = {
            name: stored[name.encode()].decode() for name in ("tenant", "workflowId", "createdAt")
        }
        final = Event(
            id=1, type="execution:completed", execution_id=execution_id, workflow_id="x", data={}
        )
        before = await calls(buffer, "hmget")  # append.lua's own HMGETs counted too
        await buffer.append(
            execution_id,
            [final],
            fence=OWNER,
            meta={"status": "completed"},
            identity=identity if known else None,
        )
        hmgets.append(await calls(buffer, "hmget") - before)
        runs.append(execution_id)
    assert hmgets[1] == hmgets[0] + 1
    completed = buffer.keys.listing(TENANT, workflow_id="x", bucket="completed")
    opened = buffer.keys.listing(TENANT, workflow_id=None, bucket=indexes.OPEN)
    for execution_id in runs:
        assert await buffer.redis.zscore(completed, execution_id) is not None
        assert await buffer.redis.zscore(opened, execution_id) is None
