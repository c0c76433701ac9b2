"""Timing checks that hold on a busy machine.

A figure measured under the load a test applies is compared with a probe of the same
figure measured in the same test without that load (the same request, the same server,
right before): a machine shared with other work is several times slower than the one a
fixed number was picked on, and the probe is slowed with it. The bound is
``ratio x probe + floor``; the floor keeps a 1 ms probe from failing a 3 ms answer.

A check that tells two mechanisms of the product apart by their own timers (a cancel
through the control stream, not the 15 s lease expiring; an exit within the grace) is
no measure of the machine: ``assert_below_timer`` names the timer its bound comes from,
with seconds of room for a slow machine.

With ``TIMING_LOG`` set to a file, every check appends its figures there as a JSON line
(test, what, measured, probe, bound, passed): the figures behind a run of the suite
under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Sequence

import httpx

from tests.support.api import until


def record(what: str, measured: float, probe: float, bound: float) -> None:
    """Append one check's figures to ``TIMING_LOG`` when it is set."""
    path = os.environ.get("TIMING_LOG")
    if not path:
        return
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "what": what,
        "measured": round(measured, 4),
        "probe": round(probe, 4),
        "bound": round(bound, 4),
        "passed": measured <= bound,
    }
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")


def assert_within(measured: float, *, probe: float, ratio: float, floor: float, what: str) -> None:
    """``measured`` (seconds) is at most ``ratio`` times ``probe`` plus ``floor``."""
    bound = ratio * probe + floor
    record(what, measured, probe, bound)
    assert measured <= bound, (
        f"{what}: {measured * 1000:.0f} ms, above {bound * 1000:.0f} ms "
        f"({ratio:g} x the probe's {probe * 1000:.0f} ms + {floor * 1000:.0f} ms)"
    )


def assert_below_timer(
    measured: float, *, bound: float, timer: str, what: str, detail: str = ""
) -> None:
    """``measured`` (seconds) is below ``bound``, which ``timer`` of the product sets."""
    record(what, measured, 0.0, bound)
    assert measured < bound, (
        f"{what}: {measured:.2f} s, not below {bound:.2f} s (set by {timer}) {detail}"
    )


async def oversleep(seconds: float, count: int = 5) -> float:
    """The worst overshoot of ``count`` sleeps of ``seconds``, here and now: how late
    this machine wakes a sleeper (the probe for checks on a backoff's waits)."""
    worst = 0.0
    for _ in range(count):
        at = time.monotonic()
        await asyncio.sleep(seconds)
        worst = max(worst, time.monotonic() - at - seconds)
    return worst


async def hold_for(seconds: float, why: str) -> None:
    """Let ``seconds`` pass on purpose, for the reason ``why`` says: the length of a
    fault (Valkey paused, a process stalled, a slow call), or a window in which
    something must *not* happen (no chunk after the terminal event). Never a wait for
    something to be ready: that is a poll of the real condition (``until``,
    ``wait_status``, ``follow`` in tests/support)."""
    assert why, "say what the time is for"
    await asyncio.sleep(seconds)


def median(samples: Sequence[float]) -> float:
    return sorted(samples)[len(samples) // 2]


async def latency(client: httpx.AsyncClient, path: str) -> float:
    """How long one plain GET of ``path`` takes, in seconds (it must answer 200)."""
    at = time.monotonic()
    response = await client.get(path)
    took = time.monotonic() - at
    assert response.status_code == 200, response.text
    return took


async def latencies(client: httpx.AsyncClient, path: str, count: int) -> list[float]:
    """``count`` GETs of ``path``, paced as ``probing`` paces them: the quiet probe."""
    samples = []
    for _ in range(count):
        samples.append(await latency(client, path))
        await hold_for(0.01, "the probe's pace, as ``probing`` paces it")
    return samples


@contextlib.asynccontextmanager
async def probing(client: httpx.AsyncClient, path: str) -> AsyncIterator[list[float]]:
    """GETs of ``path`` one after another (10 ms apart) for as long as the block runs;
    the list fills with their latencies. The one in flight when the block ends is
    waited for: a request held up by a stall counts."""
    samples: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            samples.append(await latency(client, path))
            await hold_for(0.01, "the probe's pace: 10 ms apart")

    prober = asyncio.create_task(probe())
    try:
        # Measuring before the load starts, so the first request under it counts.
        await until(lambda: samples or prober.done(), "the first probe", None, every=0.01)
        yield samples
    finally:
        stop.set()
        await asyncio.wait_for(prober, 30)
