"""What ran at once, from the runs' stored events (the queue's caps, SPEC §14)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx

from tests.support.api import wait_finished
from tests.support.logcheck import check_log


async def run_log(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    """The stored log of a run once it completed, checked whole."""
    await wait_finished(client, execution_id)
    events: list[dict[str, Any]] = (
        await client.get(f"/api/executions/{execution_id}/events")
    ).json()["events"]
    check_log(events)
    assert events[-1]["type"] == "execution:completed", events[-1]
    return events


def most_at_once(logs: list[list[dict[str, Any]]]) -> int:
    """The most runs between their first and last stored event at one instant."""
    edges: list[tuple[datetime, int]] = []
    for events in logs:
        edges.append((datetime.fromisoformat(events[0]["ts"]), 1))
        edges.append((datetime.fromisoformat(events[-1]["ts"]), -1))
    edges.sort(key=lambda edge: (edge[0], edge[1]))  # an end before a start at one instant
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most
