"""A scriptable fake of an OpenAI-compatible chat-completions server, for tests.

``FakeLLM`` serves ``POST /v1/chat/completions`` with uvicorn in a daemon thread on
127.0.0.1 and a free port. Each request takes the next scripted ``Reply`` (or
``llm.default`` once the script is used up) and is answered as the real API answers:
a ``chat.completion`` object, or, with ``"stream": true``, a ``text/event-stream`` of
``chat.completion.chunk`` events (the role in the first delta, a finish chunk, a usage
chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``).

A reply can also misbehave the way providers do: an error status with an OpenAI-style
body and headers such as ``Retry-After``, a slow start, slow pieces, a connection cut
mid-body, or a stream that ends cleanly without a finish reason.

Every request is recorded as a ``Seen``, and ``in_flight`` / ``max_in_flight`` count
concurrent requests. The server runs on its own thread and event loop, so that state is
guarded by a lock, and the ``wait_*`` helpers poll it from the test's event loop::

    with FakeLLM() as llm:
        llm.script(Reply(status=429, headers={"Retry-After": "1"}), Reply(text="Hi there"))
        ...  # point the client under test at llm.url
        assert len(llm.requests) == 2
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tests.support.api import within

__all__ = ["FakeLLM", "Reply", "ScriptedBreak", "Seen", "split_words"]

WORD = re.compile(r"\s*\S+\s*")

# status -> (type, code, message), as the OpenAI API words them.
ERRORS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    500: ("server_error", None, "The server had an error while processing your request."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


def split_words(text: str) -> list[str]:
    """Split text into stream pieces: each word with the whitespace around it."""
    return WORD.findall(text)


@dataclass(frozen=True)
class Reply:
    """How the fake answers one request; every field has a well-behaved default."""

    text: str = "Hello from the fake model."
    pieces: list[str] | None = None  # given exactly, instead of splitting `text`
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering at all
    piece_delay: float = 0.0  # seconds between streamed pieces
    break_after: int | None = None  # cut the connection after this many pieces
    end_without_finish: bool = False  # no finish_reason chunk, but a clean [DONE]
    finish_reason: str = "stop"
    model: str | None = None  # defaults to the request's model
    usage: tuple[int, int] | None = None  # (prompt, completion); defaults to word counts
    echo: bool = False  # answer the request's last message back

    def __post_init__(self) -> None:
        if not 200 <= self.status <= 599:
            raise ValueError(f"status must be 200..599, got {self.status}")
        if self.delay < 0 or self.piece_delay < 0:
            raise ValueError("delays must not be negative")
        if self.break_after is not None and self.break_after < 0:
            raise ValueError("break_after must not be negative")


@dataclass(frozen=True)
class Seen:
    """One request as the fake received it."""

    body: dict[str, Any]
    headers: dict[str, str]  # lower-case names
    at: float  # time.monotonic() on arrival


class ScriptedBreak(Exception):
    """Raised inside a response body so that uvicorn cuts the connection, as scripted."""


class FakeLLM:
    """An OpenAI-compatible chat-completions server on 127.0.0.1, scripted per request."""

    def __init__(self, *, api_key: str | None = None, default: Reply | None = None) -> None:
        self.api_key = api_key
        self.default = default or Reply()
        self._initial_default = self.default
        self._lock = threading.Lock()
        self._script: deque[Reply] = deque()
        self._requests: list[Seen] = []
        self._in_flight = 0
        self._max_in_flight = 0
        # Bumped by reset(): a request from before (one a test left hanging, e.g. a slow
        # reply its client gave up on) no longer counts in the next test's figures.
        self._generation = 0
        self._app = Starlette(
            routes=[Route("/v1/chat/completions", self._completions, methods=["POST"])]
        )
        self._port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL a client is given; requests go to ``{url}/chat/completions``."""
        if self._port is None:
            raise RuntimeError("the fake LLM is not started")
        return f"http://127.0.0.1:{self._port}/v1"

    def start(self, timeout: float = 10.0) -> None:
        """Serve on a free loopback port; return once uvicorn is accepting connections."""
        if self._server is not None:
            raise RuntimeError("a FakeLLM is started once; make a new one")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            self._asgi,
            interface="asgi3",  # a bound method would be guessed to be ASGI2
            lifespan="off",
            log_level="warning",
            ws="none",
            http="h11",
            loop="asyncio",
            # A request scripted to hang must not hold stop() for its whole delay.
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="fake-llm"
        )
        self._port = sock.getsockname()[1]
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the fake LLM server did not start")
            time.sleep(0.01)  # polling the real readiness flag

    def stop(self) -> None:
        """Shut the server down and wait for its thread; in-flight replies get a second."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def script(self, *replies: Reply) -> None:
        """Queue replies; each request takes the next one, then ``default`` when none is left."""
        with self._lock:
            self._script.extend(replies)

    def reset(self) -> None:
        """Forget scripts, requests and in-flight counts (a request still being answered
        no longer counts), and restore the default reply."""
        with self._lock:
            self._script.clear()
            self._requests.clear()
            self._generation += 1
            self._in_flight = 0
            self._max_in_flight = 0
            self.default = self._initial_default

    @property
    def requests(self) -> list[Seen]:
        """The requests received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def in_flight(self) -> int:
        """Requests arrived whose response body is not yet fully sent or aborted."""
        with self._lock:
            return self._in_flight

    @property
    def max_in_flight(self) -> int:
        with self._lock:
            return self._max_in_flight

    async def wait_requests(self, n: int, timeout: float = 10) -> list[Seen]:
        """Wait until at least ``n`` requests have arrived, and return them."""
        await _poll(
            lambda: len(self.requests) >= n,
            timeout,
            lambda: f"expected {n} requests within {timeout}s, got {len(self.requests)}",
        )
        return self.requests

    async def wait_in_flight(self, n: int, timeout: float = 10) -> None:
        """Wait until at least ``n`` requests are being answered at once."""
        await _poll(
            lambda: self.in_flight >= n,
            timeout,
            lambda: f"expected {n} requests in flight within {timeout}s, got {self.in_flight}",
        )

    async def wait_idle(self, timeout: float = 10) -> None:
        """Wait until no request is being answered."""
        await _poll(
            lambda: self.in_flight == 0,
            timeout,
            lambda: f"still {self.in_flight} requests in flight after {timeout}s",
        )

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Uncounted around the whole app, not in the endpoint: a streamed body is sent
        # after the endpoint has returned, and a cut one ends with an exception. The
        # endpoint counts the request (``_COUNTED`` in its scope) when it takes a reply.

        def done() -> None:
            generation = scope.pop(_COUNTED, None)
            if generation is not None:
                with self._lock:
                    if generation == self._generation:
                        self._in_flight -= 1

        async def sending(message: Any) -> None:
            # No longer in flight *before* the client can see the end ([DONE], or the
            # last of a body): a client that moves on at once must never find it counted.
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if b"[DONE]" in body or not message.get("more_body", False):
                    done()
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            done()

    async def _completions(self, request: Request) -> Response:
        at = time.monotonic()
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, message="The request body is not valid JSON.")
        if not isinstance(body, dict):
            return error_response(400, message="The request body must be a JSON object.")
        seen = Seen(body=body, headers=dict(request.headers), at=at)
        with self._lock:
            self._requests.append(seen)
        # Refused before taking a reply, so a failed key does not use up a scripted one.
        bearer = f"Bearer {self.api_key}"
        if self.api_key is not None and seen.headers.get("authorization") != bearer:
            return error_response(401)
        with self._lock:
            reply = self._script.popleft() if self._script else self.default
            # In flight from the moment its reply is taken, not from its arrival: a test
            # that waits for a request in flight and then changes ``default`` for the
            # next one could change this one's too (the holder of a slot got the quick
            # reply meant for its waiter, beside a busy loop).
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            request.scope[_COUNTED] = self._generation
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.status != 200:
            return error_response(reply.status, headers=reply.headers)
        return answer(reply, body)


