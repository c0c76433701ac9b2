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
    """The most runs doing work at one instant. A run works from its first block event
    to its last, less the time it waited for a person: from ``execution:paused`` to
    ``execution:resumed`` it holds no slot (a resumed run works again from its resumed
    event). (Not from execution:started to its terminal event: a run stops counting for
    its tenant just before its end is emitted, so that a client that saw it end may
    start another at once; the next run's first event may come a little before that end,
    by design.)"""
    edges: list[tuple[datetime, int]] = []
    for events in logs:
        for first, last in _working_spans(events):
            edges.append((datetime.fromisoformat(first["ts"]), 1))
            edges.append((datetime.fromisoformat(last["ts"]), -1))
    edges.sort(key=lambda edge: (edge[0], edge[1]))  # an end before a start at one instant
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def _working_spans(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A run's spans of work: (its first event, its last block event), split at pauses."""
    spans: list[tuple[dict[str, Any], dict[str, Any]]] = []
    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    for event in events:
        kind = event["type"]
        if kind == "execution:resumed":
            first, last = event, None
        elif kind.startswith("block:"):
            first = first or event
            last = event
        elif kind == "execution:paused":
            if first is not None and last is not None:
                spans.append((first, last))
            first = last = None
    if first is not None and last is not None:
        spans.append((first, last))
    return spans
