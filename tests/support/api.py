"""Helpers that drive Flowcast's HTTP API the way a client would."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import httpx


def streaming_workflow(workflow_id: str, words: int = 30, tps: float = 0) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "intro", "type": "transform", "config": {"value": "{{ input.name }}"}},
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": tps}},
            {
                "id": "done",
                "type": "transform",
                "config": {"value": {"who": "{{ blocks.intro.output }}"}},
            },
        ],
        "edges": [{"from": "intro", "to": "talk"}, {"from": "talk", "to": "done"}],
    }


def delay_workflow(workflow_id: str, ms: int = 30_000) -> dict[str, Any]:
    """hello → think (a delay of ``ms``) → bye: a run that sits in one block."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "hello", "type": "transform", "config": {"value": 1}},
            {"id": "think", "type": "delay", "config": {"ms": ms}},
            {"id": "bye", "type": "transform", "config": {"value": 2}},
        ],
        "edges": [{"from": "hello", "to": "think"}, {"from": "think", "to": "bye"}],
    }


def talking_workflow(workflow_id: str, *, words: int, tps: float) -> dict[str, Any]:
    """One ``generate`` block named talk: ``words`` chunks at ``tps`` a second."""
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": tps}}
        ],
        "edges": [],
    }


def flaky_workflow(workflow_id: str, *, words: int = 3) -> dict[str, Any]:
    """One ``flaky`` plugin block named talk (needs ``FLOWCAST_PLUGINS=tests.support.plugins``):
    attempt 1 streams ``try1-w0 …`` and fails, attempt 2 streams ``try2-w0 …`` and completes."""
    return {
        "id": workflow_id,
        "blocks": [
            {
                "id": "talk",
                "type": "python",
                "config": {"name": "flaky", "args": {"words": words}},
                "retry": {"attempts": 2, "backoffMs": 0},
            }
        ],
        "edges": [],
    }


async def start_execution(
    client: httpx.AsyncClient,
    workflow_id: str,
    input: Any = None,
    *,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Execute a stored workflow with ``{"input": input}`` (or ``body`` as it is); asserts
    the 202 and returns its answer (``executionId``, ``streamUrl``, …)."""
    payload = {"input": input} if body is None else body
    response = await client.post(
        f"/api/workflows/{workflow_id}/execute", json=payload, headers=headers
    )
    assert response.status_code == 202, response.text
    started: dict[str, Any] = response.json()
    return started


async def execute(
    client: httpx.AsyncClient,
    workflow_id: str,
    input: Any = None,
    *,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> str:
    """``start_execution``, for the id only."""
    started = await start_execution(client, workflow_id, input, body=body, headers=headers)
    return str(started["executionId"])


def quick_workflow(workflow_id: str) -> dict[str, Any]:
    """One transform block: a run that completes at once."""
    return {
        "id": workflow_id,
        "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
        "edges": [],
    }


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    """review (an approval, any answer) → done: a run that waits for a resume."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": {}}},
            {"id": "done", "type": "transform", "config": {"value": 1}},
        ],
        "edges": [{"from": "review", "to": "done"}],
    }


async def put(client: httpx.AsyncClient, workflow: dict[str, Any]) -> None:
    response = await client.put(f"/api/workflows/{workflow['id']}", json=workflow)
    assert response.status_code in (200, 201), response.text


