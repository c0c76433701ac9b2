"""The short version of the stress scenarios (``python -m stress.run``), one test each.

Each scenario runs its own Valkey and Flowcast processes, bounded in time and requests,
and reports every broken invariant (lost or duplicate event, corrupted log, stuck
stream, 5xx, error in a server log) as a finding; a finding fails the test. The long
version is ``python -m stress.run --long`` (see stress/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stress.scenarios import SCENARIOS


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_stress_scenario_keeps_every_stream_invariant(name: str, tmp_path: Path) -> None:
    report = await SCENARIOS[name](tmp_path)
    print(f"\n{report.summary()}")
    assert report.ok, "\n".join([report.summary(), *report.listing()])
