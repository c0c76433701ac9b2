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

from tests.support.api import put, wait_finished
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
