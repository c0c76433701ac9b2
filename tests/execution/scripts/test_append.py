"""append.lua's contract on a real Valkey: every reply and every refusal.

The ARGV layout is built here from the script's header, not by EventBuffer, so the
header and the script are checked against each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import inbox, now_ms, publish_refused, refusal, script

TOKEN = "node-a:1111"
ROW = {"tenant": "acme", "workflowId": "wf", "createdAt": "c0", "updatedAt": "u0"}


def chunk(i: int, size: int = 10) -> tuple[str, str]:
    return "block:chunk", json.dumps({"id": i, "text": "x" * size})


async def owned(
    redis: Redis, keys: Keys, eid: str, *, token: str = TOKEN, epoch: int = 1, **fields: Any
) -> None:
    """An execution as start.lua leaves it (and then ``fields``)."""
    await redis.hset(
        keys.meta(eid),
        mapping={
            "owner": token, "epoch": epoch, "status": "running", "lastId": 0, "firstId": 0,
            "bytes": 0, "count": 0, "reserved": 0, **ROW, **fields,
        },
    )  # fmt: skip


def append(
    redis: Redis,
    keys: Keys,
    eid: str,
    events: Sequence[tuple[str, str]],
    *,
    first: int,
    token: str = TOKEN,
    epoch: int = 1,
    after_drop: bool = False,
    limit: int = 100,
    budget: int = 1_000_000,
    retention: int = 600,
    ttl: int = 3_600,
    reserve: int = 0,
    recreate: bool = False,
    meta: Mapping[str, str] | None = None,
    checkpoint: Mapping[str, str] | None = None,
    inline: int = 0,
    quota_step: int = 0,
) -> Any:
    meta, checkpoint = meta or {}, checkpoint or {}
    args: list[Any] = [
        token, epoch, first, "1" if after_drop else "0", limit, budget, retention, ttl,
        reserve, "1" if recreate else "0", len(events), len(meta), len(checkpoint),
        eid, keys.notify, keys.status, inline, quota_step,
    ]  # fmt: skip
    for kind, body in events:
        args += [kind, body]
    for pair in (*meta.items(), *checkpoint.items()):
        args += pair
    return script(redis, "append.lua")(keys=keys.execution(eid), args=args)


async def ids(redis: Redis, keys: Keys, eid: str) -> list[bytes]:
    return [entry_id for entry_id, _ in await redis.xrange(keys.events(eid))]


async def test_a_batch_is_stored_after_the_last_id_and_answered_with_the_ring(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    events = [chunk(1), chunk(2), chunk(3)]
    reply = await append(redis, keys, eid, events, first=1, reserve=8)
    size = sum(len(body) for _, body in events)
    assert reply == [3, 1, size, 3, 8, b"0", -1, b""]
    assert await ids(redis, keys, eid) == [b"1-0", b"2-0", b"3-0"]
    stored = await redis.xrange(keys.events(eid), count=1)
    assert stored[0][1] == {b"t": b"block:chunk", b"e": events[0][1].encode()}
    meta = await redis.hmget(keys.meta(eid), "lastId", "firstId", "bytes", "count", "reserved")
    assert meta == [b"3", b"1", str(size).encode(), b"3", b"8"]
    again = await append(redis, keys, eid, [chunk(4)], first=4)
    assert again[0] == 4 and again[4] == 8  # the reservation never goes down


async def test_every_append_stamps_when_an_owner_last_wrote_on_redis_clock(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """writtenAt: a run not written since the store was last found behind is as the
    store brought it back (store.lua restoredAt, takeovers.py ``recall``)."""
    await owned(redis, keys, eid, writtenAt=1)
    before = await now_ms(redis, keys.meta(eid))
    await append(redis, keys, eid, [chunk(1)], first=1)
    after = await now_ms(redis, keys.meta(eid))
    assert before <= int(await redis.hget(keys.meta(eid), "writtenAt") or 0) <= after
    await append(redis, keys, eid, [], first=2)  # an owner re-asserting writes too
    assert int(await redis.hget(keys.meta(eid), "writtenAt") or 0) >= after


async def test_reserved_is_never_below_the_last_stored_id(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    reply = await append(redis, keys, eid, [chunk(1), chunk(2)], first=1, reserve=0)
    assert reply[0] == 2 and reply[4] == 2


async def test_every_key_gets_the_running_ttl_until_a_terminal_status_sets_retention(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    # A delivery of it revoked once (claim.lua): the set lived 30 days, past the run.
    await redis.sadd(keys.revoked(eid), "t-late")
    await redis.expire(keys.revoked(eid), 30 * 86_400)
    await append(redis, keys, eid, [chunk(1)], first=1, ttl=3_600, checkpoint={"o:b": "1"})
    assert 3_500 < await redis.ttl(keys.meta(eid)) <= 3_600
    assert 3_500 < await redis.ttl(keys.state(eid)) <= 3_600
    assert 3_500 < await redis.ttl(keys.revoked(eid)) <= 3_600
    done = ("execution:completed", json.dumps({"id": 2}))
    reply = await append(
        redis, keys, eid, [done], first=2, reserve=9, retention=600, meta={"status": "completed"}
    )
    assert reply[4] == 2  # finished: nothing is shown above the stored events
    for key in (keys.events(eid), keys.meta(eid), keys.state(eid), keys.revoked(eid)):
        assert 500 < await redis.ttl(key) <= 600
    assert await redis.hget(keys.meta(eid), "status") == b"completed"


async def test_a_pause_keeps_the_running_ttl_and_gives_up_the_reservation(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, reserved=50)
    paused = ("execution:paused", json.dumps({"id": 1}))
    reply = await append(
        redis, keys, eid, [paused], first=1, ttl=3_600, retention=600, meta={"status": "paused"}
    )
    assert reply[4] == 1
    assert 3_500 < await redis.ttl(keys.meta(eid)) <= 3_600


async def test_the_execution_id_goes_out_on_notify_and_a_status_change_on_status(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    await owned(redis, keys, eid)
    async with inbox(node_url(keys.meta(eid)), keys.notify, keys.status) as box:
        await append(redis, keys, eid, [chunk(1), chunk(2)], first=1)
        assert await box.received() == [(keys.notify, eid)]
        paused = ("execution:paused", json.dumps({"id": 3}))
        await append(redis, keys, eid, [paused], first=3, meta={"status": "paused"})
        (notify, woken), (status, row) = await box.received()
    assert (notify, woken, status) == (keys.notify, eid, keys.status)
    assert json.loads(row) == {
        "id": eid, "tenant": "acme", "workflowId": "wf", "status": "paused",
        "createdAt": "c0", "updatedAt": "u0", "lastEventId": 3,
    }  # fmt: skip


async def test_a_failure_goes_out_with_its_error_code(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    """The live lists show why a run failed (a quarantine among others)."""
    await owned(redis, keys, eid)
    failed = ("execution:failed", json.dumps({"id": 1}))
    error = json.dumps({"code": "quarantined", "message": "its owners died 2 times"})
    async with inbox(node_url(keys.meta(eid)), keys.notify, keys.status) as box:
        await append(redis, keys, eid, [failed], first=1, meta={"status": "failed", "error": error})
        (_notify, _woken), (_status, row) = await box.received()
    assert json.loads(row)["errorCode"] == "quarantined"


async def test_a_batch_within_the_inline_cap_goes_out_whole_and_a_larger_one_as_its_id(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    """A reader on another process forwards a small batch without reading it back."""
    await owned(redis, keys, eid)
    small = [chunk(1), chunk(2)]
    cap = sum(len(body) for _kind, body in small)
    async with inbox(node_url(keys.meta(eid)), keys.notify) as box:
        await append(redis, keys, eid, small, first=1, inline=cap)
        await append(redis, keys, eid, [chunk(3), chunk(4)], first=3, inline=cap - 1)
        await append(redis, keys, eid, [], first=5, inline=cap)
        received = await box.received()
    lines = [eid, "1", *(part for event in small for part in event)]
    assert received == [(keys.notify, "\n".join(lines)), (keys.notify, eid), (keys.notify, eid)]


async def test_a_status_change_without_a_tenant_publishes_no_row(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    await owned(redis, keys, eid)
    await redis.hdel(keys.meta(eid), "tenant")
    async with inbox(node_url(keys.meta(eid)), keys.notify, keys.status) as box:
        await append(redis, keys, eid, [chunk(1)], first=1, meta={"status": "failed"})
        assert await box.received() == [(keys.notify, eid)]


async def test_an_empty_batch_only_reasserts_the_owner(redis: Redis, keys: Keys, eid: str) -> None:
    await owned(redis, keys, eid)
    await append(redis, keys, eid, [chunk(1)], first=1)
    reply = await append(redis, keys, eid, [], first=2, reserve=5)
    assert reply[:2] == [1, 1] and reply[3] == 1 and reply[4] == 5
    assert await ids(redis, keys, eid) == [b"1-0"]


async def test_ids_said_dropped_are_recorded_as_one_range_with_the_batch(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    await append(redis, keys, eid, [chunk(1)], first=1)
    reply = await append(redis, keys, eid, [chunk(7)], first=7, after_drop=True)
    assert reply[0] == 7
    assert await redis.zrange(keys.dropped(eid), 0, -1, withscores=True) == [(b"2-6", 2.0)]
    assert await ids(redis, keys, eid) == [b"1-0", b"7-0"]


async def test_the_oldest_events_are_evicted_past_the_event_limit(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    await append(redis, keys, eid, [chunk(i) for i in range(1, 6)], first=1, limit=3)
    reply = await append(redis, keys, eid, [chunk(6)], first=6, limit=3)
    assert reply[0] == 6 and reply[1] == 4 and reply[3] == 3
    assert await ids(redis, keys, eid) == [b"4-0", b"5-0", b"6-0"]
    assert await redis.hget(keys.meta(eid), "firstId") == b"4"


async def test_the_byte_budget_evicts_but_never_the_newest_event(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    small = [chunk(1), chunk(2)]
    await append(redis, keys, eid, small, first=1, budget=200)
    big = chunk(3, size=500)
    reply = await append(redis, keys, eid, [big], first=3, budget=200)
    assert reply == [3, 3, len(big[1]), 1, 3, b"0", -1, b""]
    assert await ids(redis, keys, eid) == [b"3-0"]


async def test_checkpoint_fields_are_written_and_outputs_and_answers_count_against_the_budget(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    events = [chunk(i) for i in range(1, 4)]
    each = len(events[0][1])
    held = {"o:b": "y" * 100, "a:q": "z" * 50, "s:b": "1" * 1000}  # a skip does not count
    reply = await append(redis, keys, eid, events, first=1, budget=150 + 2 * each, checkpoint=held)
    assert reply[1:4] == [2, 2 * each, 2]  # the oldest event made room for 150 bytes
    assert await redis.hgetall(keys.state(eid)) == {k.encode(): v.encode() for k, v in held.items()}
    assert await redis.hget(keys.meta(eid), "ckptBytes") == b"150"


async def test_metadata_fields_are_set_with_the_batch(redis: Redis, keys: Keys, eid: str) -> None:
    await owned(redis, keys, eid)
    meta = {"status": "failed", "error": '{"message": "no"}', "updatedAt": "u1"}
    await append(redis, keys, eid, [chunk(1)], first=1, meta=meta)
    stored = await redis.hmget(keys.meta(eid), "status", "error", "updatedAt")
    assert stored == [b"failed", b'{"message": "no"}', b"u1"]


async def test_a_missing_execution_is_recreated_when_asked(
    redis: Redis, keys: Keys, eid: str
) -> None:
    reply = await append(
        redis, keys, eid, [chunk(4)], first=4, epoch=3, after_drop=True, recreate=True,
        meta={"tenant": "acme", "workflowId": "wf"},
    )  # fmt: skip
    assert reply[:4] == [4, 4, len(chunk(4)[1]), 1]
    meta = await redis.hmget(keys.meta(eid), "owner", "epoch", "status", "tenant")
    assert meta == [TOKEN.encode(), b"3", b"running", b"acme"]
    assert await redis.zrange(keys.dropped(eid), 0, -1) == [b"1-3"]


async def test_a_writer_with_a_later_epoch_takes_the_execution_back(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, token="node-b:2222", epoch=2, status="paused", pauseBlock="q")
    reply = await append(redis, keys, eid, [chunk(1)], first=1, epoch=3)
    assert reply[0] == 1
    meta = await redis.hmget(keys.meta(eid), "owner", "epoch", "status", "pauseBlock")
    assert meta == [TOKEN.encode(), b"3", b"running", b""]


async def test_a_requested_cancel_is_answered_to_a_batch_that_does_not_end_the_run(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, cancelRequested="1")
    reply = await append(redis, keys, eid, [chunk(1)], first=1)
    assert reply[0] == 1 and reply[5] == b"1"
    cancelled = ("execution:cancelled", json.dumps({"id": 2}))
    ended = await append(redis, keys, eid, [cancelled], first=2, meta={"status": "cancelled"})
    assert ended[0] == 2 and ended[5] == b"1"


async def test_a_refused_publish_still_stores_the_batch(
    redis: Redis, keys: Keys, eid: str, node_url: Callable[[str], str]
) -> None:
    await owned(redis, keys, eid)
    async with publish_refused(node_url(keys.meta(eid))) as user:
        done = ("execution:completed", json.dumps({"id": 1}))
        reply = await append(user, keys, eid, [done], first=1, meta={"status": "completed"})
    assert reply[0] == 1
    assert await redis.hget(keys.meta(eid), "status") == b"completed"


async def test_noexec_when_the_metadata_is_missing(redis: Redis, keys: Keys, eid: str) -> None:
    assert await refusal(append(redis, keys, eid, [chunk(1)], first=1)) == "NOEXEC"
    assert await redis.exists(*keys.execution(eid)) == 0


async def test_fenced_names_the_owner_of_the_same_or_a_later_epoch(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, token="node-b:2222", epoch=2)
    for epoch in (1, 2):
        refused = await refusal(append(redis, keys, eid, [chunk(1)], first=1, epoch=epoch))
        assert refused == "FENCED node-b:2222"
    assert await ids(redis, keys, eid) == []


async def test_order_names_the_last_id_a_batch_must_follow(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid)
    await append(redis, keys, eid, [chunk(1), chunk(2)], first=1)
    for first in (2, 4):  # a repeat, and a gap not said dropped
        assert await refusal(append(redis, keys, eid, [chunk(first)], first=first)) == "ORDER 2"
    # Dropping only ever moves forward.
    assert await refusal(append(redis, keys, eid, [chunk(2)], first=2, after_drop=True)) == (
        "ORDER 2"
    )
    assert await ids(redis, keys, eid) == [b"1-0", b"2-0"]
    assert await redis.exists(keys.dropped(eid)) == 0


async def test_cancel_refuses_a_final_event_other_than_cancelled(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, cancelRequested="1")
    for final in ("execution:paused", "execution:completed", "execution:failed"):
        batch = [chunk(1), (final, json.dumps({"id": 2}))]
        refused = await refusal(
            append(redis, keys, eid, batch, first=1, meta={"status": "x"}, checkpoint={"o:b": "1"})
        )
        assert refused == "CANCEL"
    assert await ids(redis, keys, eid) == []
    assert await redis.hmget(keys.meta(eid), "status", "lastId") == [b"running", b"0"]
    assert await redis.exists(keys.state(eid)) == 0


async def test_a_checkpoint_of_thousands_of_fields_is_written_whole(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """More values than Lua unpacks at once (~8000): a checkpoint written back whole."""
    await owned(redis, keys, eid)
    checkpoint = {f"t:b{i}": "1" for i in range(5_000)}
    reply = await append(redis, keys, eid, [chunk(1)], first=1, checkpoint=checkpoint)
    assert reply[0] == 1
    assert await redis.hlen(keys.state(eid)) == 5_000


async def test_fenced_names_no_owner_once_the_execution_was_handed_off(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await owned(redis, keys, eid, token="", handoff=TOKEN, epoch=2)
    refused = await refusal(append(redis, keys, eid, [chunk(1)], first=1, epoch=2))
    assert refused == "FENCED "  # the owner it names is none
    assert await ids(redis, keys, eid) == []


async def test_a_recreate_or_a_take_back_before_an_order_refusal_stays(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """The one write an error reply keeps, as the header says: the batch is not stored."""
    refused = await refusal(append(redis, keys, eid, [chunk(5)], first=5, recreate=True))
    assert refused == "ORDER 0"
    assert await redis.hmget(keys.meta(eid), "owner", "lastId") == [TOKEN.encode(), b"0"]
    later = "node-b:2222"
    assert await refusal(append(redis, keys, eid, [chunk(5)], first=5, token=later, epoch=2)) == (
        "ORDER 0"
    )
    assert await redis.hmget(keys.meta(eid), "owner", "epoch") == [later.encode(), b"2"]
    assert await ids(redis, keys, eid) == []


async def test_the_footprint_is_handed_to_the_tenant_ledger_when_it_moved_by_a_step(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """ARGV[18]: the footprint (envelopes + checkpoint outputs + outcomes the hash
    copies + ``quotaBase``) is answered, with the tenant, when it moved by the step
    since ``quotaRecorded`` or the batch sets the status; otherwise -1 and "", and
    ``quotaRecorded`` stays."""
    await owned(redis, keys, eid, quotaBase=100, quotaRecorded=100)
    small = chunk(1)
    reply = await append(redis, keys, eid, [small], first=1, quota_step=1000)
    assert reply[6:] == [-1, b""]
    assert await redis.hget(keys.meta(eid), "quotaRecorded") == b"100"
    big = chunk(2, size=1200)
    held = {"o:b": "x" * 50}
    reply = await append(redis, keys, eid, [big], first=2, quota_step=1000, checkpoint=held)
    footprint = len(small[1]) + len(big[1]) + 50 + 100
    assert reply[6:] == [footprint, b"acme"]
    assert await redis.hget(keys.meta(eid), "quotaRecorded") == str(footprint).encode()
    done = ("execution:completed", "{}")
    ended = {"status": "completed", "output": '"xyz"'}  # the output the hash copies counts
    reply = await append(redis, keys, eid, [done], first=3, quota_step=1000, meta=ended)
    assert reply[6:] == [footprint + 2 + 5, b"acme"]  # a status change: handed whatever moved


async def test_no_footprint_is_handed_without_a_step_or_a_tenant(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """A step of 0 (no ledger) or a metadata hash that names no tenant never asks for
    the ledger, even when the status is set."""
    await owned(redis, keys, eid)
    done = ("execution:completed", "{}")
    reply = await append(redis, keys, eid, [done], first=1, meta={"status": "completed"})
    assert reply[6:] == [-1, b""]
    other = f"{eid}-2"
    await redis.hset(keys.meta(other), mapping={"owner": TOKEN, "epoch": 1, "lastId": 0})
    reply = await append(redis, keys, other, [chunk(1)], first=1, quota_step=1)
    assert reply[6:] == [-1, b""]
