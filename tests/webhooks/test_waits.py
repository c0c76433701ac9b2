"""How the delivery loop waits (lib/webhooks/deliver.py): it polls nothing, and it must
not spin either when something is due that it may not take now. An in-process
deliverer against a real Valkey and a real receiver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from lib.webhooks import deliver
from lib.webhooks.deliver import Deliverer
from lib.webhooks.outbox import PENDING, Outbox
from lib.webhooks.signing import WebhookSecrets
from tests.support.api import until
from tests.support.receiver import HANG, receiving


class Counted(Outbox):
    """The outbox, counting how often the loop asks how long to wait."""

    asked = 0

    async def next_ms(self) -> int:
        self.asked += 1
        return await super().next_ms()


@pytest.mark.timeout(30)
async def test_a_tenant_at_its_share_with_more_due_does_not_spin_the_loop(
    redis: Redis, unique: str
) -> None:
    """A tenant at its share of the attempt slots (half of them) with more deliveries
    due: the loop cannot take them, yet "next" says one is due now (0 ms). It waited 0 s
    and asked again, thousands of times a second for as long as the attempts hung (a
    receiver that never answers: up to the attempt's timeout), three Redis calls a turn."""
    prefix = f"spin{unique}"
    outbox = Counted(redis=redis, prefix=prefix, keep_seconds=60)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    async with receiving(HANG, HANG, HANG) as receiver:
        state = {"state": PENDING, "attempts": 0, "hook": receiver.url, "url": receiver.url}
        for n in range(3):
            await outbox.owe("acme", f"ex_{n}", 4, {0: state}, b"{}")
        async with Deliverer(
            redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
            allow_private=True, concurrency=2, timeout_seconds=10.0, prefix=prefix,
        ):  # fmt: skip
            await receiver.wait_for(1)  # its one slot taken; two more due, not taken
            before = outbox.asked
            # The probe: how many turns one ordinary Redis round trip takes meanwhile.
            await asyncio.sleep(1.0)
            asked = outbox.asked - before
        assert len(receiver.received) == 1
    assert asked <= 3, f"the loop asked {asked} times in 1 s while nothing could be taken"


class FailingOnce(Outbox):
    """The outbox, its first look failing with an error the loop does not expect."""

    failed = False

    async def look(self, lease_ms: int, limit: int = 50) -> list[tuple[str, int]]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an unexpected failure")
        return await super().look(lease_ms, limit)


@pytest.mark.timeout(30)
async def test_the_loop_carries_on_after_an_unexpected_failure_in_its_first_turn(
    redis: Redis, unique: str
) -> None:
    """An unexpected failure is logged and the loop carries on: in its first turn it
    found no wait computed yet (UnboundLocalError), and the loop died for good."""
    prefix = f"fail{unique}"
    outbox = FailingOnce(redis=redis, prefix=prefix, keep_seconds=60)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    async with receiving() as receiver:
        state = {"state": PENDING, "attempts": 0, "hook": receiver.url, "url": receiver.url}
        await outbox.owe("acme", "ex_1", 4, {0: state}, b"{}")
        async with Deliverer(
            redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
            allow_private=True, timeout_seconds=5.0, prefix=prefix,
        ):  # fmt: skip

            async def delivered() -> bool:
                [after] = await outbox.states("ex_1")
                return bool(after["state"] == "delivered")

            await until(delivered, "the delivery made after the failure", 10)
    assert outbox.failed
    assert len(receiver.received) == 1


class WakeBetween(Outbox):
    """The outbox, a delivery owed by another process right after the loop's first
    "next" answered (nothing due), its wake heard (set by the tails) before the loop
    goes on: the publish arrives on the subscription's connection as "next"'s answer
    arrives on the command connection, and either may be read first."""

    def __init__(
        self, *, wake: asyncio.Event, other: Outbox, state: dict[str, object], **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.wake, self.other, self.state = wake, other, state
        self.injected = False

    async def next_ms(self) -> int:
        due = await super().next_ms()
        if not self.injected:
            self.injected = True
            await self.other.owe("acme", "ex_late", 4, {0: self.state}, b"{}")
            self.wake.set()  # the tails heard the owe's publish
        return due


@pytest.mark.timeout(30)
async def test_a_wake_heard_while_the_loop_asks_how_long_to_wait_is_not_lost(
    redis: Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery owed anywhere just after the loop's "next" answered "nothing due": its
    wake was set while the loop still awaited that answer, and the loop cleared it
    before it waited, then slept ``IDLE_SECONDS`` (30 s) with the delivery due. The
    idle bound is made an hour here: the delivery is made on the wake or never."""
    monkeypatch.setattr(deliver, "IDLE_SECONDS", 3600.0)
    prefix = f"lost{unique}"
    wake = asyncio.Event()
    async with receiving() as receiver:
        state = {"state": PENDING, "attempts": 0, "hook": receiver.url, "url": receiver.url}
        other = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
        outbox = WakeBetween(
            wake=wake, other=other, state=state, redis=redis, prefix=prefix, keep_seconds=60
        )
        secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
        async with Deliverer(
            redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
            allow_private=True, timeout_seconds=5.0, prefix=prefix, wake=wake,
        ):  # fmt: skip

            async def delivered() -> bool:
                found = await outbox.states("ex_late")
                return bool(found and found[0]["state"] == "delivered")

            await until(delivered, "the delivery owed during the loop's look", 10)
    assert outbox.injected and len(receiver.received) == 1
