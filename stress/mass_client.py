"""A client process of the mass reconnect storm (``stress/mass_reconnect.py``).

    python -m stress.mass_client

httpx costs too much per stream to hold thousands of them in one process, so the storm
spreads its clients over a few of these processes, each a raw asyncio protocol per
connection (``bench/clients.py``), driven like ``bench/scale_client.py``: one JSON command
per line on stdin, one JSON answer per line on stdout. Every client records each event
frame it receives as ``[id, event, data]`` (``id`` None for a ``replay:gap``) over all its
connections; the controller checks those views against the stored logs. A client
reconnects with ``Last-Event-ID`` = the last id it received, to a random one of
``ports``, as EventSource does; what a client saw that a controller must judge (a 5xx, a
stream that ended before its terminal event, a frame after it, a 204 too early) is a
problem ``[kind, detail]`` returned with its view.

Commands:

- ``attach``: ``clients`` (``[execution_id, cursor]`` each) open their streams, all at
  once; answers when every one has its response headers (or gave up after ``timeout``).
- ``storm``: at the wall time ``at`` every open stream of a client without its terminal
  event is closed, in one loop pass, and all those clients reconnect at once; answers
  with how many were dropped and the last response headers' time.
- ``finish``: wait until every client has its terminal event and its stream closed, up
  to ``timeout``; the others are stuck.
- ``end``: every client reconnects once more at its terminal id, all at once (each must
  get 204).
- ``collect``: the views of clients ``offset`` .. ``offset + limit``.
- ``exit``: close every stream and end.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.clients import HOST, http_request
from bench.scale_client import Command, Held, cpu_seconds, run, serve
from tests.support.logcheck import TERMINAL

SSE = {"Accept": "text/event-stream"}
RETRY_SECONDS = 0.1  # EventSource's reconnect delay after a failed or broken connection
LATE_CLOSE_SECONDS = 5.0  # a stream still open this long after its terminal event
PROBLEMS_PER_CLIENT = 5

FrameRecord = list[Any]  # [id or None, event, data as JSON text]


def parse(raw: bytes) -> FrameRecord | None:
    """One SSE frame as ``[id, event, data]``; None for a heartbeat comment."""
    frame_id = event = data = None
    for line in raw.decode().split("\n"):
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            frame_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data = value if data is None else f"{data}\n{value}"
        else:
            raise ValueError(f"unexpected SSE line {line!r}")
    return None if event is None else [frame_id, event, data]


class Connection(Held):
    """One stream of a client; its frames go to the client while the answer is a 200."""

    def __init__(self, client: Client, request: bytes) -> None:
        super().__init__(request, self._receive)
        self.client = client
        self.dropped = False  # closed by the storm, not by the server
        self.error: str | None = None

    def itself(self) -> Connection:
        """The protocol factory of ``create_connection``: this very connection."""
        return self

    @property
    def complete(self) -> bool:
        """The response ended with its last chunk (the server closed it on purpose)."""
        return self._chunked and self._chunk_left < 0

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.error = type(exc).__name__
        super().connection_lost(exc)

    def _receive(self, frames: list[bytes], received_at: float) -> None:
        if self.status == 200 and not self.dropped:
            self.client.receive(frames, received_at)


class Client:
    """One SSE client: its view over all its connections and what it saw go wrong."""

    def __init__(self, execution_id: str, cursor: int) -> None:
        self.execution_id = execution_id
        self.start = cursor
        self.cursor = cursor
        self.frames: list[FrameRecord] = []
        self.conn: Connection | None = None
        self.connections = 0
        self.no_content = 0
        self.terminal_at: float | None = None
        self.closed_at: float | None = None
        self.gone = False  # refused for good (a 4xx): no more connections
        self.stuck = False
        self.problems: list[list[str]] = []

    @property
    def settled(self) -> bool:
        """Nothing more to read: the terminal event is in and the stream is closed (or
        the client gave up)."""
        return self.gone or self.stuck or (self.terminal_at is not None and self.conn is None)

    def problem(self, kind: str, detail: str) -> None:
        if len(self.problems) < PROBLEMS_PER_CLIENT:
            self.problems.append([kind, f"{self.execution_id}: {detail}"])

    def receive(self, frames: list[bytes], received_at: float) -> None:
        for raw in frames:
            try:
                frame = parse(raw)
            except ValueError as exc:
                self.problem("bad frame", f"{exc} in {raw[:200]!r}")
                continue
            if frame is None:
                continue
            if self.terminal_at is not None:
                self.problem(
                    "frame after terminal",
                    f"{frame[1]} id={frame[0]} after the terminal event, "
                    f"connection {self.connections}",
                )
            self.frames.append(frame)
            if frame[0] is not None:
                self.cursor = int(frame[0])
            if frame[1] in TERMINAL:
                self.terminal_at = received_at

    def ended(self, conn: Connection) -> None:
        """A stream closed: by us, after the terminal event, or too early."""
        if conn is not self.conn:
            return
        self.conn = None
        self.closed_at = time.time()
        if conn.dropped:
            return
        if self.terminal_at is not None:
            late = self.closed_at - self.terminal_at
            if late > LATE_CLOSE_SECONDS:
                self.problem("late close", f"stream closed {late:.1f}s after the terminal event")
            return
        how = "closed" if conn.complete else f"broken ({conn.error or 'EOF'})"
        self.problem(
            "stream ended before terminal",
            f"{how} at cursor {self.cursor}, connection {self.connections}",
        )

    def view(self) -> dict[str, Any]:
        return {
            "executionId": self.execution_id,
            "start": self.start,
            "frames": self.frames,
            "connections": self.connections,
            "noContent": self.no_content,
            "stuck": self.stuck,
            "problems": self.problems,
        }


class Clients:
    """Every client of this process."""

    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.ports: list[int] = []
        self.rng = random.Random()
        self.max_connections = 20
        self.statuses: Counter[int] = Counter()
        self.failures: Counter[str] = Counter()  # connections that got no answer, retried
        self.retries: set[asyncio.Task[None]] = set()

    def attach(self, command: dict[str, Any]) -> list[Client]:
        self.ports = command["ports"]
        self.rng.seed(command["seed"])
        self.max_connections = command["maxConnections"]
        added = [Client(execution_id, cursor) for execution_id, cursor in command["clients"]]
        self.clients += added
        return added

    async def connect(self, client: Client, timeout: float, *, at_end: bool = False) -> float:
        """Open a stream for ``client`` at its cursor on a random port, retrying what got no
        answer until ``timeout``; returns when the headers came (0 if none did)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while True:
            if client.connections >= self.max_connections:
                client.problem("too many connections", f"{client.connections} used up")
                client.gone = True
                return 0.0
            if client.frames and client.frames[-1][0] is None:
                client.frames.pop()  # cut right after a gap frame: the same cursor gets it again
            port = self.rng.choice(self.ports)
            path = f"/api/executions/{client.execution_id}/stream"
            headers = {**SSE, "Last-Event-ID": str(client.cursor)}
            conn = Connection(client, http_request("GET", path, port=port, headers=headers))
            client.connections += 1
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                    await loop.create_connection(conn.itself, HOST, port)
                    await conn.head
            except (OSError, TimeoutError) as exc:
                conn.close()
                self.failures[type(exc).__name__] += 1
            except asyncio.CancelledError:
                conn.close()
                raise
            else:
                if conn.head_at is not None:
                    if self.answered(client, conn, at_end=at_end):
                        return conn.head_at
                else:
                    conn.done.exception()  # taken, or asyncio logs it as never retrieved
                    self.failures[conn.error or "closed before the headers"] += 1
            if time.monotonic() >= deadline:
                client.problem("no answer", f"no stream opened within {timeout:.0f}s")
                client.stuck = True
                return 0.0
            await asyncio.sleep(RETRY_SECONDS)

    def answered(self, client: Client, conn: Connection, *, at_end: bool) -> bool:
        """Take the response's status; False to try again."""
        status = conn.status
        self.statuses[status] += 1
        client.stuck = False
        if status == 204:
            client.no_content += 1
            if client.terminal_at is None:
                client.problem("204 before terminal", f"204 at cursor {client.cursor}")
                client.gone = True
            conn.close()
            return True
        if status == 200 and at_end:
            client.problem("200 at the terminal id", f"200 at cursor {client.cursor}")
            conn.dropped = True
            conn.close()
            return True
        if status == 200:
            client.conn = conn
            conn.done.add_done_callback(lambda _future: self.ended(client, conn))
            return True
        conn.close()
        client.problem(f"stream {status}", f"stream answered {status} at cursor {client.cursor}")
        if status >= 500 or status == 429:
            return False  # reconnect, as EventSource does
        client.gone = True
        return True

    def ended(self, client: Client, conn: Connection) -> None:
        was_current = conn is client.conn
        client.ended(conn)
        if was_current and not conn.dropped and client.terminal_at is None and not client.gone:
            task = asyncio.get_running_loop().create_task(self.retry(client))
            self.retries.add(task)
            task.add_done_callback(self.retries.discard)

    async def retry(self, client: Client) -> None:
        await asyncio.sleep(RETRY_SECONDS)
        await self.connect(client, timeout=30)

    async def open_all(self, clients: list[Client], timeout: float) -> dict[str, Any]:
        began = time.time()
        heads = await asyncio.gather(*(self.connect(client, timeout) for client in clients))
        opened = [head for head in heads if head]
        return {
            "opened": len(opened),
            "began": began,
            "heads": opened,
            "lastHead": max(opened, default=None),
            "cpu": cpu_seconds(),
        }

    async def storm(self, at: float, timeout: float) -> dict[str, Any]:
        """Drop every live stream at ``at``, then reconnect all of them at once."""
        await asyncio.sleep(max(at - time.time(), 0))
        for task in list(self.retries):
            task.cancel()
        live = [c for c in self.clients if c.terminal_at is None and not c.gone]
        dropped = 0
        for client in live:
            conn, client.conn = client.conn, None
            if conn is not None and not conn.done.done():
                conn.dropped = True
                conn.close()
                dropped += 1
        answer = await self.open_all(live, timeout)
        return {**answer, "dropped": dropped, "cut": at}

    async def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for every client to settle; the rest are stuck."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(c.settled for c in self.clients):
            await asyncio.sleep(0.1)
        settled = time.time()
        for task in list(self.retries):
            task.cancel()
        for client in self.clients:
            if client.settled:
                continue
            client.stuck = True
            state = "open" if client.conn is not None else "not connected"
            seen = "after" if client.terminal_at is not None else "before"
            client.problem(
                "stuck",
                f"not ended by the deadline, {seen} its terminal event, at cursor "
                f"{client.cursor}, stream {state}",
            )
            if client.conn is not None:
                client.conn.dropped = True
                client.conn.close()
        return {"stuck": sum(1 for c in self.clients if c.stuck), "settled": settled}

    async def end(self, timeout: float) -> dict[str, Any]:
        """Reconnect every finished client at its terminal id, all at once."""
        done = [c for c in self.clients if c.terminal_at is not None and not c.stuck]
        heads = await asyncio.gather(*(self.connect(c, timeout, at_end=True) for c in done))
        return {"reconnected": sum(1 for head in heads if head)}

    def collect(self, offset: int, limit: int) -> dict[str, Any]:
        return {"views": [client.view() for client in self.clients[offset : offset + limit]]}

    def stats(self) -> dict[str, Any]:
        return {
            "statuses": {str(code): count for code, count in self.statuses.items()},
            "failures": dict(self.failures),
            "connections": sum(client.connections for client in self.clients),
            "cpu": cpu_seconds(),
        }

    def close(self) -> None:
        for task in list(self.retries):
            task.cancel()
        for client in self.clients:
            if client.conn is not None:
                client.conn.dropped = True
                client.conn.close()


async def main() -> None:
    clients = Clients()

    async def attach(command: dict[str, Any]) -> dict[str, Any]:
        return await clients.open_all(clients.attach(command), command["timeout"])

    async def storm(command: dict[str, Any]) -> dict[str, Any]:
        return await clients.storm(command["at"], command["timeout"])

    async def finish(command: dict[str, Any]) -> dict[str, Any]:
        return await clients.finish(command["timeout"])

    async def end(command: dict[str, Any]) -> dict[str, Any]:
        return await clients.end(command["timeout"])

    async def collect(command: dict[str, Any]) -> dict[str, Any]:
        return clients.collect(command["offset"], command["limit"])

    async def stats(_command: dict[str, Any]) -> dict[str, Any]:
        return clients.stats()

    commands: dict[str, Command] = {
        "attach": attach,
        "storm": storm,
        "finish": finish,
        "end": end,
        "collect": collect,
        "stats": stats,
    }
    await serve(commands, clients.close)


if __name__ == "__main__":
    run(main)
