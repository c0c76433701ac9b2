"""The log checker: validates an execution's event log, stored or as a client saw it."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

TERMINAL = {"execution:completed", "execution:failed", "execution:cancelled"}


def check_log(envelopes: Sequence[dict[str, Any]], *, complete: bool = True) -> None:
    """Assert a full log: ids 1..N contiguous, started first, one terminal event, last."""
    ids = [envelope["id"] for envelope in envelopes]
    assert ids, "the log is empty"
    assert ids == list(range(1, len(ids) + 1)), f"ids are not 1..N: {_summary(ids)}"
    assert envelopes[0]["type"] == "execution:started", envelopes[0]
    terminals = [envelope for envelope in envelopes if envelope["type"] in TERMINAL]
    if complete:
        assert len(terminals) == 1, f"expected one terminal event, got {terminals}"
        assert envelopes[-1]["type"] in TERMINAL, f"last event is {envelopes[-1]['type']}"
    else:
        assert not terminals or envelopes[-1]["type"] in TERMINAL
    execution_ids = {envelope["executionId"] for envelope in envelopes}
    assert len(execution_ids) == 1, f"events of several executions: {execution_ids}"


def check_lossy_log(
    envelopes: Sequence[dict[str, Any]], *, dropped: Sequence[tuple[int, int]] = ()
) -> None:
    """Assert a stored log of a store that may have lost writes or evicted old events:
    ids increasing, a hole only where a recorded ``dropped`` range (inclusive bounds)
    covers it, a missing start only before the first retained id (the ring evicted it),
    ``execution:started`` first if id 1 is kept, one terminal event, last."""
    ids = [envelope["id"] for envelope in envelopes]
    assert ids, "the log is empty"
    assert all(a < b for a, b in pairwise(ids)), f"ids are not increasing: {_summary(ids)}"
    for before, after in pairwise(ids):
        missing = set(range(before + 1, after))
        for low, high in dropped:
            missing -= set(range(low, high + 1))
        assert not missing, (
            f"ids {before + 1}..{after - 1} are missing and not recorded as dropped "
            f"(dropped ranges {list(dropped)})"
        )
    if ids[0] == 1:
        assert envelopes[0]["type"] == "execution:started", envelopes[0]
    terminals = [envelope for envelope in envelopes if envelope["type"] in TERMINAL]
    assert len(terminals) <= 1, (
        f"{len(terminals)} terminal events: {[(e['id'], e['type']) for e in terminals]}"
    )
    assert terminals, f"no terminal event; the last is {ids[-1]} {envelopes[-1]['type']}"
    assert envelopes[-1]["type"] in TERMINAL, (
        f"the terminal event {terminals[0]['id']} is not last: {ids[-1]} "
        f"{envelopes[-1]['type']} follows it"
    )
    execution_ids = {envelope["executionId"] for envelope in envelopes}
    assert len(execution_ids) == 1, f"events of several executions: {execution_ids}"


def check_view(frames: Sequence[Any], *, after: int = 0) -> list[dict[str, Any]]:
    """Assert what a client received after a cursor: ordered, no duplicate, holes only
    behind an explicit ``replay:gap``; returns the event envelopes."""
    expected = after + 1
    envelopes = []
    for frame in frames:
        if frame.event == "replay:gap":
            gap = frame.json
            assert frame.id is None, "a gap frame must not carry an id"
            assert gap["after"] == expected - 1, gap
            expected = gap["resumeAt"]
            continue
        envelope = frame.json
        assert frame.id == str(envelope["id"]), f"id line {frame.id} != envelope {envelope['id']}"
        assert frame.event == envelope["type"]
        assert envelope["id"] == expected, f"expected id {expected}, got {envelope['id']}"
        expected += 1
        envelopes.append(envelope)
    return envelopes


def _summary(ids: list[int]) -> str:
    return str(ids) if len(ids) < 30 else f"{ids[:10]} … {ids[-10:]} ({len(ids)} ids)"


def same_ids_same_events(seen: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
    """SPEC §4: an id is never given to two different events (what a client saw live
    and what is stored under the same id must be the same event)."""
    by_id = {event["id"]: event for event in stored}
    clashes = [
        (event["id"], event["type"], by_id[event["id"]]["type"])
        for event in seen
        if event["id"] in by_id and by_id[event["id"]] != event
    ]
    assert not clashes, (
        f"ids a client saw now name other events (id, seen type, stored type): {clashes}"
    )
