"""Request limits that hold before a route runs: header and body size caps, body time.

A body larger than ``FLOWCAST_MAX_BODY_BYTES`` gets 413, whether it declares its size
(``Content-Length``, refused before reading) or streams in chunks (refused once the
count passes the cap, whatever the route then made of the broken read). Headers larger
than 64 KiB in all get 431. A body that has not fully arrived
``FLOWCAST_BODY_TIMEOUT_SECONDS`` after the route began reading it gets 408, so a client
sending a byte now and then cannot hold a connection and a task forever. A JSON body
whose values orjson cannot encode is refused by its route, with ``unstorable``, before
anything is written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, error_payload
from app.responses import JSON
from lib.errors import TooManyStreams
from lib.slices import PIECE, encode, weight
from lib.tenancy import FairGate
from lib.workflows.limits import MAX_DEPTH, too_deep, too_deep_in_slices

MAX_HEADER_BYTES = 64 * 1024


def unstorable(value: Any) -> str | None:
    """Why a parsed JSON body cannot be stored, or None if it can.

    Bodies are parsed by the standard library, which accepts integers of any size and
    lone surrogates (``"\\ud800"``); orjson, which encodes everything Flowcast stores and
    streams, refuses both, and it would do so halfway through starting an execution.
    """
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        return str(exc)
    return None


def checked_input(value: Any) -> Any:
    """A request's ``input`` if Flowcast can carry it; ValueError (422) otherwise.

    A large input (more than ``PIECE`` elements) is let through here, to be checked by
    ``check_large_input`` in slices: this runs in the validator, all at once on the
    event loop, and each encode of a 10 MB input held it 80-150 ms (step 16, row 1)."""
    if weight(value) > PIECE:
        return value
    try:
        encoded: bytes | None = orjson.dumps(value)
        problem: str | None = None
    except orjson.JSONEncodeError as exc:
        encoded, problem = None, str(exc)
    if too_deep(value, encoded=encoded):
        raise ValueError(_DEEP)
    if problem is not None:
        raise ValueError(f"input cannot be stored as JSON: {problem}")
    return value


async def check_large_input(value: Any) -> None:
    """``checked_input``'s checks for a large input, encoded in slices; the same 422
    (``RequestValidationError`` on ``input``) when it fails. A route calls it before
    it writes anything."""
    if weight(value) <= PIECE:
        return  # checked by the validator
    try:
        encoded = await encode(value)
    except orjson.JSONEncodeError as exc:  # deep first, as the validator checks
        problem: str | None = _DEEP if too_deep(value) else f"input cannot be stored as JSON: {exc}"
    else:
        problem = _DEEP if await too_deep_in_slices(encoded) else None
    if problem is not None:
        error = {"loc": ("body", "input"), "msg": f"Value error, {problem}", "type": "value_error"}
        raise RequestValidationError([error])


_DEEP = f"input nests deeper than {MAX_DEPTH} levels"


class StreamSlots:
    """Open SSE connections per tenant on this replica, capped (0 = no cap).

    Each stream holds memory, a task and, for an execution run elsewhere, a share of a
    blocking Redis read: a cap per tenant keeps one tenant from exhausting them (and
    Redis's ``maxclients``) for everyone.
    """

    def __init__(self, per_tenant: int) -> None:
        self._per_tenant = per_tenant
        self._open: Counter[str] = Counter()

    def take(self, tenant: str) -> None:
        """Count one more stream for ``tenant``; TooManyStreams (429) at the cap."""
        if self._per_tenant and self._open[tenant] >= self._per_tenant:
            raise TooManyStreams(
                f"this tenant already has {self._per_tenant} streams open; close one first",
                retry_after=5,
            )
        self._open[tenant] += 1

    def give_back(self, tenant: str) -> None:
        self._open[tenant] -= 1
        if self._open[tenant] <= 0:
            del self._open[tenant]


class BodyLimit:
    """ASGI middleware: 431 for oversized headers, 413 for bodies past ``max_bytes``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_seconds: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(name) + len(value) for name, value in headers) > MAX_HEADER_BYTES:
            error = ApiError(431, "headers_too_large", "the request headers are too large")
            await _answer(error, scope, receive, send)
            return
        declared, chunked = _declared(headers)
        if declared is None or declared > self.max_bytes:
            await _answer(_too_large(self.max_bytes), scope, receive, send)
        elif not chunked and not declared:
            # Without either header there is no body: nothing to count or time, so the
            # hot paths (SSE) go straight on.
            await self.app(scope, receive, send)
        else:
            body = _Body(self, scope, receive, send, chunked=chunked)
            await self.app(scope, body.receive, body.send)


