"""A webhook receiver for tests: a real HTTP/1.1 server on 127.0.0.1 that records every
request and answers each with the next of a script of statuses (``HANG``: never
answers, the connection held until the receiver closes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

HANG = -1


@dataclass
class Received:
    """One request as it arrived."""

    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers with ``script`` in order, then ``then`` for every later request."""

    script: list[int] = field(default_factory=list)
    then: int = 200
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")[1:]
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in lines if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            async with self._arrived:
                index = len(self.received)
                self.received.append(Received(headers, body))
                self._arrived.notify_all()
            status = self.script[index] if index < len(self.script) else self.then
            if status == HANG:
                await self._closing.wait()
                return
            writer.write(
                f"HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".encode()
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    async def wait_for(self, count: int) -> list[Received]:
        """Wait until ``count`` requests arrived (the test's timeout bounds it)."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self.received) >= count)
        return list(self.received)


@contextlib.asynccontextmanager
async def receiving(*script: int, then: int = 200) -> AsyncIterator[Receiver]:
    """A receiver listening on a free loopback port while the block runs."""
    receiver = Receiver(list(script), then)
    server = await asyncio.start_server(receiver._serve, "127.0.0.1", 0)
    receiver.port = server.sockets[0].getsockname()[1]
    receiver._server = server
    try:
        yield receiver
    finally:
        server.close()
        receiver._closing.set()
        await asyncio.gather(*receiver._handlers, return_exceptions=True)
        await server.wait_closed()
