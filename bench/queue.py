"""The queue metric (SPEC sections 11 and 14): what waiting in line costs, and who waits.

Processes of its own on the run's Valkey, with ``FLOWCAST_API_KEYS`` naming two keys
(two tenants, *heavy* and *light*): API replicas that run no work
(``FLOWCAST_WORKER_SLOTS=0``) and workers (uvicorn replicas with
``FLOWCAST_WORKER_SLOTS=16``). Every execution measured is started through an API
replica, so each one goes through the queue and is taken by a worker.

- start: accepted → ``execution:started`` with free slots, beside the same start on a
  worker, which runs it at once (no queue hop);
- light: the light tenant's wait while the heavy one keeps 10,000 queued, spread over
  20 workflows, beside one slot's turnover measured in the same window;
- share: both tenants kept backlogged (heavy over 20 workflows, light on one) for 60 s:
  the executions each was given;
- kill (``bench/queue_kill.py``): a worker SIGKILLed with 16 running: kill →
  ``execution:recovered`` for each, and each one's terminal events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from app.auth import tenant_of_key
from bench.flood import POSTERS, Feeder, Line, Mark, Start, flood, start_streamed
from bench.flood import settle as settle_late
from bench.flood import wait as shown
from bench.flood import waits as seconds_of
from bench.queue_kill import QueueKill
from bench.report import Report, Row, ms, percentile, ratio, verdict
from bench.scale import Usage, descendants
from bench.stack import Config, Stack
from lib.backend import Keys
from tests.support.servers import ALPHA, BETA, FlowcastServer, bearer

HEAVY, LIGHT = ALPHA, BETA  # the two tenants' API keys
PREFIX = "fcqueue"  # the Redis prefix of its processes (the kill case's: + "kill")
GAP = 0.25  # the light tenant's next start comes at a random moment up to this after
DROPPED = "queued execution not taken"  # a worker's log line: a delivery it dropped
EARLY = "queued execution taken before it exists"  # and one it took too early


def quick() -> dict[str, Any]:
    return {"id": "q-quick", "blocks": [{"id": "only", "type": "transform", "config": {}}]}


def hold(index: int, block_ms: int) -> dict[str, Any]:
    """One of the workflows the backlogs are made of: a slot held for ``block_ms``."""
    return {
        "id": f"q-hold-{index:02d}",
        "blocks": [{"id": "hold", "type": "delay", "config": {"ms": block_ms}}],
    }


class QueueBench:
    """Runs the four cases; each adds its rows and notes to the report."""

    def __init__(
        self, stack: Stack, config: Config, report: Report, *, prefix: str = PREFIX
    ) -> None:
        self.stack = stack
        self.prefix = prefix
        self.config = config
        self.report = report
        self.http = httpx.AsyncClient(timeout=60)
        self.workers: list[FlowcastServer] = []  # whose logs count dropped deliveries
        self.slots = 2 * config.queue_slots
        self.lease = config.queue_lease_seconds

    def queued_key(self, key: str) -> str:
        return Keys(self.prefix).queued(tenant_of_key(key))

    def servers(self, prefix: str, **extra: str) -> Callable[[str, int], FlowcastServer]:
        """A maker of processes sharing one environment: (name, worker slots) → server."""
        env = self.stack.flowcast_env(
            FLOWCAST_REDIS_PREFIX=prefix,
            FLOWCAST_API_KEYS=f"{HEAVY},{LIGHT}",
            FLOWCAST_SECRET_KEY=secrets.token_urlsafe(32),  # replicas must share it
            FLOWCAST_MAX_STREAMS_PER_TENANT="0",
            **extra,
        )

        def make(name: str, slots: int) -> FlowcastServer:
            return FlowcastServer(
                data_dir=self.stack.root / name, env={**env, "FLOWCAST_WORKER_SLOTS": str(slots)}
            )

        return make

    async def put(self, server: FlowcastServer, key: str, workflow: dict[str, Any]) -> None:
        response = await self.http.put(
            f"{server.url}/api/workflows/{workflow['id']}", json=workflow, headers=bearer(key)
        )
        response.raise_for_status()

    async def run(self) -> None:
        config = self.config
        try:
            kill = QueueKill(
                config=config,
                report=self.report,
                http=self.http,
                server=self.servers(
                    f"{self.prefix}kill",
                    FLOWCAST_LEASE_SECONDS=f"{config.recovery_lease_seconds:g}",
                    FLOWCAST_SHUTDOWN_GRACE_SECONDS=f"{config.recovery_grace_seconds:g}",
                ),
                keys=(HEAVY, LIGHT),
            )
            await self.in_line()
            async with kill.started():
                await kill.run()
        finally:
            await self.http.aclose()

    # --- start: one API replica and one idle worker ------------------------------------

    async def start_latency(self, api: FlowcastServer, worker: FlowcastServer) -> None:
        """Accepted → started with free slots: through the queue (the API replica runs
        nothing) and, alternating, on a worker that runs it at once."""
        runs = self.config.queue_start_runs
        queued: list[Start] = []
        direct: list[Start] = []
        logged = self.logged()
        for _ in range(5):  # warm both up
            await self.start(api)
            await self.start(worker)
        for _ in range(runs):
            queued.append(await self.start(api))
            direct.append(await self.start(worker))
        await self.settle(api, queued + direct)
        through, at_once = seconds_of(queued), seconds_of(direct)
        waited = [s.queued_ms / 1000 for s in queued if s.queued_ms is not None] or [math.inf]
        for pct, target in ((50, 0.005), (99, 0.025)):
            q, d = percentile(through, pct), percentile(at_once, pct)
            self.report.add(
                Row(
                    f"queue: accepted → execution:started, free slots, p{pct} ({runs} runs)",
                    shown(q) + self.late_cell(queued, pct),
                    f"run at once: {shown(d)}",
                    ratio(q, d) if q < math.inf else "—",
                    f"≤ {target * 1000:g} ms",
                    verdict(q <= target and not any(s.late for s in queued)),
                )
            )
        self.report.notes.append(
            "queue, start: `POST /api/workflows/q-quick/execute` (one `transform` block) "
            "with `Accept: text/event-stream` to the API replica (FLOWCAST_WORKER_SLOTS=0) "
            "with one idle worker (16 slots), one at a time: request sent → the "
            f"`execution:started` frame received, p50 {shown(percentile(through, 50))}, "
            f"p99 {shown(percentile(through, 99))}, max {shown(max(through))}; its "
            "`queuedMs` (created → started on the servers' clock, whole ms) p50 "
            f"{shown(percentile(waited, 50))}, p99 {shown(percentile(waited, 99))}; "
            f"{sum(1 for s in queued if s.queue_frames)} of {runs} streams showed a "
            "`queue` frame first. Baseline: the same request to the worker, which runs it "
            "at once (nothing waits, a slot is free; `queuedMs` 0 in "
            f"{sum(1 for s in direct if s.queued_ms == 0)} of {runs})."
            + self.late_note(queued, logged)
        )

    async def start(self, server: FlowcastServer) -> Start:
        """One start of the light tenant's quick workflow, streamed from ``server``."""
        timeout = self.config.queue_start_timeout
        return await start_streamed(server.port, LIGHT, "q-quick", timeout=timeout)

    async def settle(self, api: FlowcastServer, starts: list[Start]) -> None:
        """The late starts' waits from their stored logs (a start taken before its record
        existed is queued again after about a lease)."""
        timeout = 2 * self.lease + 10
        await settle_late(self.http, api.url, LIGHT, starts, timeout=timeout)

    def late_cell(self, starts: list[Start], pct: float) -> str:
        """How many started late, and the percentile of the others."""
        late = [s for s in starts if s.late]
        if not late:
            return ""
        never = sum(1 for s in late if s.seconds is None)
        rest = seconds_of([s for s in starts if not s.late]) or [math.inf]
        timeout = self.config.queue_start_timeout
        return (
            f"; {len(late)} started after {timeout:g} s or more"
            + (f" ({never} never)" if never else "")
            + f", p{pct:g} of the others {shown(percentile(rest, pct))}"
        )

    def logged(self) -> Counter[str]:
        """The workers' log lines so far that tell a delivery was not run at once."""
        return Counter(
            {line: sum(w.logs().count(line) for w in self.workers) for line in (EARLY, DROPPED)}
        )

    def late_note(self, starts: list[Start], before: Counter[str]) -> str:
        late = sorted(s.seconds if s.seconds is not None else math.inf for s in starts if s.late)
        logged = self.logged() - before
        text = ""
        if late:
            text += (
                f" LATE: {len(late)} of {len(starts)} showed no `execution:started` within "
                f"{self.config.queue_start_timeout:g} s; their stored `queuedMs`: "
                f"{', '.join(shown(t) for t in late[:12])}{' …' if len(late) > 12 else ''}."
            )
        if logged:
            text += (
                f" The workers logged {logged[EARLY]} '{EARLY}' and {logged[DROPPED]} "
                f"'{DROPPED}' meanwhile: a worker took a start from its line between the "
                "start's two round trips (the batch that queues it, then `start.lua` that "
                "writes its record, lib/execution/ownership.py `start`); the delivery "
                "stays taken until the dispatcher queues it again, about a lease later "
                f"(FLOWCAST_LEASE_SECONDS {self.lease:g} s here)."
            )
        return text

    # --- light and share: an API replica and two workers -------------------------------

    async def in_line(self) -> None:
        config = self.config
        make = self.servers(self.prefix, FLOWCAST_LEASE_SECONDS=f"{self.lease:g}")
        api = make("queue-api", 0)
        self.workers = [make(f"queue-w{i}", config.queue_slots) for i in (1, 2)]
        holds = [hold(i, config.queue_block_ms) for i in range(config.queue_spread)]
        try:
            await asyncio.gather(api.start(), self.workers[0].start())
            for key in (HEAVY, LIGHT):
                for workflow in (quick(), *holds):
                    await self.put(api, key, workflow)
            await self.start_latency(api, self.workers[0])
            await self.workers[0].stop(signal.SIGKILL, timeout=10)  # idle: the flood waits
            async with Redis.from_url(self.stack.valkey.url) as redis:
                turnover = await self.light_wait(api, redis, [w["id"] for w in holds])
                await self.share(api, redis, [w["id"] for w in holds], turnover)
        finally:
            # Throwaway processes with thousands queued: no hand-off to wait for.
            await asyncio.gather(
                *(p.stop(signal.SIGKILL, timeout=10) for p in (api, *self.workers)),
                return_exceptions=True,
            )

    async def light_wait(self, api: FlowcastServer, redis: Redis, holds: list[str]) -> float:
        """The light tenant's waits while the heavy one keeps ``queue_flood`` queued;
        returns one slot's turnover (seconds) measured meanwhile."""
        config = self.config
        target = config.queue_flood
        # The flood is posted before the workers start: the API replica has the CPU to
        # itself, and the backlog is whole when they come.
        began = time.perf_counter()
        statuses = await flood(api.port, HEAVY, holds, target)
        filled = time.perf_counter() - began
        if statuses[202] != target:
            raise RuntimeError(f"the flood was refused: {dict(statuses)}")
        await asyncio.gather(*(worker.start() for worker in self.workers))
        feeder = Feeder(api.port, redis, [Line(HEAVY, self.queued_key(HEAVY), target, holds)])
        starts: list[Start] = []
        logged = self.logged()
        async with feeder.running():
            await feeder.until_taken(HEAVY, self.slots, timeout=60)  # every slot busy
            first = feeder.marks[-1]
            with self.cpu(api) as cpu:
                for _ in range(config.queue_light_runs):
                    await asyncio.sleep(random.uniform(0, GAP))
                    starts.append(await self.start(api))
        last = feeder.marks[-1]
        window = last.at - first.at
        taken = feeder.taken(HEAVY, first, last)
        # A slot's turnover: how long each heavy execution held one, on average (the
        # light tenant's quick runs hold a slot for a few ms only).
        turnover = self.slots * window / max(taken, 1)
        await self.settle(api, starts)
        took = seconds_of(starts)
        queued_ms = [s.queued_ms / 1000 for s in starts if s.queued_ms is not None] or [math.inf]
        depths = [mark.depth[HEAVY] for mark in feeder.marks if first.at <= mark.at]
        p99 = percentile(took, 99)
        self.report.add(
            Row(
                f"queue: a light tenant's wait p99 (p50) while another has "
                f"{target:,} queued ({len(took)} runs)",
                f"{shown(p99)} ({shown(percentile(took, 50))})" + self.late_cell(starts, 99),
                f"slot turnover {ms(turnover)}",
                ratio(p99, turnover) if p99 < math.inf else "—",
                "≤ turnover + 100 ms",
                verdict(p99 <= turnover + 0.100 and min(depths) >= 0.9 * target),
            )
        )
        durations = self.run_durations("q-hold-")
        self.report.notes.append(
            f"queue, light: the heavy tenant's backlog, {target:,} executions of a "
            f"{config.queue_block_ms} ms `delay` spread round robin over {len(holds)} "
            f"workflows, posted through the API replica before the workers started in "
            f"{filled:.1f} s ({target / filled:,.0f}/s over {POSTERS} keep-alive "
            f"connections), then kept at {target:,} (looked at every 0.2 s: "
            f"{min(depths):,} to {max(depths):,} queued); 2 workers x {config.queue_slots} "
            f"slots ran {taken:,} heavy executions in the {window:.1f} s window: one slot's "
            f"turnover {ms(turnover)} ({self.slots} slots x window ÷ executions; each run "
            f"from its start to its end p50 {ms(percentile(durations, 50))}, by the "
            f"workers' `durationMs`). The light tenant started one `transform` at a time "
            "through the same API replica, each at a random moment up to "
            f"{GAP * 1000:.0f} ms after the last one's stream ended: request sent → "
            f"`execution:started` received p50 {shown(percentile(took, 50))}, p99 "
            f"{shown(p99)}, max {shown(max(took))}; `queuedMs` p50 "
            f"{shown(percentile(queued_ms, 50))}, p99 {shown(percentile(queued_ms, 99))}, "
            f"max {shown(max(queued_ms))}; {cpu.describe()}." + self.late_note(starts, logged)
        )
        return turnover

    def cpu(self, api: FlowcastServer) -> Cpu:
        valkey = getattr(self.stack.valkey, "_process", None)
        return Cpu(api, self.workers, valkey.pid if valkey is not None else None)

    def run_durations(self, prefix: str) -> list[float]:
        """Seconds each run of a workflow named ``prefix…`` took, by the workers' logs."""
        found = []
        for worker in self.workers:
            for line in worker.logs().splitlines():
                if '"execution completed"' in line and prefix in line:
                    entry = orjson.loads(line)
                    if str(entry.get("workflowId", "")).startswith(prefix):
                        found.append(entry["durationMs"] / 1000)
        return found or [math.inf]

    async def share(
        self, api: FlowcastServer, redis: Redis, holds: list[str], turnover: float
    ) -> None:
        """Both tenants kept backlogged: the executions each is given over the window."""
        config = self.config
        # Each line kept at several turnovers of every slot, so neither runs dry
        # between two looks of the feeder.
        level = 8 * self.slots
        lines = [
            Line(HEAVY, self.queued_key(HEAVY), level, holds),
            Line(LIGHT, self.queued_key(LIGHT), level, holds[:1]),
        ]
        feeder = Feeder(api.port, redis, lines)
        logged = self.logged()
        async with feeder.running():
            await feeder.until_taken(LIGHT, self.slots, timeout=60)  # in the rotation
            first = feeder.marks[-1]
            with self.cpu(api) as cpu:
                await asyncio.sleep(config.queue_share_seconds)
        marks = [mark for mark in feeder.marks if mark.at >= first.at]
        last = marks[-1]
        heavy, light = feeder.taken(HEAVY, first, last), feeder.taken(LIGHT, first, last)
        share = light / max(heavy, 1)
        window = last.at - first.at
        dry = sum(1 for mark in marks for line in lines if mark.depth[line.key] == 0)
        self.report.add(
            Row(
                f"queue: share of two backlogged tenants over {window:.0f} s (light ÷ heavy)",
                f"{share:.3f} ({light:,} vs {heavy:,} started)",
                "equal weights: 1",
                f"{share:.2f}x",
                "0.9 to 1.1",
                verdict(0.9 <= share <= 1.1 and not dry and not feeder.refused),
            )
        )
        parts = []
        step = window / 6
        edges = [nearest(marks, first.at + step * i) for i in range(7)]
        for a, b in itertools.pairwise(edges):
            parts.append(f"{feeder.taken(LIGHT, a, b)}/{feeder.taken(HEAVY, a, b)}")
        self.report.notes.append(
            f"queue, share: equal weights, 2 workers x {config.queue_slots} slots; the "
            f"heavy tenant's line over {len(holds)} workflows (the rest of its flood, then "
            f"kept at {level}), the light tenant's on one (`q-hold-00`, kept at {level}); "
            "executions taken from each line (its queued count, read in one MULTI every "
            f"0.2 s, with what was posted meanwhile) over {window:.1f} s: light "
            f"{light:,}, heavy {heavy:,}, share {share:.3f}; by sixths (light/heavy): "
            f"{', '.join(parts)}; looks that found a line empty: {dry}; refused posts: "
            f"{dict(feeder.refused) or 'none'}; a slot's turnover in the light case "
            f"{ms(turnover)}; {cpu.describe()}." + self.late_note([], logged)
        )


