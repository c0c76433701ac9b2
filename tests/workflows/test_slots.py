"""Provider slots (lib/workflows/slots.py + slots.lua) on a real Valkey server.

Two ``Slots`` objects on one prefix behave as two replicas: each has its own line of
waiters and its own clients, and they share the provider's keys.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from lib.tenancy import CURRENT_TENANT
from lib.workflows.slots import SlotLost, Slots
from tests.support.api import until, within
from tests.support.faults import crash_and_restart
from tests.support.servers import ValkeyServer
from tests.support.timing import hold_for

PROVIDER = "p"

Replica = Callable[..., Slots]


@pytest.fixture
def prefix(unique: str) -> str:
    return f"slots-{unique}"


@pytest.fixture
def keys(prefix: str) -> list[str]:
    """holders, queue, waiters, fair, freed, pause, store (the order slots.lua takes them)."""
    return Keys(prefix).slots(PROVIDER)


@pytest.fixture
async def replica(valkey: ValkeyServer, prefix: str, unique: str) -> AsyncIterator[Replica]:
    """Builds Slots objects on the test's prefix, each with clients of its own."""
    made: list[Slots] = []
    clients: list[Redis] = []

    def build(lease_seconds: float = 15.0) -> Slots:
        redis = Redis.from_url(valkey.url, client_name=f"slots-{unique}")
        tail = Redis.from_url(valkey.url)
        clients.extend((redis, tail))
        slots = Slots(redis=redis, tail_redis=tail, prefix=prefix, lease_seconds=lease_seconds)
        made.append(slots)
        return slots

    yield build
    for slots in made:
        await slots.close()
    for client in clients:
        await client.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 5.0) -> None:
    """Poll ``check`` until it holds."""
    await until(check, what, timeout, every=0.01)


async def queued(redis: Redis, keys: list[str], count: int) -> None:
    """Wait until ``count`` waiters stand in the provider's line in Redis."""

    async def check() -> bool:
        return int(await redis.zcard(keys[1])) == count

    await eventually(check, f"{count} waiters in line")


async def holding(slots: Slots, cap: int, release: asyncio.Event, held: asyncio.Event) -> None:
    """Hold a slot until ``release`` is set."""
    async with slots.hold(PROVIDER, cap):
        held.set()
        await release.wait()


async def test_holders_on_two_replicas_never_exceed_the_cap(replica: Replica) -> None:
    first, second = replica(), replica()
    in_flight = peak = finished = 0

    async def call(slots: Slots) -> None:
        nonlocal in_flight, peak, finished
        async with slots.hold(PROVIDER, 3):
            in_flight += 1
            peak = max(peak, in_flight)
            await hold_for(0.005, "the provider call's work")
            in_flight -= 1
        finished += 1

    async with asyncio.TaskGroup() as group:
        for n in range(30):
            group.create_task(call(first if n % 2 else second))

    assert finished == 30
    assert 1 <= peak <= 3


