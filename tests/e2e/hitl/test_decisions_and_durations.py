"""What a person decided at an approval, and how long a run took, as the events and the
API say it (SPEC §4, §6, §9): a run's ``durationMs`` counts from its ``createdAt`` to its
terminal event (its pause included, not only the part after the resume); its list row
ends at that event; a rejection (``approved: false``) is on ``execution:resumed`` with
its note, and the snapshot and the list say ``decision: rejected``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.support.api import (
    all_events,
    execute,
    ms_between,
    of_type,
    put,
    refund_workflow,
    wait_finished,
    wait_status,
)

# How long the person takes in these runs: the pause must show in the durations.
THINKING_SECONDS = 1.5


async def answered(client: httpx.AsyncClient, workflow_id: str, answer: Any) -> str:
    """A run of ``workflow_id`` paused, answered ``answer`` after the person's time, ended."""
    execution_id = await execute(client, workflow_id, {})
    await wait_status(client, execution_id, "paused")
    await asyncio.sleep(THINKING_SECONDS)  # the person reads the prompt: not a readiness wait
    response = await client.post(
        f"/api/executions/{execution_id}/resume", json={"blockId": "review", "input": answer}
    )
    assert response.status_code == 202, response.text
    await wait_finished(client, execution_id, timeout=20)
    return execution_id


@pytest.mark.timeout(60)
async def test_a_rejected_approval_is_a_decision_the_events_the_snapshot_and_the_list_say(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"refund-{unique}"
    await put(client, refund_workflow(workflow_id))
    answer = {"approved": False, "note": "too much"}
    execution_id = await answered(client, workflow_id, answer)

    stored = await all_events(client, execution_id)
    (resumed,) = of_type(stored, "execution:resumed")
    assert resumed["data"] == {"blockId": "review", "input": answer}
    assert of_type(stored, "block:skipped")[0]["data"]["blockId"] == "issue"
    completed = stored[-1]
    assert completed["type"] == "execution:completed"

    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    assert snapshot["status"] == "completed"
    assert snapshot["decision"] == "rejected"
    listed = (await client.get(f"/api/executions?workflowId={workflow_id}")).json()
    (row,) = listed["executions"]
    assert row["decision"] == "rejected"

    approved = await answered(client, workflow_id, {"approved": True})
    snapshot = (await client.get(f"/api/executions/{approved}")).json()
    assert "decision" not in snapshot, "only a rejection is a decision the lists show"


@pytest.mark.timeout(60)
async def test_a_paused_runs_duration_counts_from_its_creation_to_its_terminal_event(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"paused-{unique}"
    await put(client, refund_workflow(workflow_id))
    execution_id = await answered(client, workflow_id, {"approved": True})

    stored = await all_events(client, execution_id)
    (paused,) = of_type(stored, "execution:paused")
    (resumed,) = of_type(stored, "execution:resumed")
    completed = stored[-1]
    assert completed["type"] == "execution:completed"
    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    waited = ms_between(paused["ts"], resumed["ts"])
    assert waited >= THINKING_SECONDS * 1000
    # The server's figure, the events' own clock and the list's row tell one duration.
    took = completed["data"]["durationMs"]
    assert abs(took - ms_between(snapshot["createdAt"], completed["ts"])) <= 2, took
    assert took > waited, (took, waited)
    assert snapshot["updatedAt"] == completed["ts"], "the row ends at the terminal event"