def _declared(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """The body's declared size (0 when none is declared, None when it is no number),
    and whether the body comes chunked."""
    size, chunked = 0, False
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit():
                return None, chunked
            size = max(size, int(value))
        elif name == b"transfer-encoding":
            chunked = True
    return size, chunked


class _Body:
    """One request's body as its route reads it: timed from the first read, counted when
    it comes chunked (a declared size was checked already); once it ran over, in size
    or in time, whatever the route answers is replaced by that error."""

    def __init__(
        self, limit: BodyLimit, scope: Scope, receive: Receive, send: Send, *, chunked: bool
    ) -> None:
        self._limit = limit
        self._scope = scope
        self._receive = receive
        self._send = send
        self._chunked = chunked
        self._received = 0
        self._refused: ApiError | None = None
        self._deadline: float | None = None
        self._whole = False

    async def receive(self) -> Message:
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._limit.timeout_seconds
        try:
            async with asyncio.timeout_at(None if self._whole else self._deadline):
                message = await self._receive()
        except TimeoutError:
            seconds = self._limit.timeout_seconds
            self._refused = ApiError(
                408, "body_timeout", f"the request body did not arrive within {seconds:g} s"
            )
            raise self._refused from None
        if message["type"] == "http.request":
            self._whole = self._whole or not message.get("more_body", False)
            if self._chunked:
                self._received += len(message.get("body", b""))
                if self._received > self._limit.max_bytes:
                    self._refused = _too_large(self._limit.max_bytes)
                    raise self._refused
        return message

    async def send(self, message: Message) -> None:
        if self._refused is None:
            await self._send(message)
        elif message["type"] == "http.response.start":
            await _answer(self._refused, self._scope, self._receive, self._send)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "body_too_large", f"the request body is larger than {max_bytes} bytes")


