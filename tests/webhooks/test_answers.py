"""An attempt against a receiver that answers oddly (SPEC §15): the deliverer reads
only the start of an answer (it keeps 200 characters of it), so a receiver that sends
an endless or huge body costs neither memory nor the attempt's outcome."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from lib.webhooks.deliver import Deliverer
from lib.webhooks.outbox import PENDING, Outbox
from lib.webhooks.signing import WebhookSecrets
from lib.workflows.blocks.base import IPAddress
from tests.support.receiver import receiving

CHUNK = b"x" * 65536


@dataclass
class Flood:
    """A receiver answering 200 with a chunked body that never ends; counts what it sent."""

    port: int = 0
    sent: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                await writer.drain()
                self.sent += len(CHUNK)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def flooding() -> AsyncIterator[Flood]:
    flood = Flood()
    server = await asyncio.start_server(flood.serve, "127.0.0.1", 0)
    flood.port = server.sockets[0].getsockname()[1]
    try:
        yield flood
    finally:
        server.close()


@pytest.mark.timeout(30)
async def test_a_2xx_with_an_endless_body_is_delivered_and_read_no_further(
    redis: Redis, unique: str
) -> None:
    prefix = f"ans{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    deliverer = Deliverer(
        redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
        allow_private=True, timeout_seconds=3.0, prefix=prefix,
    )  # fmt: skip
    try:
        async with flooding() as flood:
            state = {"state": PENDING, "attempts": 0, "hook": flood.url, "url": flood.url}
            await outbox.owe("t", "ex_1", 4, {0: state}, b'{"id":4}')
            delivery = await outbox.take("t", 10_000)
            assert delivery is not None
            await deliverer.attempt(delivery)
            [after] = await outbox.states("ex_1")
        assert after["state"] == "delivered", after["lastAnswer"]
        assert after["lastAnswer"]["status"] == 200
        assert len(after["lastAnswer"]["body"]) <= 200
        # What the receiver got out before the deliverer hung up: a few buffers, not
        # everything it could push in the attempt's time.
        assert flood.sent < 8 * 1024 * 1024, flood.sent
    finally:
        await deliverer.__aexit__(None, None, None)


@pytest.mark.timeout(30)
async def test_a_redirect_is_not_followed_and_the_delivery_is_tried_again_later(
    redis: Redis, unique: str
) -> None:
    """A receiver answering 307 to another address (it could be a private one, which the
    address rule checked only for the first) is not followed: the attempt counts as
    failed, retried on schedule, and the other address gets nothing."""
    prefix = f"ans{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    deliverer = Deliverer(
        redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
        allow_private=True, timeout_seconds=3.0, prefix=prefix,
    )  # fmt: skip
    async with receiving() as target:

        async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                f"HTTP/1.1 307 X\r\nlocation: {target.url}\r\ncontent-length: 0\r\n"
                "connection: close\r\n\r\n".encode()
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(redirect, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
        try:
            state = {"state": PENDING, "attempts": 0, "hook": url, "url": url}
            await outbox.owe("t", "ex_2", 4, {0: state}, b'{"id":4}')
            delivery = await outbox.take("t", 10_000)
            assert delivery is not None
            await deliverer.attempt(delivery)
            [after] = await outbox.states("ex_2")
        finally:
            server.close()
            await deliverer.__aexit__(None, None, None)
        assert after["state"] == PENDING and after["attempts"] == 1, after
        assert after["lastAnswer"]["status"] == 307
        assert target.received == []


@pytest.mark.timeout(30)
async def test_a_name_that_resolves_to_loopback_at_delivery_is_refused_then(
    redis: Redis, unique: str
) -> None:
    """DNS rebinding: the name was public when stored; at delivery it resolves to
    127.0.0.1 (a resolver at the seam says so), where a receiver listens. The attempt is
    refused before any connection, retried on schedule; the receiver gets nothing."""
    prefix = f"ans{unique}"
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=60)
    secrets = WebhookSecrets(redis=redis, key=b"k" * 32, prefix=prefix)
    asked: list[str] = []

    async def rebinding(host: str, port: int) -> list[IPAddress]:
        asked.append(host)
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("127.0.0.1")]

    deliverer = Deliverer(
        redis=redis, outbox=outbox, secrets=secrets, retry_seconds=[60],
        allow_private=False, timeout_seconds=3.0, prefix=prefix, resolve=rebinding,
    )  # fmt: skip
    try:
        async with receiving() as target:
            url = f"http://hooks.example.com:{target.port}/hook"
            state = {"state": PENDING, "attempts": 0, "hook": url, "url": url}
            await outbox.owe("t", "ex_3", 4, {0: state}, b'{"id":4}')
            delivery = await outbox.take("t", 10_000)
            assert delivery is not None
            await deliverer.attempt(delivery)
            [after] = await outbox.states("ex_3")
            assert target.received == []
    finally:
        await deliverer.__aexit__(None, None, None)
    assert asked == ["hooks.example.com"]
    assert after["state"] == PENDING and after["attempts"] == 1, after
    assert "127.0.0.1" in after["lastAnswer"]["error"], after["lastAnswer"]
