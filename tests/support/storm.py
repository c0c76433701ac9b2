"""A storm of SSE opens from a process of its own: ``python -m tests.support.storm``.

A test that times another tenant's requests during a storm cannot open the storm's
thousands of connections in its own event loop: its probe would wait behind them there
and measure the client, not the server. This process opens ``COUNT`` streams of ``PATH``
on ``127.0.0.1:PORT`` at once (``Authorization: Bearer KEY``; with a fifth argument
``spelled``, each stream spells that header its own way, see ``spelled``; with
``bodied``, each GET carries a one-byte body; with ``keyless``, none carries a key and
each is answered 401 at once), prints one JSON line when
every answer's head is read (``{"opened": n, "failed": {...}, "seconds": s}``), waits for a
line on its stdin, then reads every stream to its end and prints how each ended
(``{"ends": {"completed": n, ...}}``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter


def spelled(key: str, index: int) -> str:
    """``Bearer <key>`` spelled its ``index``-th way: the scheme's case and the spaces
    before the key vary; the server reads every spelling as the same key."""
    scheme = "".join(c.upper() if index >> i & 1 else c for i, c in enumerate("bearer"))
    return f"{scheme}{' ' * (1 + index // 64)}{key}"


async def open_stream(
    port: int, path: str, authorization: str, body: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """One stream, its head read and its status 200 (401 without ``authorization``;
    else RuntimeError). The writer must be kept: a writer collected closes its
    connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = f"Authorization: {authorization}\r\n" if authorization else ""
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{key}Accept: text/event-stream\r\n".encode()
        + (f"Content-Length: {len(body)}\r\n".encode() if body else b"")
        + b"\r\n"
        + body
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode()
    if (" 200 " if authorization else " 401 ") not in status:
        raise RuntimeError(status)
    return reader, writer


async def read_to_end(reader: asyncio.StreamReader) -> str:
    """How a stream ended: ``completed`` if its last event was the terminal one."""
    tail = b""
    while chunk := await reader.read(65536):
        tail = (tail + chunk)[-4096:]
        if b"event: execution:completed" in tail:
            return "completed"
    return "ended early"


def outcome(item: object) -> str:
    return item if isinstance(item, str) else f"{type(item).__name__}: {item}"


async def main(port: int, path: str, key: str, count: int, mode: str) -> None:
    began = time.monotonic()
    headers = [spelled(key, i) if mode == "spelled" else f"Bearer {key}" for i in range(count)]
    if mode == "keyless":
        headers = [""] * count
    body = b"x" if mode == "bodied" else b""
    opened = await asyncio.gather(
        *(open_stream(port, path, header, body) for header in headers), return_exceptions=True
    )
    streams = [item for item in opened if isinstance(item, tuple)]
    failed = Counter(outcome(item) for item in opened if isinstance(item, BaseException))
    seconds = round(time.monotonic() - began, 2)
    print(json.dumps({"opened": len(streams), "failed": failed, "seconds": seconds}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    async with asyncio.timeout(90):
        ends = await asyncio.gather(
            *(read_to_end(reader) for reader, _writer in streams), return_exceptions=True
        )
    print(json.dumps({"ends": Counter(outcome(end) for end in ends)}), flush=True)


if __name__ == "__main__":
    port, path, key, count = sys.argv[1:5]
    asyncio.run(main(int(port), path, key, int(count), "".join(sys.argv[5:6])))
