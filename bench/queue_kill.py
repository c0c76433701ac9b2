"""The queue metric's kill case (SPEC sections 11 and 14): a worker SIGKILLed with 16
running gives them back within about a lease.

An API replica that runs no work and two workers with 16 slots each, on their own Redis
prefix with a short lease (``recovery_lease_seconds``). 16 chains of ``delay`` blocks
are started on one worker (a worker with free slots runs what it accepts at once) and
watched by one SSE client each on the API replica; once every one runs its second
block, that worker is SIGKILLed: kill → ``execution:recovered`` for each, then each
one's terminal events. Kills after the first swap the two workers' roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.clients import http_request, open_stream
from bench.recovery import RECOVERED, TERMINAL, EventLog, Seen
from bench.report import Report, Row, percentile, ratio, verdict
from bench.stack import SSE, Config
from tests.support.servers import FlowcastServer, bearer

GOING = frozenset({"block:started"})
COMPLETED = "execution:completed"


def chain(blocks: int, block_ms: int) -> dict[str, Any]:
    """The runs: a chain of ``delay`` blocks (one always in flight)."""
    return {
        "id": "q-chain",
        "blocks": [
            {"id": f"d{index:02d}", "type": "delay", "config": {"ms": block_ms}}
            for index in range(blocks)
        ],
        "edges": [
            {"from": f"d{index - 1:02d}", "to": f"d{index:02d}"} for index in range(1, blocks)
        ],
    }


@dataclass
class KillRun:
    """One kill: what each run's client saw after it."""

    count: int
    killed: float = 0.0  # perf_counter
    first: list[Seen | None] = field(default_factory=list)  # recovered, or an ending
    last: list[Seen | None] = field(default_factory=list)  # the terminal event
    terminals: list[int] = field(default_factory=list)  # terminal events in each log
    recoveries: list[int] = field(default_factory=list)  # execution:recovered in each

    def recovered(self) -> list[float]:
        """Seconds from the kill to each ``execution:recovered`` seen."""
        return [seen.at - self.killed for seen in self.first if seen and seen.type == RECOVERED]

    def note(self) -> str:
        times = sorted(self.recovered())
        spread = f"{times[0]:.2f} s to {times[-1]:.2f} s" if times else "none"
        reasons = Counter(
            str(seen.data.get("reason")) for seen in self.first if seen and seen.type == RECOVERED
        )
        others = [seen.describe() if seen else "nothing" for seen in self.first
                  if seen is None or seen.type != RECOVERED]  # fmt: skip
        ends = [seen.at - self.killed for seen in self.last if seen is not None]
        last = f"{max(ends):.2f} s after the kill" if ends else "never"
        instead = f"; instead: {', '.join(others)}" if others else ""
        return (
            f"{len(times)} of {self.count} recovered, {spread} after the kill (reasons "
            f"{describe(reasons)}){instead}; terminal events in each log: "
            f"{per_log(self.terminals)}, execution:recovered in each log: "
            f"{per_log(self.recoveries)}; the last terminal event {last}."
        )


