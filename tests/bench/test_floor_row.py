"""The benchmark's floor rows (bench/floor.py) run end to end on tiny counts: the relay
processes deliver every frame, every case adds its rows with figures, none ends in an
error. Timings are the benchmark's business, never asserted here (SPEC §11)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from bench.floor import Floor
from bench.metrics import Bench
from bench.report import Report
from bench.stack import QUICK, BaselineServer, Stack
from tests.support.servers import FlowcastServer, ValkeyServer, serving_pair

TINY = replace(QUICK, sl_events=30, floor_rounds=2, ttfe_runs=3)


class Parts:
    """What the floor metric takes from bench.stack.Stack: a Valkey, a directory, the
    replicas A and B (no S3: the values stay in each server's data directory) and the
    plain endpoint."""

    def __init__(
        self, root: Path, valkey: ValkeyServer, a: FlowcastServer, b: FlowcastServer
    ) -> None:
        self.root = root
        self.valkey = valkey
        self.a, self.b = a, b
        self.baseline = BaselineServer(data_dir=root / "baseline")


@contextlib.asynccontextmanager
async def bench_on(valkey: ValkeyServer, root: Path) -> AsyncIterator[Bench]:
    async with serving_pair(valkey, root) as (a, b):
        parts = Parts(root, valkey, a, b)
        await parts.baseline.start()
        bench = Bench(cast(Stack, parts), TINY, Report())
        try:
            await bench.setup()
            yield bench
        finally:
            await bench.close()
            await parts.baseline.stop()


def millis(cell: str) -> float:
    """The figure of a cell such as ``relay 1.23 ms``."""
    value, unit = cell.split()[-2:]
    assert unit == "ms", cell
    return float(value)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_floor_rows_compare_every_case(valkey: ValkeyServer, tmp_path: Path) -> None:
    async with bench_on(valkey, tmp_path) as bench:
        await Floor(bench).run()
    report = bench.report
    assert not [row for row in report.rows if row.flowcast.startswith("error")]
    metrics = [row.metric for row in report.rows]
    assert len(metrics) == 17, metrics
    for wanted in (
        "SL p99, Flowcast (reader on B) ÷ plain",
        "SL p99, relay PUBLISH → SUBSCRIBE (P → Q) ÷ plain",
        "SL p99, stored relay XADD → XREAD BLOCK (P → Q) ÷ plain",
        "SL p99, Flowcast ÷ relay",
        "TTFE p50, Flowcast ÷ plain",
        "TTFE p50, plain + one Redis round trip ÷ plain",
        "TTFE p50, Flowcast ÷ plain + one Redis round trip",
    ):
        assert any(wanted in metric for metric in metrics), (wanted, metrics)
    for row in report.rows:
        # Sane figures: positive, under the streams' timeouts, and their ratio (up to
        # the cells' rounding).
        mine, theirs = millis(row.flowcast), millis(row.baseline)
        assert 0 < mine < 30_000 and 0 < theirs < 30_000, row
        assert abs(float(row.ratio.rstrip("x")) - mine / theirs) <= 0.05 * mine / theirs, row
    # Every case delivered every chunk (a short case is noted), and the method is told.
    assert not [note for note in report.notes if " got " in note], report.notes
    for case in ("floor, SL:", "floor, TTFE:", "floor: load average"):
        assert any(note.startswith(case) for note in report.notes), case
