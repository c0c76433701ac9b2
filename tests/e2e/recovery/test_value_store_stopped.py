"""A value store that answers nothing (moto's S3 stopped with SIGSTOP: an endpoint
black-holed) holds up neither a start, nor a run's end, nor a replica's shutdown
(SPEC §5: "Buffer outages never fail, stall or slow the workflow's work"; §7 shutdown).

Since the durable records (ceiling.py, finals.py) an owner writes one to the value store
as its run ends; the replica's own moto server here, so stopping it touches no other test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.api import execute, put
from tests.support.faults import LEASE_SECONDS, FaultyValkey, replica, terminate_replica
from tests.support.recovery import chain, finished, http_for, running, settled, valkey
from tests.support.s3 import MotoServer, shared_bucket

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


@pytest.fixture
async def own_moto(tmp_path: Path) -> AsyncIterator[MotoServer]:
    server = MotoServer(log_path=tmp_path / "moto.log")
    await server.start()
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await server.stop()


async def _run_then_terminate(
    valkey: FaultyValkey, root: Path, bucket: dict[str, str], moto: MotoServer, *, stop: bool
) -> tuple[str, float]:
    """One replica runs a short chain to its end (the value store stopped first if
    ``stop``), then is SIGTERMed: the run's status and how long the exit took."""
    one = replica(valkey, root, "stopped" if stop else "probe", **bucket)
    async with running(one), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, one), chain("short", blocks=2, ms=50))
        if stop:
            os.kill(moto.pid, signal.SIGSTOP)
        eid = await execute(http_for(http, one), "short")
        status = (await finished(http_for(http, one), eid))["status"]
        began = time.monotonic()
        await terminate_replica(one, timeout=120)
        return status, time.monotonic() - began


@pytest.mark.timeout(180)
async def test_a_stopped_value_store_does_not_hold_a_shutdown_after_the_runs_ended(
    valkey: FaultyValkey, tmp_path: Path, own_moto: MotoServer
) -> None:
    """A replica whose run ended while the value store answered nothing exits on
    SIGTERM within a few leases of a probe replica's exit with the store up: its run's
    task waited for the final record's PUT (boto3: 60 s timeouts, retried) and held
    the drain for the grace and 10 s more (11.5 s against a 0.22 s probe, 1 s grace).
    Found by the h1 fresh-eyes review."""
    bucket = await shared_bucket(own_moto)
    status, probe = await _run_then_terminate(valkey, tmp_path, bucket, own_moto, stop=False)
    assert status == "completed"
    status, stopped = await _run_then_terminate(valkey, tmp_path, bucket, own_moto, stop=True)
    assert status == "completed"  # the run's end does not wait on the value store
    print(f"\nSIGTERM to exit: {probe:.2f} s (probe), {stopped:.2f} s (value store stopped)")
    assert stopped < 3 * probe + 4 * LEASE_SECONDS, (probe, stopped)
