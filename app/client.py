"""A small synchronous client for Flowcast's HTTP API and its SSE stream (used by the CLI).

    ClientError            root of what this client raises (a ``FlowcastError``)
    ├── Unreachable        the server could not be reached (or stayed unreachable)
    └── Refused            the server answered 4xx/5xx: ``status``, ``code``, ``message``

``follow`` yields the execution's events in order, each id once, across reconnects:
it resends ``Last-Event-ID`` after every dropped or server-closed connection, with
backoff while connecting keeps failing, and reports ``replay:gap`` frames and
reconnects as items of their own so the caller can show them.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import connect_sse

from lib.errors import FlowcastError

DEFAULT_URL = "http://127.0.0.1:8000"
HEALTHY_SECONDS = 1.0
# Answers worth the same request again: a proxy that lost the replica (502) or its
# answer (504), a server that cannot serve it now (503).
RETRY_STATUSES = frozenset({502, 503, 504})
# The longest ``Retry-After`` a retry waits (a 503 that says when to come back: a pause
# held after the store came back empty, up to a lease; a server too busy).
RETRY_AFTER_CAP_SECONDS = 60.0
TERMINAL_EVENTS = {
    "execution:completed": "completed",
    "execution:failed": "failed",
    "execution:cancelled": "cancelled",
}


class ClientError(FlowcastError):
    """Root of every error the client raises."""

    code = "client_error"


class Unreachable(ClientError):
    """The server could not be reached."""

    code = "unreachable"

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the server at {url}: {reason}")
        self.url = url
        self.reason = reason


class Refused(ClientError):
    """The server answered with an error status; ``message`` is the server's own."""

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.body = body


@dataclass(frozen=True)
class Event:
    """One event of the stream: its envelope (id, type, data, …)."""

    id: int
    type: str
    data: dict[str, Any]
    envelope: dict[str, Any]

    @property
    def terminal_status(self) -> str | None:
        return TERMINAL_EVENTS.get(self.type)


@dataclass(frozen=True)
class Gap:
    """A ``replay:gap`` frame: the events after ``after`` and before ``resume_at`` are gone."""

    after: int
    resume_at: int
    reason: str


@dataclass(frozen=True)
class Queued:
    """A ``queue`` frame: the execution waits for a worker, ``ahead`` others first (an
    estimate)."""

    ahead: int


@dataclass(frozen=True)
class Reconnecting:
    """The connection ended before the terminal event; the next one starts after ``cursor``."""

    cursor: int
    delay: float
    reason: str


@dataclass(frozen=True)
class Finished:
    """The server answered 204: the cursor is at or past the terminal event."""

    cursor: int


StreamItem = Event | Gap | Queued | Reconnecting | Finished


def retry_after(response: httpx.Response) -> float:
    """The seconds a response's ``Retry-After`` asks for (capped; 0 without one, or
    with an HTTP date, which this client leaves to its own backoff)."""
    try:
        seconds = float(response.headers.get("Retry-After", "0"))
    except ValueError:
        return 0.0
    if not math.isfinite(seconds):
        return 0.0
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_SECONDS)


def backoff(attempt: int, *, base: float = 0.2, cap: float = 5.0) -> float:
    """Full-jitter exponential backoff for the ``attempt``-th consecutive failure (from 0)."""
    return random.uniform(0, min(cap, base * 2**attempt))


