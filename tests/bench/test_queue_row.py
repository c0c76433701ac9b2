"""The benchmark's queue row (bench/queue.py) runs end to end on tiny counts: every case
adds its rows, none ends in an error. Timings are the benchmark's business, never
asserted here (SPEC §11)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from bench.queue import QueueBench
from bench.report import Report
from bench.stack import QUICK, Stack
from tests.support.servers import ValkeyServer, prefix

TINY = replace(
    QUICK,
    queue_slots=2,
    queue_start_runs=2,
    queue_flood=30,
    queue_spread=3,
    queue_block_ms=100,
    queue_light_runs=2,
    queue_share_seconds=1.0,
    queue_kill_running=2,
    queue_kill_runs=1,
    queue_chain_blocks=8,
    queue_start_timeout=3.0,
    queue_lease_seconds=2.0,
    recovery_block_ms=250,
    recovery_lease_seconds=1.0,
    recovery_grace_seconds=1.0,
)


class Parts:
    """What the queue metric takes from bench.stack.Stack: a Valkey, a directory and the
    servers' environment (no S3: the values stay in each server's data directory)."""

    def __init__(self, root: Path, valkey: ValkeyServer) -> None:
        self.root = root
        self.valkey = valkey

    def flowcast_env(self, **extra: str) -> dict[str, str]:
        return {
            "FLOWCAST_REDIS_URL": self.valkey.url,
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "0",
            **extra,
        }


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_queue_row_runs_every_case(valkey: ValkeyServer, tmp_path: Path) -> None:
    report = Report()
    stack = cast(Stack, Parts(tmp_path, valkey))
    await QueueBench(stack, TINY, report, prefix=prefix()).run()
    rows = [row.metric for row in report.rows]
    assert len(rows) == 6, rows
    for wanted in ("free slots, p50", "free slots, p99", "light tenant", "share", "SIGKILLed"):
        assert any(wanted in metric for metric in rows), (wanted, rows)
    assert not [row for row in report.rows if row.flowcast.startswith("error")]
    # Every case told how it was measured.
    for case in ("start", "light", "share", "kill"):
        assert any(note.startswith(f"queue, {case}") for note in report.notes), case
