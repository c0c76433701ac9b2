"""Fair turns between many tenants (SPEC §14, §15: a delivery is work like any other,
fair per tenant): a tenant whose first delivery comes after many tenants' backlogs waits
one turn of each, not for a backlog to drain. An in-process deliverer against a real
Valkey and real receivers."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from lib.webhooks.deliver import Deliverer
from lib.webhooks.outbox import PENDING, Outbox
from lib.webhooks.signing import WebhookSecrets
from tests.support.receiver import receiving

# More tenants with a backlog than the deliverer reads due tenants at once (64), each
# with several deliveries due.
FLOODING, BACKLOG = 80, 4


@pytest.mark.timeout(60)
async def test_a_tenants_one_delivery_waits_one_turn_of_each_backlogged_tenant(
    redis: Redis, unique: str
) -> None:
    prefix = f"many{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=120)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    async with receiving(then=500) as flood, receiving() as lone:

        def state(url: str) -> dict[str, object]:
            return {"state": PENDING, "attempts": 0, "hook": url, "url": url}

        for t in range(FLOODING):
            for n in range(BACKLOG):
                await outbox.owe(f"t{t:03}", f"ex_{t}_{n}", 4, {0: state(flood.url)}, b"{}")
        await outbox.owe("zz-lone", "ex_lone", 4, {0: state(lone.url)}, b"{}")
        async with Deliverer(
            redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[600],
            allow_private=True, concurrency=2, timeout_seconds=5.0, prefix=prefix,
        ):  # fmt: skip
            await lone.wait_for(1)
            before = len(flood.received)
    # One turn of each backlogged tenant (and the attempts in flight) at most, not the
    # backlogs ({FLOODING * BACKLOG} attempts).
    assert before <= FLOODING + 2, f"{before} flood attempts went before the lone delivery"
