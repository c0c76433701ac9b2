"""The SSE response: a reader's frames (one execution's events, or a live list of
executions), written to one client.

The frames are encoded once, when the event is emitted, and every client gets the same
bytes. What a stream costs beyond that is kept to one coroutine (the request's own
task, writing frames) and one task waiting for the client to leave. The timers every
stream would otherwise need are one ticker per process (:class:`OpenStreams`): it sends
idle streams their heartbeat and, once uvicorn is told to exit, ends every stream at
a frame boundary so EventSource reconnects (to another replica) with Last-Event-ID; a
stream still open ``grace_seconds`` later (its client stopped reading, so a write waits)
is cancelled, so shutdown never waits on a client. The connection's time cap
(``FLOWCAST_SSE_MAX_SECONDS``) is kept here too, one timer per stream whatever its
reader: at the cap the reader is closed, the body ends at a frame boundary as at a
shutdown, and EventSource reconnects with Last-Event-ID.

sse-starlette's ``EventSourceResponse`` runs four tasks per stream and a cancel scope
around every write; at thousands of streams that was most of the server's CPU and
memory per client (``bench/`` row "streams").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any, Protocol

from sse_starlette.sse import AppStatus
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from lib.execution.events import PING_FRAME

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5
GRACE_SECONDS = 2.0
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
_END = {"type": "http.response.body", "body": b"", "more_body": False}


class Frames(Protocol):
    """What an :class:`EventStream` writes: ``StreamReader``, ``ListReader``."""

    @property
    def finished(self) -> bool:
        """True once the last frame was produced (the body then ends with it)."""
        ...

    def frames(self) -> AsyncGenerator[bytes]:
        """The SSE frames, until the reader ends or is closed."""
        ...

    def close(self) -> None:
        """End at the next frame boundary."""
        ...

    def detach(self) -> None:
        """Let go of what opening the reader took, if the frames never ran."""
        ...


def server_exiting() -> bool:
    """Whether uvicorn was told to exit (a signal, or ``should_exit`` set on it)."""
    if AppStatus.should_exit:  # sse-starlette's hook on uvicorn's exit handler
        return True
    handler = signal.getsignal(signal.SIGTERM)
    server = getattr(handler, "__self__", None)
    return bool(getattr(server, "should_exit", False))


class EventStream(Response):
    """``text/event-stream`` with a reader's frames, until the reader ends or the client
    leaves; ``release`` runs once, however it ends."""

    def __init__(
        self,
        reader: Frames,
        *,
        streams: OpenStreams,
        release: Callable[[], None],
        execution_id: str | None = None,
        ends_at: float | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = list(_HEADERS)
        if execution_id is not None:
            self.raw_headers.append((b"x-execution-id", execution_id.encode()))
        self.reader = reader
        self.sent_at = 0.0
        self._streams = streams
        self._release = release
        self._ends_at = ends_at  # epoch seconds: what authorized the stream expires then
        self._task: asyncio.Task[Any] | None = None
        self._forced = False
        self._send: Send | None = None
        self._sending = False
        self._aside: asyncio.Task[None] | None = None  # a heartbeat written from aside

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if scope.get("method") == "HEAD":
                await send(_END)
                return
            loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._send = send
            leaving = loop.create_task(self._watch(receive))
            self._streams.add(self)
            cap = self._streams.max_seconds
            if self._ends_at is not None:
                left = max(self._ends_at - time.time(), 0.0)
                cap = left if cap is None else min(cap, left)
            capped = None if cap is None else loop.call_later(cap, self.reader.close)
            try:
                async with contextlib.aclosing(self.reader.frames()) as frames:
                    async for chunk in frames:
                        # The terminal event ends the body in the same write.
                        more = not self.reader.finished
                        await self._write(chunk, more=more)
                        if not more:
                            break
                        self.sent_at = loop.time()
                    else:
                        await self._write(b"", more=False)
            except asyncio.CancelledError:
                if not self._forced or self._task is None:
                    raise
                # Ours (see force): the connection is left unfinished and uvicorn closes it.
                self._task.uncancel()
            finally:
                self._streams.discard(self)
                leaving.cancel()
                if capped is not None:
                    capped.cancel()
                if self._aside is not None:
                    self._aside.cancel()
        finally:
            self.reader.detach()
            self._release()

    async def _write(self, body: bytes, *, more: bool) -> None:
        assert self._send is not None
        if self._aside is not None:
            aside, self._aside = self._aside, None
            await aside  # a heartbeat in flight goes out first, whole
        self._sending = True
        try:
            await self._send({"type": "http.response.body", "body": body, "more_body": more})
        finally:
            self._sending = False

    def heartbeat(self) -> None:
        """Nothing was written for a while: send ``: ping``."""
        # Written from aside, whatever the stream's coroutine waits on (live events, a
        # replay page from Redis); its next frame waits for the ping. Skipped while a
        # frame is being written: that write is the sign of life.
        if self._send is not None and not self._sending and not self._pinging():
            self._aside = asyncio.get_running_loop().create_task(self._ping(self._send))

    def _pinging(self) -> bool:
        if self._aside is None:
            return False
        if not self._aside.done():
            return True
        failed = None if self._aside.cancelled() else self._aside.exception()
        self._aside = None
        if failed is not None:
            log.warning("a heartbeat could not be written", extra={"error": str(failed)})
            self.reader.close()
            return True
        return False

    @staticmethod
    async def _ping(send: Send) -> None:
        await send({"type": "http.response.body", "body": PING_FRAME, "more_body": True})

    def force(self) -> None:
        """Stop now, mid-write if need be (the server's shutdown grace ran out)."""
        if self._task is not None and not self._forced:
            self._forced = True
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        # The request body was read before the response began: what comes now is the
        # disconnect (or, once the response is complete, the same message). A receive
        # that fails (a GET whose declared body never came: the body limit's 408) ends
        # the stream the same way: nothing more can be told about the client.
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:
            log.info("stream ended: its request failed", extra={"error": str(exc)})
        finally:
            self.reader.close()


class OpenStreams:
    """The process's open SSE streams, and the one ticker that keeps them: a heartbeat
    on each stream idle for ``ping_seconds``, and the end of all of them once the server
    is exiting (``exiting`` is asked every tick). Each stream ends ``max_seconds`` after
    it began (the connection's time cap; none when ``None``)."""

    def __init__(
        self,
        *,
        ping_seconds: float,
        max_seconds: float | None = None,
        tick_seconds: float = TICK_SECONDS,
        grace_seconds: float = GRACE_SECONDS,
        exiting: Callable[[], bool] = server_exiting,
    ) -> None:
        self.ping_seconds = ping_seconds
        self.max_seconds = max_seconds
        self._tick = min(tick_seconds, ping_seconds / 2)
        self._exiting = exiting
        self._open: set[EventStream] = set()
        self.closing = False
        self._closed_at = 0.0
        self.grace_seconds = grace_seconds
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def add(self, stream: EventStream) -> None:
        if self.closing:
            stream.reader.close()  # opened while the server drains: ends at once
        stream.sent_at = asyncio.get_running_loop().time()
        self._open.add(stream)

    def discard(self, stream: EventStream) -> None:
        self._open.discard(stream)

    def close_all(self) -> None:
        """End every stream at its next frame boundary, and any opened from now on."""
        if not self.closing:
            self.closing = True
            self._closed_at = asyncio.get_running_loop().time()
        for stream in self._open:
            stream.reader.close()

    async def __aenter__(self) -> OpenStreams:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick)
            try:
                self.tick(loop.time())
            except Exception:  # the ticker must outlive any one stream's trouble
                log.exception("the SSE ticker failed a tick")

    def tick(self, now: float) -> None:
        """One tick: end everything when exiting, else send the idle streams a ping."""
        if not self.closing and self._exiting():
            log.info("server exiting: ending the open streams", extra={"streams": len(self)})
            self.close_all()
        if self.closing:
            if now - self._closed_at >= self.grace_seconds:
                for stream in list(self._open):
                    stream.force()
            return
        idle_since = now - self.ping_seconds
        for stream in self._open:
            if stream.sent_at <= idle_since:
                stream.sent_at = now  # once per interval
                stream.heartbeat()
