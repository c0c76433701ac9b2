"""Requests that race at a pause, sent at the same instant to two replicas: a resume
against the approval's deadline, a resume against a cancel, two resumes. Whatever wins,
a 202 means it happens and a 409 names the state that won (SPEC §3 "Every accepted
request takes effect", §6), and the execution ends with exactly one terminal event.

Found by the step 15 fault review (tried; it held).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, put, wait_status
from tests.support.faults import FaultyValkey, replica
from tests.support.logcheck import check_log
from tests.support.recovery import finished, http_for, running, settled, valkey

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

pytestmark = pytest.mark.timeout(120)

TRIES = 6


def asking(workflow_id: str, *, timeout_seconds: float | None = None) -> dict[str, Any]:
    ask: dict[str, Any] = {"prompt": "Go?", "schema": {}}
    if timeout_seconds is not None:
        ask["timeoutSeconds"] = timeout_seconds
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "ask", "type": "approval", "config": ask},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [{"from": "ask", "to": "done"}],
    }


async def paused(client: httpx.AsyncClient, workflow_id: str) -> str:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert response.status_code == 202, response.text
    execution_id: str = response.json()["executionId"]
    await wait_status(client, execution_id, "paused")
    return execution_id


def resume(client: httpx.AsyncClient, eid: str) -> Any:
    return client.post(f"/api/executions/{eid}/resume", json={"input": {"go": True}})


async def cancel(client: httpx.AsyncClient, eid: str, *, lag: float) -> httpx.Response:
    await asyncio.sleep(lag)
    return await client.post(f"/api/executions/{eid}/cancel")


async def test_a_resume_at_the_approval_deadline_either_wins_whole_or_gets_409(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Resumes sent from a little before to a little after a 1 s deadline."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    outcomes: list[tuple[float, int, str, list[str]]] = []
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), asking("deadline", timeout_seconds=1))
        for index in range(TRIES):
            on_a = http_for(http, a)
            eid = await paused(on_a, "deadline")
            # The pause was stored up to ~20 ms before it was seen: aim around 1 s.
            offset = 0.85 + 0.08 * index
            await asyncio.sleep(offset)
            answer = await resume(http_for(http, b), eid)
            snapshot = await finished(http_for(http, a), eid)
            log = await all_events(http_for(http, a), eid)
            check_log(log)
            types = [event["type"] for event in log]
            outcomes.append((offset, answer.status_code, snapshot["status"], types[-2:]))
            if answer.status_code == 202:
                assert snapshot["status"] == "completed", (answer.text, types)
                assert types.count("execution:resumed") == 1, types
            else:
                assert answer.status_code == 409, answer.text
                assert snapshot["status"] == "failed", (answer.text, types)
                assert snapshot["error"]["code"] == "approval_timeout", snapshot
                assert "execution:resumed" not in types, types
                assert answer.json()["error"].get("status") != "paused", answer.text
    print("\n" + "\n".join(map(str, outcomes)))


async def test_a_resume_and_a_cancel_at_once_on_two_replicas_both_take_effect_when_accepted(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    outcomes: list[tuple[int, int, str]] = []
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
    ):
        await put(on_a, asking("racing"))
        for index in range(TRIES):
            eid = await paused(on_a, "racing")
            first, second = (on_a, on_b) if index % 2 else (on_b, on_a)

            # The resume validates its input first: the cancel, a step behind, lets
            # either win across the tries.
            resumed, cancelled = await asyncio.gather(
                resume(first, eid), cancel(second, eid, lag=0.004 * index)
            )
            snapshot = await finished(on_a, eid)
            log = await all_events(on_a, eid)
            check_log(log)
            types = [event["type"] for event in log]
            outcomes.append((resumed.status_code, cancelled.status_code, snapshot["status"]))
            assert {resumed.status_code, cancelled.status_code} <= {202, 409}, (
                resumed.text,
                cancelled.text,
            )
            assert 202 in (resumed.status_code, cancelled.status_code), outcomes[-1]
            if cancelled.status_code == 202:
                assert snapshot["status"] == "cancelled", (outcomes[-1], types)
            else:
                assert snapshot["status"] == "completed", (outcomes[-1], cancelled.text, types)
            if resumed.status_code == 202:
                assert types.count("execution:resumed") == 1, (outcomes[-1], types)
            else:
                assert "execution:resumed" not in types, (outcomes[-1], resumed.text, types)
    print("\n" + "\n".join(map(str, outcomes)))


async def test_two_resumes_at_once_on_two_replicas_one_wins(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with (
        running(a, b),
        httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
    ):
        await put(on_a, asking("twice"))
        for _ in range(TRIES):
            eid = await paused(on_a, "twice")
            answers = await asyncio.gather(resume(on_a, eid), resume(on_b, eid))
            codes = sorted(answer.status_code for answer in answers)
            assert codes == [202, 409], [answer.text for answer in answers]
            refused = next(answer for answer in answers if answer.status_code == 409)
            assert refused.json()["error"].get("status") != "paused", refused.text
            snapshot = await finished(on_a, eid)
            log = await all_events(on_a, eid)
            check_log(log)
            assert snapshot["status"] == "completed", snapshot
            assert [e["type"] for e in log].count("execution:resumed") == 1, log


async def test_a_cancel_at_the_approval_deadline_either_wins_or_gets_409(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Cancels sent from a little before to a little after a 1 s deadline: the expire
    and the cancel race for the pause; an accepted cancel wins over the timeout."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    outcomes: list[tuple[float, int, str]] = []
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), asking("cancelling", timeout_seconds=1))
        for index in range(TRIES):
            eid = await paused(http_for(http, a), "cancelling")
            offset = 0.85 + 0.08 * index
            await asyncio.sleep(offset)
            answer = await http_for(http, b).post(f"/api/executions/{eid}/cancel")
            snapshot = await finished(http_for(http, a), eid)
            log = await all_events(http_for(http, a), eid)
            check_log(log)
            outcomes.append((offset, answer.status_code, snapshot["status"]))
            if answer.status_code == 202:
                assert snapshot["status"] == "cancelled", (outcomes[-1], log[-1])
            else:
                assert answer.status_code == 409, answer.text
                assert snapshot["status"] == "failed", (outcomes[-1], log[-1])
                assert snapshot["error"]["code"] == "approval_timeout", snapshot
    print("\n" + "\n".join(map(str, outcomes)))
