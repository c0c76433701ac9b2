"""outbox.lua's "next" and its wakes on a real Valkey: how long a delivery process may
wait before something is due, and the publish that tells it to ask again whenever
something may be due sooner (a hint, a delivery owed, a retry scheduled). The loop that
uses them polls nothing (lib/webhooks/deliver.py)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from lib.webhooks.outbox import HINT_DELAY_MS, PENDING, Delivery, Outbox, hint


async def wakes_during(redis: Redis, channel: str, work: object) -> int:
    """How many wakes were published on ``channel`` while ``work`` (awaited) ran."""
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)
    try:
        await pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        await work  # type: ignore[misc]
        heard = 0
        while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2):
            heard += 1
        return heard
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]


@pytest.mark.timeout(30)
async def test_next_says_how_long_until_something_is_due_and_changes_wake_the_processes(
    redis: Redis, unique: str
) -> None:
    prefix = f"next{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
    assert await outbox.next_ms() == -1  # nothing: wait for a wake
    await hint(redis, prefix, "ex_1", [3])
    assert 0 < await outbox.next_ms() <= HINT_DELAY_MS  # the hint, once its delay is over
    assert await wakes_during(redis, outbox.keys.wake, hint(redis, prefix, "ex_1", [4])) == 1
    await outbox.drop_hint("ex_1", 4)
    state = {"state": PENDING, "attempts": 0, "hook": "http://127.0.0.1:9/", "url": "u"}
    owed = outbox.owe("acme", "ex_1", 3, {0: state}, b"{}")
    assert await wakes_during(redis, outbox.keys.wake, owed) == 1
    assert await outbox.next_ms() == 0  # the delivery is due now
    delivery = await outbox.take("acme", lease_ms=60_000)
    assert delivery == Delivery("acme", "ex_1", 3, 0)
    assert await outbox.next_ms() > 50_000  # leased: due again when the lease is over
    retried = outbox.settle(delivery, state, 5_000)
    assert await wakes_during(redis, outbox.keys.wake, retried) == 1
    assert 0 < await outbox.next_ms() <= 5_000
    over = outbox.settle(delivery, {**state, "state": "delivered"}, None)
    assert await wakes_during(redis, outbox.keys.wake, over) == 0  # nothing sooner
    assert await outbox.next_ms() == -1


@pytest.mark.timeout(30)
async def test_an_attempt_settled_after_a_restore_lost_its_delivery_does_not_delay_it(
    redis: Redis, unique: str
) -> None:
    """An attempt records its outcome, then settles: a Valkey restored from a snapshot
    taken before the delivery was owed, between the two, lost it. The settle that then
    comes must not bring it back due a retry later (600 s in the webhook restore test,
    where the owe that follows, NX, kept that time and nothing was delivered); the end
    stored again is owed due now."""
    prefix = f"restored{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
    state = {"state": PENDING, "attempts": 0, "hook": "http://127.0.0.1:9/", "url": "u"}
    await outbox.owe("acme", "ex_1", 8, {0: state}, b"{}")
    delivery = await outbox.take("acme", lease_ms=60_000)
    assert delivery == Delivery("acme", "ex_1", 8, 0)
    # The restore: the snapshot predates the delivery (and everything of the outbox).
    await redis.delete(*(await redis.keys(f"{prefix}:*")))
    await outbox.settle(delivery, {**state, "attempts": 1}, 600_000)
    assert await redis.zscore(outbox.keys.due("acme"), delivery.member) is None
    await outbox.owe("acme", "ex_1", 8, {0: state}, b"{}")  # the end stored again
    assert await outbox.next_ms() == 0
    assert await outbox.take("acme", lease_ms=60_000) == delivery