async def test_waiters_on_two_replicas_are_served_in_arrival_order(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    # Each replica also caps itself locally at ``cap``, so the cap is 3 (not 1) to let
    # three waiters of each replica stand in the shared line; three slots taken by
    # tokens that never renew (a 30 s lease outlives the test) leave one to pass along.
    cap = 3
    first, second = replica(lease_seconds=30), replica(lease_seconds=30)
    for n in range(cap):
        granted, *_ = await first._call(PROVIDER, "acquire", f"taken-{n}", cap)
        assert granted == 1
    served: list[int] = []

    async def wait(n: int, slots: Slots) -> None:
        async with slots.hold(PROVIDER, cap):
            served.append(n)

    waiters = []
    for n in range(6):
        waiters.append(asyncio.create_task(wait(n, (first, second)[n % 2])))
        await queued(redis, keys, n + 1)

    assert await first._call(PROVIDER, "release", "taken-0", 0) == 1
    await asyncio.wait_for(asyncio.gather(*waiters), 10)

    assert served == [0, 1, 2, 3, 4, 5]


def as_tenant(tenant: str, call: Awaitable[None]) -> asyncio.Task[None]:
    """``call`` in a task of its own, working for ``tenant``."""
    context = contextvars.copy_context()
    context.run(CURRENT_TENANT.set, tenant)
    return asyncio.get_running_loop().create_task(call, context=context)


async def test_slots_are_shared_fairly_between_the_tenants_waiting_across_replicas(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    """Step 16's review (row 7): with a cap of 2 and ten queued 4 s calls of tenant A,
    tenant B's one call waited ~19.6 s, served after all of A's. In the shared line
    (slots.lua) B's first call now stands beside A's first, whatever A queued before."""
    cap = 3
    first, second = replica(lease_seconds=30), replica(lease_seconds=30)
    for n in range(cap):
        granted, *_ = await first._call(PROVIDER, "acquire", f"taken-{n}", cap)
        assert granted == 1
    served: list[str] = []

    done = asyncio.Event()

    async def wait(name: str, slots: Slots) -> None:
        async with slots.hold(PROVIDER, cap):
            served.append(name)
            await done.wait()  # held: each release below frees exactly one slot

    waiters = [as_tenant("a", wait(f"a{n}", first)) for n in range(cap)]
    await queued(redis, keys, cap)
    waiters.append(as_tenant("b", wait("b0", second)))
    await queued(redis, keys, cap + 1)
    for n in range(2):  # one slot at a time
        assert await first._call(PROVIDER, "release", f"taken-{n}", 0) == 1
        await eventually(lambda n=n: _served(served, n + 1), f"{n + 1} served")
    done.set()
    assert await first._call(PROVIDER, "release", f"taken-{cap - 1}", 0) == 1
    async with asyncio.timeout(10):
        await asyncio.gather(*waiters)
    assert served.index("b0") <= 1, served  # first come, first served: last (3)


async def _served(served: list[str], count: int) -> bool:
    return len(served) >= count


async def test_a_replicas_own_line_is_shared_fairly_between_tenants(replica: Replica) -> None:
    """The same in one process: past the cap, calls wait in the replica's own line
    before they ask Redis; B's one call goes in next to A's second, not after A's five."""
    slots = replica()
    release = asyncio.Event()
    held = asyncio.Event()
    first = as_tenant("a", holding(slots, 1, release, held))
    await held.wait()
    served: list[str] = []

    async def call(name: str) -> None:
        async with slots.hold(PROVIDER, 1):
            served.append(name)

    def in_line(count: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return len(slots._lines[PROVIDER].local) == count

        return check

    waiters = [as_tenant("a", call(f"a{n}")) for n in range(5)]
    await eventually(in_line(5), "A's calls in the replica's line")
    waiters.append(as_tenant("b", call("b0")))
    await eventually(in_line(6), "B's call in the replica's line")
    release.set()
    async with asyncio.timeout(10):
        await asyncio.gather(first, *waiters)
    assert served.index("b0") <= 1, served  # first come, first served: last (5)


async def test_a_tenant_whose_calls_were_cancelled_in_line_keeps_its_turn_across_replicas(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    """The step 16 fresh-eyes review: a call cancelled in line (its block timed out, its
    execution was cancelled) still moved its tenant's last place on in slots.lua's
    fair hash. After A's three calls queued and were cancelled, A's next call stood
    behind the three B queued meanwhile (served last of four): A waited for calls that
    no longer existed, for as long as other tenants kept the line busy."""
    cap = 3
    first, second = replica(lease_seconds=30), replica(lease_seconds=30)
    for n in range(cap):
        granted, *_ = await first._call(PROVIDER, "acquire", f"taken-{n}", cap)
        assert granted == 1
    served: list[str] = []

    done = asyncio.Event()

    async def wait(name: str, slots: Slots) -> None:
        async with slots.hold(PROVIDER, cap):
            served.append(name)
            await done.wait()  # held: each release below frees exactly one slot

    gone = [as_tenant("a", wait(f"gone{n}", first)) for n in range(cap)]
    await queued(redis, keys, cap)
    for task in gone:
        task.cancel()
    await asyncio.gather(*gone, return_exceptions=True)
    await queued(redis, keys, 0)
    waiters = [as_tenant("b", wait(f"b{n}", second)) for n in range(cap)]
    await queued(redis, keys, cap)
    waiters.append(as_tenant("a", wait("a0", first)))
    await queued(redis, keys, cap + 1)
    for n in range(2):  # one slot at a time
        assert await first._call(PROVIDER, "release", f"taken-{n}", 0) == 1
        await eventually(lambda n=n: _served(served, n + 1), f"{n + 1} served")
    done.set()
    assert await first._call(PROVIDER, "release", f"taken-{cap - 1}", 0) == 1
    async with asyncio.timeout(10):
        await asyncio.gather(*waiters)
    assert served.index("a0") <= 1, served  # behind its cancelled calls: last (3)


async def test_a_tenant_whose_calls_were_cancelled_in_a_replicas_line_keeps_its_turn(
    replica: Replica,
) -> None:
    """The same in one process's own line (the step 16 fresh-eyes review): A's five
    calls cancelled while they waited there put A's next call behind B's three."""
    slots = replica()
    release = asyncio.Event()
    held = asyncio.Event()
    first = as_tenant("c", holding(slots, 1, release, held))
    await held.wait()
    served: list[str] = []

    async def call(name: str) -> None:
        async with slots.hold(PROVIDER, 1):
            served.append(name)

    line = slots._lines[PROVIDER].local

    def in_line(count: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return len(line) == count

        return check

    gone = [as_tenant("a", call(f"gone{n}")) for n in range(5)]
    await eventually(in_line(5), "A's calls in the replica's line")
    for task in gone:
        task.cancel()
    await asyncio.gather(*gone, return_exceptions=True)
    waiters = [as_tenant("b", call(f"b{n}")) for n in range(3)]
    await eventually(in_line(8), "B's calls in the replica's line")
    waiters.append(as_tenant("a", call("a0")))
    await eventually(in_line(9), "A's call in the replica's line")
    release.set()
    async with asyncio.timeout(10):
        await asyncio.gather(first, *waiters)
    assert served.index("a0") <= 1, served  # behind its cancelled calls: last (3)


async def test_a_dead_holder_stops_counting_when_its_lease_ends(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    slots = replica(lease_seconds=1)
    started = time.monotonic()
    granted, *_ = await slots._call(PROVIDER, "acquire", "ghost", 1)  # never renewed
    assert granted == 1

    async def wait() -> float:
        async with slots.hold(PROVIDER, 1):
            return time.monotonic()

    served_at = await asyncio.wait_for(wait(), 5)

    assert served_at - started >= 0.9  # not before the ghost's lease ended
    assert await redis.zscore(keys[0], "ghost") is None


async def test_a_waiter_that_stops_asking_loses_its_place_after_a_lease(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    first, second = replica(lease_seconds=1), replica(lease_seconds=1)
    release, held = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(holding(first, 1, release, held))
    await asyncio.wait_for(held.wait(), 5)
    granted, *_ = await first._call(PROVIDER, "acquire", "gone-waiter", 1)  # asks once
    assert granted == 0

    async def wait() -> None:
        async with second.hold(PROVIDER, 1):
            pass

    waiter = asyncio.create_task(wait())
    await queued(redis, keys, 2)
    assert (await redis.zrange(keys[1], 0, 0)) == [b"gone-waiter"]

    release.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), 5)

    assert await redis.zscore(keys[1], "gone-waiter") is None
    assert await redis.zscore(keys[0], "gone-waiter") is None


async def test_a_release_wakes_a_waiter_on_another_replica_through_the_freed_stream(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    # A 30 s lease: a waiter asking on its own timer would ask again only after 10 s.
    first, second = replica(lease_seconds=30), replica(lease_seconds=30)
    release, held = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(holding(first, 1, release, held))
    await asyncio.wait_for(held.wait(), 5)
    served = asyncio.Event()

    async def wait() -> None:
        async with second.hold(PROVIDER, 1):
            served.set()

    waiter = asyncio.create_task(wait())
    await queued(redis, keys, 1)
    assert not served.is_set()

    release.set()
    await asyncio.wait_for(served.wait(), 2)
    await asyncio.gather(holder, waiter)


async def test_a_pause_holds_every_replica_until_it_passes_and_a_shorter_one_does_not_cut_it(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    first, second = replica(lease_seconds=3), replica(lease_seconds=3)
    started = time.monotonic()
    await first.pause(PROVIDER, 1.0)
    await first.pause(PROVIDER, 0.1)
    # The 1 s pause is left whole (the 0.1 s one would leave at most 100 ms): at least
    # 1 s less the time since it was set, however slowly the test ran meanwhile.
    left = await redis.pttl(keys[5])
    assert left >= 1000 - (time.monotonic() - started) * 1000 - 1, left
    paused_when_served: list[int] = []

    async def wait() -> float:
        async with second.hold(PROVIDER, 1):
            paused_when_served.append(await redis.exists(keys[5]))
            return time.monotonic()

    waiter = asyncio.create_task(wait())
    await queued(redis, keys, 1)
    assert await redis.pttl(keys[5]) > 0
    assert not waiter.done()

    served_at = await asyncio.wait_for(waiter, 5)

    assert served_at - started >= 0.9
    assert paused_when_served == [0]


async def test_without_redis_a_hold_waits_until_redis_answers_however_long(
    caplog: pytest.LogCaptureFixture, own_valkey: ValkeyServer, unique: str
) -> None:
    """SPEC §2.1: the cap holds across all replicas and calls over it wait. A process
    that cannot reach the shared semaphore cannot know it is under the cap, so no call
    goes ahead, past a lease of outage too, until Redis answers again.

    Found by the step 15 fault review: a holder cut off from Redis stopped its call,
    then its retry went ahead under its process's own cap after a lease of outage (the
    old fallback), beside the caller on another replica granted its slot.
    """
    redis = Redis.from_url(own_valkey.url, socket_connect_timeout=0.2)
    slots = Slots(redis=redis, tail_redis=redis, prefix=f"slots-{unique}", lease_seconds=1)
    in_flight = peak = finished = 0
    two_in = asyncio.Event()

    async def call() -> None:
        nonlocal in_flight, peak, finished
        async with slots.hold(PROVIDER, 2):
            in_flight += 1
            peak = max(peak, in_flight)
            if in_flight == 2:
                two_in.set()
            # The first two stay until both are in; the third enters after them.
            await asyncio.wait_for(two_in.wait(), 10)
            in_flight -= 1
        finished += 1

    def told() -> bool:
        return "provider slots unreachable: calls wait until Redis answers" in caplog.messages

    try:
        await slots.introduce([PROVIDER])  # the server is known: its restart is noticed
        own_valkey.kill()
        with caplog.at_level(logging.WARNING, logger="lib.workflows.slots"):
            async with asyncio.TaskGroup() as group:
                for _ in range(3):
                    group.create_task(call())
                # A whole lease of outage passed (the waiters said so): nobody went ahead.
                await until(told, "the waiters said a lease of outage passed", timeout=10)
                assert (peak, finished) == (0, 0)
                await own_valkey.start()
    finally:
        await slots.close()
        await redis.aclose()

    assert finished == 3
    assert peak == 2


async def test_a_providers_keys_share_one_hash_tag_and_expire(
    replica: Replica, redis: Redis, prefix: str
) -> None:
    keys = Keys(prefix).slots(PROVIDER)
    assert all(f"{{llm:{PROVIDER}}}" in key for key in keys)
    slots = replica(lease_seconds=1)

    # A holder that dies before its first renew must not leave a key for ever.
    granted, *_ = await slots._call(PROVIDER, "acquire", "ghost", 1)
    assert granted == 1
    assert await redis.pttl(keys[0]) > 0

    granted, *_ = await slots._call(PROVIDER, "acquire", "gone-waiter", 1)
    assert granted == 0
    assert await slots._call(PROVIDER, "release", "ghost", 0) == 1
    await slots.pause(PROVIDER, 1.0)
    for key in keys[1:]:
        assert await redis.pttl(key) > 0, key


async def test_a_waiter_cancelled_in_line_gives_up_its_place_at_once(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    # A 30 s lease: a place kept until the line drops it would hold the next waiter 30 s.
    first, second, third = (replica(lease_seconds=30) for _ in range(3))
    release, held = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(holding(first, 1, release, held))
    await asyncio.wait_for(held.wait(), 5)
    cancelled = asyncio.create_task(holding(second, 1, asyncio.Event(), asyncio.Event()))
    await queued(redis, keys, 1)

    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await queued(redis, keys, 0)

    served = asyncio.Event()
    waiter = asyncio.create_task(holding(third, 1, asyncio.Event(), served))
    await queued(redis, keys, 1)
    release.set()
    await asyncio.wait_for(served.wait(), 2)
    waiter.cancel()
    await asyncio.gather(holder, waiter, return_exceptions=True)


async def test_a_waiter_does_not_spin_after_the_freed_stream_expired(
    replica: Replica, redis: Redis, keys: list[str], unique: str
) -> None:
    # A line that has seen a freed slot remembers its id; when the provider sat idle
    # long enough for its keys to expire, the stream starts again from empty.
    slots = replica(lease_seconds=3)
    granted, *_ = await slots._call(PROVIDER, "acquire", "earlier", 1)
    assert granted == 1
    release, held = asyncio.Event(), asyncio.Event()
    earlier = asyncio.create_task(holding(slots, 1, release, held))
    await queued(redis, keys, 1)
    assert await slots._call(PROVIDER, "release", "earlier", 0) == 1
    await asyncio.wait_for(held.wait(), 5)
    release.set()
    await earlier
    await redis.pexpire(keys[4], 1)

    async def stream_gone() -> bool:
        return int(await redis.exists(keys[4])) == 0

    await eventually(stream_gone, "the freed stream expired")

    async def commands() -> int:
        clients = await redis.client_list()
        return sum(int(c["tot-cmds"]) for c in clients if c["name"] == f"slots-{unique}")

    granted, *_ = await slots._call(PROVIDER, "acquire", "ghost", 1)  # renews nothing
    assert granted == 1
    waiter = asyncio.create_task(holding(slots, 1, asyncio.Event(), asyncio.Event()))
    await queued(redis, keys, 1)
    before = await commands()
    done, _ = await asyncio.wait([waiter], timeout=0.5)  # a window to count asks in
    asked = await commands() - before
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)

    assert not done
    # The waiter asks again once a second (a third of its lease), not in a loop.
    assert asked <= 5


async def test_a_renewal_never_brings_back_a_holder_that_is_gone(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    """Found by the step 15 fault review (F4): a holder stalled past its lease renewed
    itself back in after the next caller got its slot: two calls with a cap of 1."""
    slots = replica(lease_seconds=1)
    granted, *_ = await slots._call(PROVIDER, "acquire", "stalled", 1)
    assert granted == 1
    held, _server = await slots._call(PROVIDER, "renew", "stalled", 0)
    assert held == 1
    await redis.zrem(keys[0], "stalled")  # its lease ended and the slot went on
    granted, *_ = await slots._call(PROVIDER, "acquire", "next", 1)
    assert granted == 1
    held, _server = await slots._call(PROVIDER, "renew", "stalled", 0)
    assert held == 0
    assert await redis.zrange(keys[0], 0, -1) == [b"next"]


async def test_a_holder_whose_slot_is_gone_is_stopped_with_slot_lost(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    """Found by the step 15 fault review (F4): the store forgot a holder (a restart,
    empty) while its call went on."""
    slots = replica(lease_seconds=1)
    entered = asyncio.Event()

    async def call() -> None:
        async with slots.hold(PROVIDER, 1):
            entered.set()
            await hold_for(30, "a long call, stopped by the lost slot")

    task = asyncio.create_task(call())
    await asyncio.wait_for(entered.wait(), 5)
    began = time.monotonic()
    await redis.delete(keys[0])
    with pytest.raises(SlotLost):
        await asyncio.wait_for(task, 5)
    # Within about one renewal period (a third of the lease).
    print(f"\nstopped {time.monotonic() - began:.2f} s after the store lost the holder")
    assert not task.cancelled()
    # Only the lost slot's own cancel became SlotLost: an outer cancel stays a cancel.
    outer = asyncio.create_task(call())
    entered.clear()
    await asyncio.wait_for(entered.wait(), 5)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


async def test_after_the_keys_answer_from_another_server_grants_wait_one_lease(
    replica: Replica, redis: Redis, keys: list[str]
) -> None:
    """Found by the step 15 fault review (F4): Redis restarted empty forgot the holders
    and granted a waiter while the old call still streamed. A caller that saw another
    server answer before (here: told so) holds grants back for one lease."""
    slots = replica(lease_seconds=1)
    granted, *_ = await slots._call(PROVIDER, "acquire", "before", 1)
    assert granted == 1
    assert await slots._call(PROVIDER, "release", "before", 0) == 1
    slots._servers[PROVIDER] = "a-server-that-is-gone"
    seen_at = time.monotonic()
    granted, wait_ms, *_ = await slots._call(PROVIDER, "acquire", "after", 1)
    assert granted == 0 and 0 < wait_ms <= 1000

    async def wait() -> float:
        async with slots.hold(PROVIDER, 1):
            return time.monotonic()

    await slots._call(PROVIDER, "release", "after", 0)
    served_at = await asyncio.wait_for(wait(), 5)
    assert served_at - seen_at >= 0.9  # not before one lease after the change was seen
    assert int(await redis.hget(keys[6], "grantsFrom")) > 0


async def test_a_holder_on_one_replica_keeps_its_slot_across_a_redis_restart_and_the_other_waits(
    own_valkey: ValkeyServer, unique: str
) -> None:
    """The step 15 second fault review: a call waits for its slot while Redis is down
    (no more going ahead under its own process's cap). Here the cap is 1, replica A
    holds the slot and B waits when Redis restarts from its AOF: B is granted only once
    A released it, never beside it, and then at once (no wait left over from the
    outage).

    The lease is many times what a restart takes here (a probe restart first): A's
    holder must renew across the restart. Its last renewal can be a third of a lease
    before the kill, and it is trusted for two thirds of one (``TRUST``), so the restart
    must take under a third of a lease. Clean-clone runs beside other work stopped A's
    call, rightly, on a fixed 1 s lease and then on four probes (a restart 1.33x its
    probe); ten probes leave a restart 3.3x its probe."""
    clients: list[Redis] = []
    began = time.monotonic()
    await crash_and_restart(own_valkey)
    lease = min(12.0, max(1.5, 10 * (time.monotonic() - began)))  # within the 60 s timeout

    def build() -> Slots:
        redis = Redis.from_url(own_valkey.url, socket_connect_timeout=0.2)
        clients.append(redis)
        return Slots(redis=redis, tail_redis=redis, prefix=f"slots-{unique}", lease_seconds=lease)

    a, b = build(), build()
    inside: list[str] = []
    overlaps: list[list[str]] = []
    release_a = asyncio.Event()
    a_in, b_in = asyncio.Event(), asyncio.Event()

    async def call(slots: Slots, name: str, entered: asyncio.Event, leave: asyncio.Event) -> None:
        async with slots.hold(PROVIDER, 1):
            inside.append(name)
            if len(inside) > 1:
                overlaps.append(list(inside))
            entered.set()
            await leave.wait()
            inside.remove(name)

    try:
        await a.introduce([PROVIDER])
        await b.introduce([PROVIDER])
        async with asyncio.TaskGroup() as group:
            group.create_task(call(a, "a", a_in, release_a))
            await asyncio.wait_for(a_in.wait(), 5)
            done_b = asyncio.Event()
            done_b.set()
            group.create_task(call(b, "b", b_in, done_b))
            await asyncio.wait_for(
                queued(clients[0], Keys(f"slots-{unique}").slots(PROVIDER), 1), 5
            )
            await crash_and_restart(own_valkey)
            # Two leases past the restart (A's renewals answered again meanwhile): B is
            # still in line, A still holds.
            moved = await within(
                lambda: b_in.is_set() or inside != ["a"], 2 * lease + 0.5, every=0.05
            )
            assert moved is None, inside
            released = time.monotonic()
            release_a.set()
            await asyncio.wait_for(b_in.wait(), 5)
            print(f"\nB granted {time.monotonic() - released:.3f} s after A released")
    finally:
        for slots in (a, b):
            await slots.close()
        for client in clients:
            await client.aclose()
    assert overlaps == []
