"""store.lua's contract on a real Valkey: nothing to settle for a new store or the same
server, the whole settle when the server changed, what is left of it until it ends; a
mark never lower than the one before, and deadlines held for the wait asked when a
caller remembers a higher mark than the store has (it came back behind)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, script

SETTLE_MS = 30_000
BEHIND_MS = 60_000


async def store(
    redis: Redis, keys: Keys, identity: str, settle: int = SETTLE_MS, **given: Any
) -> list[int]:
    """settle, behind and mark (``given``: as ``store_all``)."""
    return (await store_all(redis, keys, identity, settle, **given))[:3]


async def store_all(
    redis: Redis,
    keys: Keys,
    identity: str,
    settle: int = SETTLE_MS,
    *,
    seen: int = 0,
    nodes: str | None = None,
) -> list[int]:
    """store.lua's whole answer: settle, behind, mark and restoredAt."""
    args: list[Any] = [identity, settle, seen, BEHIND_MS]
    reply: Any = await script(redis, "store.lua")(
        keys=[keys.store], args=args if nodes is None else [*args, nodes]
    )
    return [int(value) for value in reply]


async def test_a_new_store_records_who_answers_and_has_nothing_to_settle(
    redis: Redis, keys: Keys
) -> None:
    before = await now_ms(redis, keys.store)
    settle, behind, mark = await store(redis, keys, "run-a")
    assert (settle, behind) == (0, 0)
    assert mark >= before
    assert await redis.hgetall(keys.store) == {
        b"runId": b"run-a",
        b"settleUntil": b"0",
        b"mark": str(mark).encode(),
        b"behindUntil": b"0",
        b"born": str(mark).encode(),  # made by a caller that saw no mark (store.lua)
    }
    assert (await store(redis, keys, "run-a", seen=mark))[:2] == [0, 0]


async def test_another_server_answering_starts_a_settle_then_what_is_left_of_it(
    redis: Redis, keys: Keys
) -> None:
    await store(redis, keys, "run-a")
    before = await now_ms(redis, keys.store)
    assert (await store(redis, keys, "run-b"))[:2] == [SETTLE_MS, 0]
    after = await now_ms(redis, keys.store)
    until = int(await redis.hget(keys.store, "settleUntil") or 0)
    assert before + SETTLE_MS <= until <= after + SETTLE_MS
    left, behind, _mark = await store(redis, keys, "run-b")
    assert 0 < left <= SETTLE_MS and behind == 0
    assert await redis.hget(keys.store, "runId") == b"run-b"


async def test_on_a_cluster_another_primary_answering_starts_a_settle_too(
    redis: Redis, keys: Keys
) -> None:
    """The default node unchanged, another node restarted: a change all the same. The
    first call with the primaries (a process of an earlier version sent none) records
    them without a settle."""
    await store(redis, keys, "run-a")
    assert (await store(redis, keys, "run-a", nodes="run-a,run-b,run-c"))[:2] == [0, 0]
    assert await redis.hget(keys.store, "nodes") == b"run-a,run-b,run-c"
    assert (await store(redis, keys, "run-a", nodes="run-a,run-c,run-d"))[:2] == [SETTLE_MS, 0]
    assert await redis.hget(keys.store, "nodes") == b"run-a,run-c,run-d"
    # A caller that sends no primaries (an earlier version) changes nothing of them.
    left, _behind, _mark = await store(redis, keys, "run-a")
    assert 0 < left <= SETTLE_MS
    assert await redis.hget(keys.store, "nodes") == b"run-a,run-c,run-d"


async def test_on_a_cluster_callers_with_other_default_nodes_start_no_settle(
    redis: Redis, keys: Keys
) -> None:
    """Two processes whose clients chose other default nodes (a client picks one again
    each time it reads the slots, after a CLUSTERDOWN) send other run ids for the same
    primaries: no change. Each calling it one kept the settle from ever ending, and no
    lease was swept again (a CI run of the queue's cluster test)."""
    primaries = "run-a,run-b,run-c"
    assert (await store(redis, keys, "run-a", nodes=primaries))[:2] == [0, 0]
    for default in ("run-b", "run-a", "run-c", "run-b"):
        assert (await store(redis, keys, default, nodes=primaries))[:2] == [0, 0]
    assert await redis.hget(keys.store, "nodes") == primaries.encode()


async def test_a_settle_that_ended_leaves_nothing_to_wait_for(redis: Redis, keys: Keys) -> None:
    past = await now_ms(redis, keys.store) - 1
    await redis.hset(keys.store, mapping={"runId": "run-b", "settleUntil": past})
    assert (await store(redis, keys, "run-b"))[:2] == [0, 0]


async def test_the_mark_never_goes_down_and_a_caller_behind_it_changes_nothing(
    redis: Redis, keys: Keys
) -> None:
    *_, first = await store(redis, keys, "run-a")
    *_, second = await store(redis, keys, "run-a", seen=first)
    assert second >= first
    # A caller that remembers less than the store has (another was given a higher
    # mark since): nothing lost.
    await redis.hset(keys.store, "mark", second + 10_000)
    settle, behind, third = await store(redis, keys, "run-a", seen=first)
    assert (settle, behind) == (0, 0) and third >= second
    # A mark ahead of the clock (another server's clock was ahead) is kept, not lowered.
    ahead = await now_ms(redis, keys.store) + 3_600_000
    await redis.hset(keys.store, "mark", ahead)
    assert (await store(redis, keys, "run-a", seen=ahead))[1:] == [0, ahead]