async def _answer(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    status, body = error_payload(error)
    # A body that trickles in is never read to its end: the connection is not kept for
    # it. (A 413 keeps it: closing while the client still sends would reset the
    # connection before the client reads the answer.)
    headers = {"Connection": "close"} if status == 408 else None
    await JSON(body, status_code=status, headers=headers)(scope, receive, send)


class Turns:
    """ASGI middleware: the requests this process works on at once, shared fairly.

    Step 16's review opened 5,000 streams at once on one replica: every open costs about
    a millisecond of routing and a first read, and the event loop takes ready work first
    come first served, so another tenant's request waited behind all of them (1-2.6 s).
    Here a request waits for its turn first (``FairGate``: at most ``cap`` at once, the
    callers in turn), keyed by what names its caller (its ``Authorization``, else its
    ``?token=``, as ``caller`` reads them: app/auth.py ``Callers``), so one caller's storm
    waits in its own line, not in the loop's queue.
    A caller holds at most ``per_caller`` turns, so its slow requests (a keyed execute
    waiting for its twin) cannot hold them all.

    A turn is taken once the request's body has arrived, read here whether or not its
    route reads it (a body that trickles holds nothing; a GET sent with a body waits
    its turn all the same), and given back when the answer begins (its status line: a
    stream then waits on events, which may be minutes away) or when the request ends.
    It runs inside ``BodyLimit`` (which bounds what is read here) and ``KeysFirst``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        caller: Callable[[Scope], bytes] = lambda scope: b"",
        cap: int = 64,
        per_caller: int = 8,
    ) -> None:
        self.app = app
        self.caller = caller
        self.gate = FairGate(cap)
        self.per_caller = per_caller
        self._callers: dict[bytes, tuple[asyncio.Semaphore, int]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if carries_body(scope["headers"]):
            # Read before the turn: a body that trickles holds nothing, and a route
            # that never reads its body (a GET that was sent one) still waits its turn.
            receive = await _arrived(receive)
        turn = _Turn(self, self.caller(scope))
        scope[TURN] = turn
        await turn.take()

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                await turn.give_back()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            await turn.give_back()

    def line(self, caller: bytes) -> asyncio.Semaphore:
        semaphore, users = self._callers.get(caller, (None, 0))
        if semaphore is None:
            semaphore = asyncio.Semaphore(self.per_caller)
        self._callers[caller] = (semaphore, users + 1)
        return semaphore

    def leave_line(self, caller: bytes) -> None:
        semaphore, users = self._callers[caller]
        if users == 1:
            del self._callers[caller]
        else:
            self._callers[caller] = (semaphore, users - 1)


async def _arrived(receive: Receive) -> Receive:
    """A request's body read to its end (or to its client's disconnect, or to the error
    ``BodyLimit``'s reading raised: 413, 408), and the ``receive`` that hands the app
    the same messages, then whatever comes next (a disconnect)."""
    kept: list[Message] = []
    failure: BaseException | None = None
    try:
        while True:
            message = await receive()
            kept.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
    except Exception as exc:  # raised again where the app reads the body
        failure = exc
    replay = iter(kept)

    async def receiving() -> Message:
        nonlocal failure
        message = next(replay, None)
        if message is not None:
            return message
        if failure is not None:
            raised: BaseException = failure
            failure = None
            raise raised
        return await receive()

    return receiving


TURN = "flowcast.turn"  # where Turns leaves a request's turn in its scope


@contextlib.asynccontextmanager
async def turn_set_aside(scope: Scope) -> AsyncIterator[None]:
    """Within it, the request holds no turn: for a wait that costs nothing (a keyed
    repeat waiting up to 30 s for its first request's outcome, which a process that
    died may never give). It waits for a turn again at the end."""
    turn = scope.get(TURN)
    if turn is None:
        yield
        return
    async with turn.aside():
        yield


class _Turn:
    """One request's turn: taken at most once (again after ``aside``), given back at
    most once."""

    def __init__(self, turns: Turns, caller: bytes) -> None:
        self.turns, self.caller = turns, caller
        self.state = "waiting"  # -> "taking" -> "held" -> "done" (or straight to "done")
        self.held = contextlib.AsyncExitStack()

    async def take(self) -> None:
        if self.state != "waiting":
            return
        self.state = "taking"
        semaphore = self.turns.line(self.caller)
        self.held.callback(self.turns.leave_line, self.caller)
        try:
            await self.held.enter_async_context(semaphore)
            await self.held.enter_async_context(self.turns.gate.entered(self.caller.hex()))
        except BaseException:
            self.state = "done"
            await self.held.aclose()
            raise
        if self.state == "done":  # the answer began while it waited: nothing to hold
            await self.held.aclose()
        else:
            self.state = "held"

    async def give_back(self) -> None:
        state, self.state = self.state, "done"
        if state == "held":
            await self.held.aclose()

    @contextlib.asynccontextmanager
    async def aside(self) -> AsyncIterator[None]:
        """Give the turn back for the block, and wait for one again after it."""
        if self.state != "held":
            yield
            return
        await self.held.aclose()
        self.held, self.state = contextlib.AsyncExitStack(), "waiting"
        try:
            yield
        finally:
            await self.take()


def carries_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers announce a body."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False
