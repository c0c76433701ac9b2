"""The tenant's signing secret across rotations (SPEC §15: after a rotation both the
old and the new secret sign for 24 hours), against a real Valkey."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from lib.webhooks.signing import WebhookSecrets


@pytest.mark.timeout(10)
async def test_a_second_rotation_within_the_day_keeps_the_first_secret_signing(
    redis: Redis, unique: str
) -> None:
    """A receiver still on the first secret was promised 24 hours by the first rotation;
    a second rotation an hour later must not cut that short."""
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=f"sec{unique}")
    first = (await secrets.get("t")).current
    second = (await secrets.rotate("t")).current
    third = (await secrets.rotate("t")).current
    signing = (await secrets.get("t")).signing()
    assert signing[0] == third
    assert set(signing) == {first, second, third}, "a secret promised a day stopped signing"


@pytest.mark.timeout(10)
async def test_rotations_at_once_leave_every_answered_secret_signing(
    redis: Redis, unique: str
) -> None:
    """Operators (or a retried request) rotate at the same moment: each was answered a
    new secret, and each answered secret must sign (none silently overwritten)."""
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=f"sec{unique}")
    await secrets.get("t")
    answered = await asyncio.gather(*(secrets.rotate("t") for _ in range(8)))
    signing = (await secrets.get("t")).signing()
    lost = [found.current for found in answered if found.current not in signing]
    assert not lost, f"{len(lost)} of 8 answered secrets never sign"
