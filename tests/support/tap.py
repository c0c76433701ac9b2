"""A TCP proxy between one Flowcast process and Valkey that can hold a command.

``Tap`` forwards every connection's bytes both ways until a command matches what it was
told to hold: that command is never sent (nor anything after it on its connection), and
``held`` is set. The process, blocked on the reply, is then at a known point between two
of its writes, where a test kills it: the seam for "the process died right after X and
before Y", exact instead of a race. Held with a ``release`` event, the command (and
what follows it on its connection) goes on once the event is set: "the process was slow
between X and Y". ``when`` runs an action (e.g. stop the process) just before a matching
command goes on: "the process stalled with X's reply on its way".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

# Whether a chunk a client sends (one or more RESP commands) is the one to hold.
Match = Callable[[bytes], bool]


class Tap:
    """Proxies 127.0.0.1:<port> to Valkey on ``target_port``; ``hold`` arms it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.held = asyncio.Event()
        self.held_command = b""
        self._match: Match | None = None
        self._release: asyncio.Event | None = None
        self._before: tuple[Match, Callable[[], None]] | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def hold(self, match: Match, *, release: asyncio.Event | None = None) -> None:
        """Hold the next command ``match`` accepts (once): for good, or with ``release``
        until that event is set."""
        self.held.clear()
        self._match = match
        self._release = release

    def when(self, match: Match, action: Callable[[], None]) -> None:
        """Run ``action`` just before the next command ``match`` accepts is sent (once)."""
        self._before = (match, action)

    async def __aenter__(self) -> Tap:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        self._writers += [writer, upstream_writer]
        stuck = False

        async def up() -> None:
            nonlocal stuck
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    if not stuck and self._match is not None and self._match(data):
                        self._match = None
                        self.held_command = data
                        self.held.set()
                        release, self._release = self._release, None
                        if release is None:
                            stuck = True
                        else:
                            await release.wait()  # this connection's commands wait too
                    if stuck:
                        continue  # never sent: the process waits for a reply
                    if self._before is not None and self._before[0](data):
                        action, self._before = self._before[1], None
                        action()
                    upstream_writer.write(data)
                    await upstream_writer.drain()
            upstream_writer.close()

        async def down() -> None:
            with contextlib.suppress(OSError):
                while data := await upstream_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        for task in (asyncio.create_task(up()), asyncio.create_task(down())):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