_COUNTED = "fake_llm.counted"  # the generation a request was counted in flight in


async def _poll(condition: Callable[[], bool], timeout: float, failure: Callable[[], str]) -> None:
    if not await within(condition, timeout, every=0.01):
        raise AssertionError(failure())


def error_response(
    status: int, *, headers: dict[str, str] | None = None, message: str | None = None
) -> JSONResponse:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind, code, text = ERRORS.get(
        status,
        (
            "server_error" if status >= 500 else "invalid_request_error",
            None,
            f"HTTP {status} from the fake model.",
        ),
    )
    error = {"message": message or text, "type": kind, "param": None, "code": code}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def answer(reply: Reply, body: dict[str, Any]) -> Response:
    """The successful answer to ``body``: a completion object or an event stream."""
    messages = [m for m in body.get("messages", []) if isinstance(m, dict)]
    if reply.echo:
        pieces = split_words(text_of(messages[-1].get("content")) if messages else "")
    elif reply.pieces is not None:
        pieces = list(reply.pieces)
    else:
        pieces = split_words(reply.text)
    prompt, completion = reply.usage or (
        sum(len(text_of(m.get("content")).split()) for m in messages),
        len(pieces),
    )
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": reply.model or body.get("model") or "fake-model",
    }
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = stream(reply, pieces, head, usage if include_usage else None)
        return StreamingResponse(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **reply.headers},
        )
    finish = None if reply.end_without_finish else reply.finish_reason
    message = {"role": "assistant", "content": "".join(pieces)}
    completion_object = {
        **head,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }
    if reply.break_after is None:
        return JSONResponse(completion_object, headers=reply.headers)
    # Not streamed, a break still has to cut a body the client has started to read.
    raw = json.dumps(completion_object).encode()
    return StreamingResponse(
        cut(raw[: len(raw) // 2]), media_type="application/json", headers=reply.headers
    )


async def stream(
    reply: Reply, pieces: list[str], head: dict[str, Any], usage: dict[str, int] | None
) -> AsyncIterator[bytes]:
    """The chunks of a streamed completion, in the order the OpenAI API sends them."""

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return event({**head, "object": "chat.completion.chunk", "choices": [choice]})

    sent = pieces if reply.break_after is None else pieces[: reply.break_after]
    for index, piece in enumerate(sent):
        if index and reply.piece_delay:
            await asyncio.sleep(reply.piece_delay)
        yield chunk({"role": "assistant", "content": piece} if index == 0 else {"content": piece})
    if reply.break_after is not None:
        raise ScriptedBreak(f"connection cut after {len(sent)} pieces, as scripted")
    if not sent:
        yield chunk({"role": "assistant", "content": ""})
    if not reply.end_without_finish:
        yield chunk({}, reply.finish_reason)
    if usage is not None:
        yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


async def cut(raw: bytes) -> AsyncIterator[bytes]:
    yield raw
    raise ScriptedBreak(f"connection cut after {len(raw)} bytes, as scripted")


def event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


# -- fixtures and workflows for tests of llm blocks against the fake


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    """One fake provider per test module (import it with ``fresh``)."""
    with FakeLLM() as fake:
        yield fake


@pytest.fixture(autouse=True)
def fresh(llm: FakeLLM) -> None:
    """Each test starts on an unscripted fake."""
    llm.reset()


def llm_block(block_id: str = "draft", **config: Any) -> dict[str, Any]:
    """An ``llm`` block on the fake's model ``fake-1``, retried 3 times by default."""
    retry = config.pop("retry", {"attempts": 3, "backoffMs": 10})
    return {
        "id": block_id,
        "type": "llm",
        "retry": retry,
        "config": {
            "model": "fake-1",
            "messages": [{"role": "user", "content": "hi {{ input.n }}"}],
            **config,
        },
    }


def one_block(workflow_id: str, block: dict[str, Any]) -> dict[str, Any]:
    """A workflow of that one block."""
    return {"id": workflow_id, "blocks": [block], "edges": []}


def slow_reply(pieces: int = 10, every: float = 0.2) -> Reply:
    """A reply of ``pieces`` pieces, ``every`` seconds apart."""
    return Reply(pieces=[f"p{i} " for i in range(pieces)], piece_delay=every)