class FlowcastClient:
    """One server, one API key, one connection pool; use it as a context manager."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        read_timeout: float = 60.0,
        give_up_seconds: float = 30.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"User-Agent": "flowcast-cli"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.url = url.rstrip("/")
        self.give_up_seconds = give_up_seconds
        self.retries = retries
        # Heartbeats arrive every FLOWCAST_SSE_PING_SECONDS, so a silent stream past
        # read_timeout is a stalled connection and is worth a reconnect.
        self._stream_timeout = httpx.Timeout(timeout, read=read_timeout)
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> FlowcastClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, json_body: Any = None, params: Any = None) -> Any:
        """The answer's JSON (None when it has no body); see ``_send``."""
        response = self._send(method, path, json_body=json_body, params=params)
        return response.json() if response.content else None

    def _send(
        self, method: str, path: str, *, json_body: Any = None, params: Any = None
    ) -> httpx.Response:
        """Send one request; transport errors and answers that say "try again" (a proxy's
        502 or 504, a 503) are retried (mutations carry an Idempotency-Key, so a retry
        never starts or resumes anything twice; the server keeps no 5xx outcome under a
        key, and only this client knows the key to retry with; PUT and DELETE are
        idempotent by themselves)."""
        headers = {"Idempotency-Key": uuid.uuid4().hex} if method == "POST" else {}
        for attempt in range(self.retries + 1):
            wait = backoff(attempt)
            try:
                response = self._http.request(
                    method, path, json=json_body, params=params, headers=headers
                )
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise Unreachable(self.url, str(exc) or type(exc).__name__) from exc
            else:
                if response.status_code not in RETRY_STATUSES or attempt == self.retries:
                    break
                # A server that says when to come back is taken at its word (a pause
                # held for a lease answered 503 with Retry-After: 15, and two retries
                # within half a second gave up on it: the fresh-eyes review of 73d4c9d).
                wait = max(wait, retry_after(response))
            time.sleep(wait)
        _raise_for_status(response)
        return response

    def execute(
        self, workflow_id: str, *, input: Any = None, inline_files: bool = False
    ) -> dict[str, Any]:
        """Start an execution (202): ``executionId``, ``status``, ``streamUrl``, …"""
        body: dict[str, Any] = {"input": input}
        if inline_files:
            body["inlineFiles"] = True
        result: dict[str, Any] = self._request(
            "POST", f"/api/workflows/{workflow_id}/execute", json_body=body
        )
        return result

    def execution(self, execution_id: str) -> dict[str, Any]:
        """The execution's snapshot."""
        result: dict[str, Any] = self._request("GET", f"/api/executions/{execution_id}")
        return result

    def executions(
        self, *, workflow_id: str | None = None, status: str | None = None, limit: int = 20
    ) -> list[dict[str, Any]]:
        """Recent executions, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if workflow_id:
            params["workflowId"] = workflow_id
        if status:
            params["status"] = status
        found: list[dict[str, Any]] = self._request("GET", "/api/executions", params=params)[
            "executions"
        ]
        return found

    def resume(
        self, execution_id: str, *, input: Any, block_id: str | None = None
    ) -> dict[str, Any]:
        """Answer the execution's pause."""
        body: dict[str, Any] = {"input": input}
        if block_id:
            body["blockId"] = block_id
        result: dict[str, Any] = self._request(
            "POST", f"/api/executions/{execution_id}/resume", json_body=body
        )
        return result

    def cancel(self, execution_id: str) -> dict[str, Any]:
        """Cancel a running or paused execution."""
        result: dict[str, Any] = self._request("POST", f"/api/executions/{execution_id}/cancel")
        return result

    def events(self, execution_id: str, *, after: int = 0, limit: int = 1000) -> dict[str, Any]:
        """One page of the execution's stored events after ``after``: ``events``,
        ``nextAfter``, ``firstRetainedEventId``, ``lastEventId``, ``status``."""
        page: dict[str, Any] = self._request(
            "GET", f"/api/executions/{execution_id}/events", params={"after": after, "limit": limit}
        )
        return page

    def workflows(self) -> list[dict[str, Any]]:
        """The workflows this key sees: ``id``, ``name``, ``description``, ``blocks``
        (how many), ``source`` (``file`` or ``api``)."""
        found: list[dict[str, Any]] = self._request("GET", "/api/workflows")["workflows"]
        return found

    def workflow(self, workflow_id: str) -> dict[str, Any]:
        """One workflow's document, with its ``source``."""
        document: dict[str, Any] = self._request("GET", f"/api/workflows/{_part(workflow_id)}")
        return document

    def put_workflow(self, workflow_id: str, document: Any) -> tuple[dict[str, Any], bool]:
        """Create or replace a workflow: the stored document and whether it was created."""
        response = self._send("PUT", f"/api/workflows/{_part(workflow_id)}", json_body=document)
        return response.json(), response.status_code == 201

    def delete_workflow(self, workflow_id: str) -> None:
        self._send("DELETE", f"/api/workflows/{_part(workflow_id)}")

    def secrets(self) -> list[dict[str, Any]]:
        """The tenant's secrets: ``name`` and ``updatedAt`` only (no route returns a value)."""
        found: list[dict[str, Any]] = self._request("GET", "/api/secrets")["secrets"]
        return found

    def put_secret(self, name: str, value: str) -> tuple[dict[str, Any], bool]:
        """Store a secret: its ``name`` and ``updatedAt``, and whether it was created."""
        response = self._send("PUT", f"/api/secrets/{_part(name)}", json_body={"value": value})
        return response.json(), response.status_code == 201

    def delete_secret(self, name: str) -> None:
        self._send("DELETE", f"/api/secrets/{_part(name)}")

    def follow(self, execution_id: str, *, after: int = 0) -> Iterator[StreamItem]:
        """The execution's events after ``after`` until the terminal one, reconnecting."""
        cursor = after
        failures = 0
        failing_since: float | None = None
        while True:
            delivered = False
            opened = time.monotonic()
            try:
                for item in self._connect(execution_id, cursor):
                    if isinstance(item, Event):
                        delivered = True
                        cursor = item.id
                    yield item
                    if isinstance(item, Finished) or (
                        isinstance(item, Event) and item.terminal_status
                    ):
                        return
                reason = "the server closed the stream"
            except httpx.TransportError as exc:
                reason = str(exc) or type(exc).__name__
            except Refused as exc:
                if exc.status < 500:
                    raise
                reason = f"{exc.status} {exc.message}"
                opened = float("inf")  # an error answer is never a healthy connection
            # A connection that delivered events or stayed open a while was healthy; one
            # that fails at once (server down, restarting) backs off instead of spinning.
            healthy = delivered or time.monotonic() - opened >= HEALTHY_SECONDS
            if healthy:
                # A normal close (FLOWCAST_SSE_MAX_SECONDS, a replica going away) or a drop
                # after progress: reconnect at once, the way EventSource does.
                failures, failing_since, delay = 0, None, 0.0
            else:
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since > self.give_up_seconds:
                    raise Unreachable(self.url, reason)
                delay = backoff(failures)
                failures += 1
            yield Reconnecting(cursor=cursor, delay=delay, reason=reason)
            time.sleep(delay)

    def _connect(self, execution_id: str, cursor: int) -> Iterator[StreamItem]:
        path = f"/api/executions/{execution_id}/stream"
        with connect_sse(
            self._http,
            "GET",
            path,
            headers={"Last-Event-ID": str(cursor)},
            timeout=self._stream_timeout,
        ) as source:
            response = source.response
            if response.status_code == 204:
                yield Finished(cursor)
                return
            if response.status_code != 200:
                response.read()
                _raise_for_status(response)
            # httpx-sse dispatches a frame only at its blank line, so a frame cut off by a
            # dropped connection is never seen; heartbeat comments yield nothing.
            for frame in source.iter_sse():
                if frame.event == "replay:gap":
                    gap = frame.json()
                    yield Gap(int(gap["after"]), int(gap["resumeAt"]), gap["reason"])
                    continue
                if frame.event == "queue":  # no id: its place in line, before it starts
                    yield Queued(int(frame.json().get("ahead", 0)))
                    continue
                if not frame.id or not frame.data:
                    continue
                envelope = frame.json()
                event = Event(int(frame.id), frame.event, envelope.get("data") or {}, envelope)
                if event.id > cursor:  # never show an id twice, whatever a server sends
                    cursor = event.id
                    yield event


def _part(name: str) -> str:
    """A name typed by a person as one path segment (a ``/`` in it never reaches
    another route)."""
    return quote(name, safe="")


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    code, message, body = "http_error", response.reason_phrase, None
    try:
        body = response.json()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        code = error.get("code", code)
        message = error.get("message", message)
    except ValueError:
        pass
    raise Refused(response.status_code, code, message, body)