async def test_a_store_behind_a_callers_mark_holds_deadlines_for_the_wait_asked(
    redis: Redis, keys: Keys
) -> None:
    """An older snapshot restored: the store's mark is below one a process was given."""
    *_, old = await store(redis, keys, "run-a")
    *_, newer = await store(redis, keys, "run-a", seen=old + 5_000)
    assert newer >= old + 5_000
    await redis.hset(keys.store, "mark", old)  # the restore: later writes are lost
    before = await now_ms(redis, keys.store)
    settle, behind, mark = await store(redis, keys, "run-b", seen=newer)
    after = await now_ms(redis, keys.store)
    assert settle == SETTLE_MS and behind == BEHIND_MS
    assert mark >= newer  # no other caller is found behind by the same loss again
    until = int(await redis.hget(keys.store, "behindUntil") or 0)
    assert before + BEHIND_MS <= until <= after + BEHIND_MS
    # Every caller is told what is left of the wait, whatever it remembers.
    _settle, left, _mark = await store(redis, keys, "run-b")
    assert 0 < left <= BEHIND_MS
    past = await now_ms(redis, keys.store) - 1
    await redis.hset(keys.store, "behindUntil", past)
    assert (await store(redis, keys, "run-b", seen=mark))[1] == 0


async def test_a_store_that_came_back_empty_settles_and_is_behind(redis: Redis, keys: Keys) -> None:
    """It forgot every id owners showed, and a pause a process stores again into it
    (finals.py) is older than what they did since: behind, as an older snapshot is. And
    it settles, as a restart that kept its data does: the owner that resumed that pause
    re-asserts its run meanwhile, before a second resume could be accepted (the
    fresh-eyes review of e37bdfa: 202 for both, 0.2 s after the restore)."""
    await redis.delete(keys.store)
    far = await now_ms(redis, keys.store) + 3_600_000
    settle, behind, mark = await store(redis, keys, "run-c", seen=far)
    assert (settle, behind, mark) == (SETTLE_MS, BEHIND_MS, far)
    # Every other caller is told the same wait, whatever mark it saw.
    _settle, left, _mark = await store(redis, keys, "run-c")
    assert 0 < left <= BEHIND_MS


async def test_a_new_process_answered_first_by_a_store_that_came_back_empty_hides_nothing(
    redis: Redis, keys: Keys
) -> None:
    """A process that starts while the store is away (it remembers no mark) can be the
    first to call once it came back empty: the processes that saw marks before are
    still told it is behind (the fresh-eyes review of e37bdfa: the new process recorded
    the store as new, with a mark above every older one, and nobody found it behind)."""
    # The mark a process was given a few seconds before the store went away.
    seen = await now_ms(redis, keys.store) - 5_000
    await redis.delete(keys.store)  # the store came back empty
    settle, behind, _mark = await store(redis, keys, "run-b")  # a new process: no mark
    assert (settle, behind) == (0, 0)  # it cannot tell a new store from an emptied one
    settle, behind, _mark = await store(redis, keys, "run-b", seen=seen)
    assert (settle, behind) == (SETTLE_MS, BEHIND_MS)
    # Found once: another such caller is told what is left, not a new wait.
    assert await redis.hget(keys.store, "born") is None
    _settle, left, _mark = await store(redis, keys, "run-b", seen=seen - 1_000)
    assert 0 < left <= BEHIND_MS


async def test_a_new_process_answered_first_by_an_older_snapshot_hides_nothing(
    redis: Redis, keys: Keys
) -> None:
    """The same with an older snapshot: a caller that remembers no mark does not raise
    the store's mark over the ones the processes that saw the lost writes remember."""
    *_, seen = await store(redis, keys, "run-a")
    await redis.hset(keys.store, "born", seen - 60_000)  # the key was made long before
    await redis.hset(keys.store, "mark", seen - 10_000)  # a snapshot 10 s older
    settle, behind, given = await store(redis, keys, "run-b")  # a new process: no mark
    assert (settle, behind) == (SETTLE_MS, 0)
    _settle, behind, _mark = await store(redis, keys, "run-b", seen=seen)
    assert behind == BEHIND_MS
    # The new process is not told the store is behind what it was given itself.
    await redis.hset(keys.store, "behindUntil", 0)
    assert (await store(redis, keys, "run-b", seen=given))[1] == 0


async def test_when_the_store_was_last_found_behind_is_kept_and_told_to_every_caller(
    redis: Redis, keys: Keys
) -> None:
    """restoredAt: an execution no owner wrote since then is as the store brought it
    back, however long ago that was (takeovers.py ``recall``). 0 until found behind;
    a store found behind again later moves it on; emptied stores count too."""
    *_, mark, restored = await store_all(redis, keys, "run-a")
    assert restored == 0
    await redis.hset(keys.store, "mark", mark - 5_000)  # an older snapshot
    before = await now_ms(redis, keys.store)
    *_, first = await store_all(redis, keys, "run-b", seen=mark)
    assert first >= before
    assert (await store_all(redis, keys, "run-b"))[3] == first  # told, not moved
    assert (await store_all(redis, keys, "run-b", seen=mark))[3] == first
    await redis.delete(keys.store)  # later, it came back empty
    *_, emptied = await store_all(redis, keys, "run-c", seen=mark + 60_000)
    assert emptied >= first
    assert int(await redis.hget(keys.store, "restoredAt") or 0) == emptied