async def all_events(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        page = (await client.get(f"/api/executions/{execution_id}/events?after={after}")).json()
        found += page["events"]
        if not page["events"]:
            return found
        after = page["nextAfter"]


async def paused_execution(client: httpx.AsyncClient, workflow_id: str) -> str:
    """Start ``workflow_id`` (stored already) and wait until it is paused; its id."""
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert response.status_code == 202, response.text
    execution_id: str = response.json()["executionId"]
    await wait_status(client, execution_id, "paused", timeout=20)
    return execution_id


async def wait_finished(
    client: httpx.AsyncClient, execution_id: str, *, timeout: float | None = None
) -> dict[str, Any]:
    """Poll the snapshot until the execution ended; the snapshot (``timeout`` None: the
    test's own timeout bounds the wait)."""

    async def ended() -> dict[str, Any] | None:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        return snapshot if snapshot["status"] in ("completed", "failed", "cancelled") else None

    found: dict[str, Any] = await until(ended, f"{execution_id} ended", timeout)
    return found


async def wait_status(
    client: httpx.AsyncClient, execution_id: str, status: str, *, timeout: float | None = 20
) -> None:
    """Poll the snapshot until the execution shows ``status``."""

    async def shows() -> bool:
        snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
        return bool(snapshot["status"] == status)

    await until(shows, f"{execution_id} {status}", timeout)


Check = Callable[[], Awaitable[Any] | Any]


async def _checked(check: Check) -> Any:
    found = check()
    return await found if inspect.isawaitable(found) else found


async def until(
    check: Check, what: str, timeout: float | None = 40.0, *, every: float = 0.02
) -> Any:
    """Poll ``check`` (a coroutine function, or a plain one for state of the test's own)
    until it returns something truthy, and return that; after ``timeout`` seconds (by
    default the fault tests' deadline; ``None``: the test's own timeout bounds it) fail
    naming ``what``."""
    try:
        async with asyncio.timeout(timeout):
            while not (found := await _checked(check)):
                await asyncio.sleep(every)
            return found
    except TimeoutError:
        raise AssertionError(f"timed out waiting for: {what}") from None


async def within(check: Check, seconds: float, *, every: float = 0.02) -> Any:
    """Poll ``check`` (as ``until`` does) for up to ``seconds``: what it returned once
    truthy, or ``None`` once the time is up (for a test that judges what happened
    within a window)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while not (found := await _checked(check)):
                await asyncio.sleep(every)
            return found
    return None


async def sse_clients(client: httpx.AsyncClient) -> float:
    """The server's ``flowcast_sse_clients`` gauge, read from /metrics."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("flowcast_sse_clients "):
            return float(line.split()[1])
    raise AssertionError("no flowcast_sse_clients in /metrics")


async def stored_types(client: httpx.AsyncClient, execution_id: str) -> list[str]:
    """The types of the execution's stored events, in order."""
    return [event["type"] for event in await all_events(client, execution_id)]


async def has_stored(client: httpx.AsyncClient, execution_id: str, event_type: str) -> bool:
    """Whether the stored log holds an event of ``event_type`` yet."""
    return event_type in await stored_types(client, execution_id)


def of_type(log: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The envelopes of one type in a log."""
    return [envelope for envelope in log if envelope["type"] == kind]


def ms_between(earlier: str, later: str) -> float:
    """The ms from one ISO 8601 timestamp (``createdAt``, an event's ``ts``) to another."""

    def parse(ts: str) -> datetime:
        return datetime.fromisoformat(ts.replace("Z", "+00:00"))

    return (parse(later) - parse(earlier)).total_seconds() * 1000


# An approval that carries a decision and an optional note (SPEC §2's approval schema).
DECISION_SCHEMA = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}, "note": {"type": "string"}},
}


def refund_workflow(workflow_id: str) -> dict[str, Any]:
    """draft → review (approval with a note) → issue, only when approved."""
    review = {"prompt": "Refund?", "schema": DECISION_SCHEMA}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "draft", "type": "transform", "config": {"value": {"amount": 40}}},
            {"id": "review", "type": "approval", "config": review},
            {"id": "issue", "type": "transform", "config": {"value": "issued"}},
        ],
        "edges": [
            {"from": "draft", "to": "review"},
            {"from": "review", "to": "issue", "when": "blocks.review.output.approved"},
        ],
    }


async def figures_where(client: httpx.AsyncClient, check: Callable[[str], bool], what: str) -> str:
    """The first ``/metrics`` scrape whose figures pass ``check``: a scrape reads the
    queue from Redis within a bound (lib/metrics.py ``refresh``) and keeps the last
    figures past it, so one scrape on a busy machine can show the one before's."""

    async def scraped() -> str | None:
        answer = await client.get("/metrics")
        assert answer.status_code == 200, answer.text
        return answer.text if check(answer.text) else None

    found: str = await until(scraped, what, 20, every=0.05)
    return found
