"""How long the event loop went without serving anyone (SPEC §8: no request, event or
value holds it for more than about 50 ms).

One task sleeps ``interval`` again and again and sees how late it wakes: the lag is
how long every other ready request, timer (lease renewals) and socket waited too. A
late wake has two causes: code of this process holding the loop, or the machine not
running the process (other work on its CPUs). The CPU this thread used while the wake
was late tells them apart: ``held`` is the smaller of the lag and that CPU time, the
part of the lag the loop spent itself. Both go to /metrics as histograms
(``flowcast_event_loop_lag_seconds``, ``flowcast_event_loop_held_seconds``).

It costs a wake-up per interval: every 10 ms, 1.3% of a CPU of an idle process on a
VM; every 100 ms (the default), nothing measurable (0.24 s of CPU in 30 s, 0.26 without).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from lib import tasks
from lib.metrics import Metrics


class LoopWatch:
    """The loop's lag, measured every ``interval`` seconds (0: not measured)."""

    def __init__(self, metrics: Metrics, interval: float) -> None:
        self._metrics = metrics
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopWatch:
        if self._interval > 0:
            self._task = asyncio.create_task(self._watch(), name="loop-watch")
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await tasks.stop(self._task)

    async def _watch(self) -> None:
        lag, held = self._metrics.loop_lag, self._metrics.loop_held
        interval = self._interval
        while True:
            since, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(interval)
            late = max(0.0, time.perf_counter() - since - interval)
            lag.observe(late)
            held.observe(min(late, time.thread_time() - cpu))
