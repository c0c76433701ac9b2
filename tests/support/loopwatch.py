"""The server's own event-loop watch (app/loopwatch.py), read from ``/metrics``."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Buckets = dict[str, dict[float, float]]


async def loop_watch(client: httpx.AsyncClient) -> Buckets:
    """The server's loop watch histograms as they stand (``lag`` and ``held``: count of
    observations at or below each bucket's bound, +Inf included)."""
    answer = await client.get("/metrics")
    assert answer.status_code == 200, answer.text
    found: Buckets = {"lag": {}, "held": {}}
    for family in text_string_to_metric_families(answer.text):
        kind = family.name.removeprefix("flowcast_event_loop_").removesuffix("_seconds")
        if kind in found:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    found[kind][float(sample.labels["le"])] = sample.value
    assert found["lag"] and found["held"], "the loop watch is not in /metrics"
    return found


def worst(before: Buckets, after: Buckets, kind: str) -> float:
    """The bound of the highest bucket that an observation between ``before`` and
    ``after`` fell in: the worst lag (hold) of that time, rounded up to a bucket."""
    grown = {bound: after[kind][bound] - before[kind].get(bound, 0) for bound in after[kind]}
    total = grown[float("inf")]
    return min(bound for bound, count in grown.items() if count == total)
