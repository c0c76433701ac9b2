"""The benchmark's ``starts-cost`` rows (bench/starts_cost.py) run end to end on tiny
counts: both ratio rows and the Redis row are produced, with sane figures and every
request answered 202. Timings and targets are the benchmark's business, never asserted
here (SPEC §11)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from bench.report import Report
from bench.stack import QUICK, Stack
from bench.starts_cost import StartsCost
from tests.bench.test_queue_row import Parts
from tests.support.servers import ValkeyServer, prefix

TINY = replace(
    QUICK,
    starts_clients=(4, 8),
    starts_cost_count=20,
    starts_cost_rounds=1,
    starts_cost_sample=5,
    starts_seconds=1.0,
    starts_warmup=0.5,
)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_starts_cost_rows_run(valkey: ValkeyServer, tmp_path: Path) -> None:
    report = Report()
    stack = cast(Stack, Parts(tmp_path, valkey))
    await StartsCost(stack, TINY, report, prefix=prefix()).run()
    rows = {row.metric.split(",")[0].split(" (")[0]: row for row in report.rows}
    assert not [row for row in report.rows if row.flowcast.startswith("error")], report.rows
    cpu = rows["starts: server CPU per one-`transform` execution"]
    accept = rows["starts: executions accepted per second"]
    redis = rows["starts: Redis per execution"]
    for row in (cpu, accept):
        assert row.baseline.startswith("bare FastAPI: "), row
        assert row.ratio.endswith("x") and float(row.ratio[:-1]) > 0, row
        assert row.target.startswith(("≤", "≥")), row
        assert row.result in ("pass", "**miss**"), row
    # Every execution went through Redis: a start is more than one round trip.
    trips = float(redis.flowcast.split(" round trips")[0])
    assert trips >= 1, redis
    # Each part told how it was measured, and every request was answered 202.
    for part in ("cost", "accept", "where"):
        assert any(note.startswith(f"starts-cost, {part}") for note in report.notes), part
    assert "errors none" in next(n for n in report.notes if n.startswith("starts-cost, cost"))
    assert "{'202': 20}" in next(n for n in report.notes if n.startswith("starts-cost, cost"))
