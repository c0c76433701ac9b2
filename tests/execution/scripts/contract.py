"""Helpers of the script contract tests: a script as the code registers it, Redis's
clock, the messages a script published, a user whose PUBLISH is refused."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoPermissionError, ResponseError

from lib.backend import PRELUDE, load_script, register

PACKAGE = "lib.execution"


def script(redis: Redis, name: str) -> AsyncScript:
    """``name`` registered exactly as lib/execution's modules register it."""
    return register(redis, PACKAGE, name)


async def now_ms(redis: Redis, key: str) -> int:
    """Redis's clock (ms) on the server that holds ``key``, read with the prelude's own
    ``now_ms``: the one clock every script reads."""
    clock = redis.register_script(f"{load_script(*PRELUDE)}\nreturn now_ms()")
    return int(await clock(keys=[key]))


async def refusal(call: Any) -> str:
    """The error reply a script call answers with (the test fails if it succeeds)."""
    try:
        reply = await call
    except ResponseError as exc:
        return str(exc)
    raise AssertionError(f"the script answered {reply!r} instead of refusing")


class Inbox:
    """The messages published on some channels, on one server, since it subscribed."""

    def __init__(self, subscriber: Redis, publisher: Redis, channels: tuple[str, ...]) -> None:
        self._pubsub = subscriber.pubsub()
        self._publisher = publisher
        self.channels = channels

    async def open(self) -> None:
        await self._pubsub.subscribe(*self.channels)
        # Subscribed once every confirmation arrived: only then is no message missed.
        confirmed = 0
        while confirmed < len(self.channels):
            message = await self._pubsub.get_message(timeout=5)
            if message is None:
                raise AssertionError(f"no confirmation of the subscription to {self.channels}")
            confirmed += message["type"] == "subscribe"

    async def received(self) -> list[tuple[str, Any]]:
        """Every (channel, message) published so far. A marker published after them on
        the same server ends the list: one server delivers its messages in order."""
        marker = f"marker-{uuid.uuid4().hex}"
        await self._publisher.publish(self.channels[0], marker)
        found: list[tuple[str, Any]] = []
        async with asyncio.timeout(10):
            while True:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
                if message is None:
                    continue
                data = message["data"].decode()
                if data == marker:
                    return found
                found.append((message["channel"].decode(), data))

    async def close(self) -> None:
        await self._pubsub.aclose()


@asynccontextmanager
async def inbox(url: str, *channels: str) -> AsyncIterator[Inbox]:
    """Subscribe to ``channels`` on the server at ``url`` for the block's duration."""
    subscriber, publisher = Redis.from_url(url), Redis.from_url(url)
    box = Inbox(subscriber, publisher, channels)
    try:
        await box.open()
        yield box
    finally:
        await box.close()
        await subscriber.aclose()
        await publisher.aclose()


@asynccontextmanager
async def publish_refused(url: str, *allowed: str) -> AsyncIterator[Redis]:
    """A client of a user who may run every command on every key but publish only on
    ``allowed`` channels (an ACL as a locked-down deployment would have)."""
    admin = Redis.from_url(url)
    name, password = f"nopub-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    channels = [f"&{channel}" for channel in allowed]
    await admin.execute_command(
        "ACL", "SETUSER", name, "reset", "on", f">{password}", "~*", "resetchannels",
        *channels, "+@all",
    )  # fmt: skip
    user = Redis.from_url(url, username=name, password=password)
    try:
        # The rule holds (else a test of a refused PUBLISH would test nothing).
        with pytest.raises(NoPermissionError):
            await user.publish("not-allowed", "x")
        yield user
    finally:
        await user.aclose()
        await admin.acl_deluser(name)
        await admin.aclose()