def nearest(marks: list[Mark], at: float) -> Mark:
    """The mark taken closest to ``at``."""
    return min(marks, key=lambda mark: abs(mark.at - at))


class Cpu:
    """CPU use of the API replica, the workers and Valkey over one window, and how long
    the workers' threads waited for a CPU while runnable (``/proc/<pid>/task/*/schedstat``:
    on a machine shared with other work, a slow slot turnover is told from a slow
    worker this way)."""

    def __init__(self, api: FlowcastServer, workers: list[FlowcastServer], valkey: int | None):
        self.api = Usage(descendants(api.pid), valkey)
        self.worker_pids = [pid for w in workers for pid in descendants(w.pid)]
        self.workers = Usage(self.worker_pids, None)
        self.waited = 0.0

    def __enter__(self) -> Cpu:
        self.api.begin()
        self.workers.begin()
        self.waited = -run_delay(self.worker_pids)
        return self

    def __exit__(self, *_: object) -> None:
        self.api.end()
        self.workers.end()
        self.waited += run_delay(self.worker_pids)

    def describe(self) -> str:
        wall = self.api.wall or 1.0
        return (
            f"CPU: API replica {self.api.server / wall:.0%} of a core, workers "
            f"{self.workers.server / wall:.0%}, Valkey {self.api.store / wall:.0%}, machine "
            f"busy {self.api.busy:.0%} of {os.cpu_count()} CPUs; the workers' threads "
            f"waited {self.waited / wall:.0%} of the window for a CPU (summed over threads)"
        )


def run_delay(pids: list[int]) -> float:
    """Seconds the threads of ``pids`` spent runnable, waiting for a CPU, so far."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9