class QueueKill:
    """The kill case's processes and runs; ``started`` also serves other cases that need
    an API replica and one idle worker."""

    def __init__(
        self,
        *,
        config: Config,
        report: Report,
        http: httpx.AsyncClient,
        server: Callable[[str, int], FlowcastServer],
        keys: tuple[str, str],
    ) -> None:
        self.config = config
        self.report = report
        self.http = http
        self.keys = keys
        self.api = server("kill-api", 0)
        self.pair = (server("kill-w1", config.queue_slots), server("kill-w2", config.queue_slots))

    @contextlib.asynccontextmanager
    async def started(self) -> AsyncIterator[QueueKill]:
        """The API replica and the first worker (the second starts with the first kill),
        with the chain registered for both tenants; everything SIGKILLed at the end."""
        try:
            await asyncio.gather(self.api.start(), self.pair[0].start())
            workflow = chain(self.config.queue_chain_blocks, self.config.recovery_block_ms)
            for key in self.keys:
                response = await self.http.put(
                    f"{self.api.url}/api/workflows/q-chain", json=workflow, headers=bearer(key)
                )
                response.raise_for_status()
            yield self
        finally:
            await asyncio.gather(
                *(p.stop(signal.SIGKILL, timeout=10) for p in (self.api, *self.pair)),
                return_exceptions=True,
            )

    async def run(self) -> None:
        runs: list[KillRun] = []
        for index in range(self.config.queue_kill_runs):
            victim, rescuer = self.pair[index % 2], self.pair[(index + 1) % 2]
            runs.append(await self.once(victim, rescuer))
        self.add_rows(runs)

    async def once(self, victim: FlowcastServer, rescuer: FlowcastServer) -> KillRun:
        """Start the runs on ``victim`` (a worker with free slots runs a start it accepts
        at once), SIGKILL it once every one runs its second block; ``rescuer`` is up
        all along. Every run is watched through the API replica."""
        config, api = self.config, self.api
        count = config.queue_kill_running
        lease = config.recovery_lease_seconds
        await asyncio.gather(*(p.start() for p in (victim, rescuer) if p._process is None))
        keys = [self.keys[i % 2] for i in range(count)]  # alternating the tenants
        ids = []
        for key in keys:
            response = await self.http.post(
                f"{victim.url}/api/workflows/q-chain/execute",
                json={"input": {}},
                headers=bearer(key),
            )
            response.raise_for_status()
            if response.json()["status"] != "running":
                raise RuntimeError(f"a start on the worker was {response.json()['status']}")
            ids.append(response.json()["executionId"])
        logs = [EventLog() for _ in ids]
        clients = []
        run = KillRun(count=count)
        try:
            for eid, key, log in zip(ids, keys, logs, strict=True):
                request = http_request(
                    "GET",
                    f"/api/executions/{eid}/stream",
                    port=api.port,
                    headers={**SSE, **bearer(key), "Last-Event-ID": "0"},
                )
                client = await open_stream(api.port, request, log)
                client.done.add_done_callback(closer(log))
                clients.append(client)
            going = await asyncio.gather(*(log.nth(GOING, 2, timeout=30) for log in logs))
            if any(seen is None for seen in going):
                raise RuntimeError("the runs did not all get going on the worker")
            run.killed = time.perf_counter()
            await victim.stop(signal.SIGKILL, timeout=10)
            waited = lease + config.recovery_grace_seconds + 20
            either = frozenset({RECOVERED, *TERMINAL})
            firsts = await asyncio.gather(*(log.nth(either, timeout=waited) for log in logs))
            run.first = list(firsts)
            ends = config.queue_chain_blocks * config.recovery_block_ms / 1000 + lease + 30
            lasts = await asyncio.gather(*(log.nth(TERMINAL, timeout=ends) for log in logs))
            run.last = list(lasts)
        finally:
            for client in clients:
                client.close()
        for eid, key in zip(ids, keys, strict=True):
            response = await self.http.get(
                f"{api.url}/api/executions/{eid}/events", headers=bearer(key)
            )
            types = [event["type"] for event in response.json()["events"]]
            run.terminals.append(sum(kind in TERMINAL for kind in types))
            run.recoveries.append(types.count(RECOVERED))
        return run

    def add_rows(self, runs: list[KillRun]) -> None:
        config = self.config
        lease = config.recovery_lease_seconds
        count = config.queue_kill_running
        times = [t for run in runs for t in run.recovered()]
        missed = sum(run.count - len(run.recovered()) for run in runs)
        label = f"{len(runs)} kills x {count}" if len(runs) > 1 else f"{count} runs"
        self.report.add(
            Row(
                f"queue: a worker SIGKILLed with {count} running: kill → "
                f"execution:recovered, p50 (max) over {label}",
                (f"{percentile(times, 50):.2f} s ({max(times):.2f} s)" if times else "none")
                + (f"; {missed} not recovered" if missed else ""),
                f"lease {lease:g} s",
                ratio(percentile(times, 50), lease) if times else "—",
                f"≤ lease + 2 s ({lease + 2:g} s)",
                verdict(not missed and bool(times) and max(times) <= lease + 2),
            )
        )
        ends = Counter(
            seen.describe() if seen else "no terminal event" for run in runs for seen in run.last
        )
        once = sum(run.terminals.count(1) for run in runs)
        total = sum(run.count for run in runs)
        self.report.add(
            Row(
                f"queue: the same runs: exactly one terminal event each ({label})",
                f"{once} of {total}; {describe(ends)}",
                "—",
                "—",
                f"{total} of {total}, {COMPLETED}",
                verdict(once == total and set(ends) == {COMPLETED}),
            )
        )
        for index, run in enumerate(runs):
            self.report.notes.append(f"queue, kill {index + 1}: {run.note()}")
        self.report.notes.append(
            f"queue, kill: an API replica (FLOWCAST_WORKER_SLOTS=0) and two workers with "
            f"{config.queue_slots} slots each, FLOWCAST_LEASE_SECONDS={lease:g}; {count} "
            f"chains of {config.queue_chain_blocks} `delay` blocks of "
            f"{config.recovery_block_ms} ms started on the first worker (which runs what it "
            "accepts at once while it has free slots; alternating the two tenants), each "
            "watched by an SSE client on the API replica; once every one had started its "
            "second block, that worker was SIGKILLed; times are from the kill to each "
            "client's `execution:recovered`. Kills after the first swap the two workers' "
            "roles (the killed one started again)."
        )


def closer(log: EventLog) -> Callable[[object], None]:
    """A done-callback that ends ``log`` when its stream ends."""
    return lambda _: log.close()


def describe(counts: Counter[str]) -> str:
    return ", ".join(f"{count} {what}" for what, count in counts.most_common()) or "none"


def per_log(counts: list[int]) -> str:
    """``1 in all 16`` or ``1 in 15, 2 in 1``."""
    found = Counter(counts)
    if len(found) == 1:
        return f"{counts[0]} in all {len(counts)}"
    return ", ".join(f"{n} in {logs}" for n, logs in sorted(found.items()))
