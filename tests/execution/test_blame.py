"""Blame (lib/execution/blame.py) on a real Valkey: who a process's death is charged to,
judged from the record it kept, and how a process keeps that record and its one suspect.
Found by the step 16 hostile-tenant review (issue 24, row 4)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from lib.execution.blame import NodeRecord, NodeRecords, Suspicion, Verdict
from lib.execution.ownership import Claim
from lib.execution.record import RecoveryReason, Status
from lib.workflows.takeovers import lost_too_often
from tests.support.api import until

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize(
    ("runs", "suspect", "verdict"),
    [
        (1, "", Verdict.ALONE),
        (1, "ex_a", Verdict.ALONE),  # alone, suspect or not: a crash as ever
        (0, "", Verdict.ALONE),
        (3, "ex_a", Verdict.SUSPECT),
        (3, "ex_b", Verdict.BESIDE),
        (3, "", Verdict.CROWD),
    ],
)
def test_a_death_is_charged_by_what_the_process_last_recorded(
    runs: int, suspect: str, verdict: Verdict
) -> None:
    assert NodeRecord(runs, suspect).verdict("ex_a") is verdict


def suspicion(redis: Redis, unique: str, runs: set[str], *, probation: float) -> Suspicion:
    records = NodeRecords(redis=redis, keys=Keys(f"bl{unique}"))
    return Suspicion(
        records=records, node_id="n1", runs=runs, refresh_seconds=60, probation_seconds=probation
    )


async def test_a_suspect_is_recorded_before_its_claim_and_forgotten_once_its_run_ends(
    redis: Redis, unique: str
) -> None:
    """Taken: recorded (counted among the runs) before the claim; busy while it runs
    here; once its run ended, the record says so at the next publish."""
    runs = {"ex_1", "ex_2"}
    mine = suspicion(redis, unique, runs, probation=60)
    assert await mine.records.read("n1") is None
    await mine.take("ex_s")
    assert await mine.records.read("n1") == NodeRecord(3, "ex_s")
    assert mine.busy()
    await mine.settle("ex_s", suspect=True)
    assert not mine.busy()  # settled, but not running here (yet)
    runs.add("ex_s")
    assert mine.busy()
    runs.discard("ex_s")
    await mine.publish()
    assert await mine.records.read("n1") == NodeRecord(2, "")


async def test_a_claim_that_makes_no_suspect_gives_the_place_back(
    redis: Redis, unique: str
) -> None:
    mine = suspicion(redis, unique, {"ex_1"}, probation=60)
    await mine.take("ex_s")
    await mine.settle("ex_s", suspect=False)
    assert not mine.busy()
    assert await mine.records.read("n1") == NodeRecord(1, "")


async def test_a_suspect_past_its_probation_is_no_longer_the_processs_suspect(
    redis: Redis, unique: str
) -> None:
    """It ran a probation here without the process dying: the process may take the next,
    and its record no longer names it (a death now charges it nothing)."""
    runs = {"ex_1", "ex_s"}
    mine = suspicion(redis, unique, runs, probation=0.2)
    await mine.take("ex_s")
    await mine.settle("ex_s", suspect=True)
    assert mine.busy()
    await until(lambda: not mine.busy(), "the probation over", 5)
    await mine.publish()
    assert await mine.records.read("n1") == NodeRecord(2, "")


@pytest.mark.parametrize(
    ("crashes", "deaths", "max_recoveries", "ends"),
    [
        (1, 1, 3, False),
        (3, 3, 3, False),
        (4, 4, 3, True),  # alone every time: FLOWCAST_MAX_RECOVERIES as ever
        (0, 1, 0, True),  # recovery off: no death is recovered, charged or not
        (0, 8, 3, False),  # beside others 8 times, never charged
        (0, 9, 3, True),  # past 2 deaths per recovery allowed: a slow killer ends
        (2, 3, 1, True),
    ],
)
def test_a_run_ends_worker_lost_past_its_charged_crashes_or_too_many_deaths(
    crashes: int, deaths: int, max_recoveries: int, ends: bool
) -> None:
    claim = Claim(5, 9, Status.RUNNING, "n2:1", 3, 1, RecoveryReason.WORKER_LOST, crashes)
    assert lost_too_often(replace(claim, deaths=deaths), max_recoveries) is ends
