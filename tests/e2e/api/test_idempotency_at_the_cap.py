"""Concurrent repeats of a keyed execute at the tenant's cap (SPEC §3 "Idempotency": a
repeat returns the original outcome, same execution id, even when the repeats arrive
concurrently; §5 the cap).

Found by the step 15 second fault review: the start's admission is taken before
start.lua finds the named execution created already, so a repeat racing the request
that creates it, the tenant at its cap by that very execution, was refused 429 while the
other answered 202 with the key's execution (9 of 15 pairs on two replicas). A keyed
execute refused 429 now looks for the execution a moment before answering
(app/idempotency.py, ``_created_meanwhile``).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from tests.support.api import approval_workflow, paused_execution, put, until, wait_finished
from tests.support.servers import ValkeyServer, authed, serving_pair

TRIALS = 15


@pytest.mark.timeout(120)
async def test_concurrent_repeats_at_a_cap_of_one_all_answer_the_one_execution(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    workflow = {"id": "slow", "blocks": [{"id": "d", "type": "delay", "config": {"ms": 30000}}]}
    url = "/api/workflows/slow/execute"
    async with (
        serving_pair(valkey, tmp_path, max_executions_per_tenant="1") as (a, b),
        authed(a) as on_a,
        authed(b) as on_b,
    ):
        await put(on_a, workflow)
        outcomes = []
        for _ in range(TRIALS):
            key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
            answers = await asyncio.gather(
                on_a.post(url, json={"input": {}}, headers=key),
                on_b.post(url, json={"input": {}}, headers=key),
            )
            outcomes.append([(r.status_code, r.json().get("executionId")) for r in answers])
            ids = {r.json()["executionId"] for r in answers if r.status_code == 202}
            for execution_id in ids:
                await on_a.post(f"/api/executions/{execution_id}/cancel")
                await wait_finished(on_a, execution_id, timeout=30)
        split = [pair for pair in outcomes if {status for status, _ in pair} != {202}]
        print(f"\n{len(split)} of {TRIALS} pairs answered apart: {split}")
        assert split == []


@pytest.mark.timeout(120)
async def test_repeats_of_a_refused_key_racing_the_blockers_end_on_two_replicas_start_one(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """The step 15 second fault review: a key refused 429 (cap 1, a pause holds it) is
    repeated from both replicas while the pause is cancelled: a repeat answers 429 or
    202 with the key's one execution, never another, and the cap holds throughout."""
    url = "/api/workflows/cap/execute"
    async with (
        serving_pair(valkey, tmp_path, max_executions_per_tenant="1") as (a, b),
        authed(a) as on_a,
        authed(b) as on_b,
    ):
        await put(on_a, approval_workflow("cap"))
        blocker = await paused_execution(on_a, "cap")
        key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
        refused = await on_b.post(url, json={"input": {}}, headers=key)
        assert refused.status_code == 429, refused.text

        async def repeat(n: int) -> tuple[int, str | None]:
            answer = await (on_a if n % 2 else on_b).post(url, json={"input": {}}, headers=key)
            assert answer.status_code in (202, 429), answer.text
            return answer.status_code, answer.json().get("executionId")

        cancel = on_a.post(f"/api/executions/{blocker}/cancel")
        answers = await asyncio.gather(cancel, *(repeat(n) for n in range(8)))
        assert answers[0].status_code == 202, answers[0].text
        await wait_finished(on_a, blocker, timeout=30)

        async def admitted() -> str | None:
            status, execution_id = await repeat(0)
            return execution_id if status == 202 else None

        execution_id = await until(admitted, "the key's execution admitted", timeout=30)
        ids = {eid for status, eid in answers[1:] if status == 202} | {execution_id}
        assert ids == {execution_id}, ids
        listed = (await on_b.get("/api/executions?workflowId=cap&limit=200")).json()
        assert {e["id"] for e in listed["executions"]} == {execution_id, blocker}
