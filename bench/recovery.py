"""The recovery metric (SPEC sections 7 and 11): the owner of a running execution stops.

Two replicas of its own on the stack's Valkey, with a short ``FLOWCAST_LEASE_SECONDS``
(so a lease passes quickly), a shared secret and their own Redis prefix. Each run
starts a chain of ``delay`` blocks on A, which owns what it starts, attaches one SSE
client through B and, once that client has seen a few blocks complete, signals A:

- SIGKILL: kill → ``execution:recovered`` (about a lease) and kill → the terminal event;
- SIGTERM: signal → ``execution:recovered`` with ``reason: handoff``.

A is started again after each. Every wait is bounded: an execution that ends instead
of being taken over (``execution:failed`` with ``worker_lost`` or ``shutdown``) is a
miss that says what it got, not an error.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.clients import frame_data, frame_event, http_request, open_stream
from bench.report import Report, Row, percentile, ratio, verdict
from bench.stack import SSE, Config, Stack, workflows
from tests.support.servers import FlowcastServer

RECOVERED = "execution:recovered"
COMPLETED = "execution:completed"
TERMINAL = frozenset({COMPLETED, "execution:failed", "execution:cancelled"})
RECOVERED_OR_TERMINAL = frozenset({RECOVERED, *TERMINAL})


@dataclass(frozen=True)
class Seen:
    """One event as the client got it: its type, its ``data`` and when (perf_counter)."""

    type: str
    data: dict[str, Any]
    at: float

    def describe(self) -> str:
        """The type, with the error code or reason of an ending."""
        error = self.data.get("error")
        detail = error.get("code") if isinstance(error, dict) else self.data.get("reason")
        return f"{self.type} {detail}" if detail else self.type


class EventLog:
    """An SSE client's events as they arrive, and bounded waits for some of them."""

    def __init__(self) -> None:
        self.events: list[Seen] = []
        self.closed = False
        self._changed = asyncio.Event()

    def __call__(self, frames: list[bytes], received_at: float) -> None:
        at = time.perf_counter()
        for frame in frames:
            kind = frame_event(frame)
            if kind is None:
                continue  # a heartbeat
            envelope = frame_data(frame)
            data = envelope.get("data") if isinstance(envelope, dict) else None
            self.events.append(Seen(kind, data if isinstance(data, dict) else {}, at))
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def nth(self, types: frozenset[str], n: int = 1, *, timeout: float) -> Seen | None:
        """The ``n``-th event of one of ``types``; None if the stream ends or time runs out."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    matches = [seen for seen in self.events if seen.type in types]
                    if len(matches) >= n:
                        return matches[n - 1]
                    if self.closed:
                        return None
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return None


@dataclass
class Outcome:
    """One run: what the client on the other replica saw after the signal."""

    signal: str
    waited: float  # how long the run waited for execution:recovered
    first: Seen | None = None  # execution:recovered or the terminal event, if any came
    last: Seen | None = None  # the terminal event
    signalled: float = 0.0
    exited: float | None = None  # when the signalled process had exited
    rerun: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    again: list[str] = field(default_factory=list)  # kept, yet started after the recovery
    attempts: list[Any] = field(default_factory=list)  # the rerun blocks' next attempts

    @property
    def recovered(self) -> float | None:
        """Seconds from the signal to execution:recovered."""
        if self.first is None or self.first.type != RECOVERED:
            return None
        return self.first.at - self.signalled

    @property
    def terminal(self) -> float | None:
        return None if self.last is None else self.last.at - self.signalled

    def failure(self, reason: str | None = None) -> str | None:
        """Why this run is not a recovery (with ``reason``, if one is required)."""
        if self.first is None:
            return f"not recovered: no execution:recovered nor ending within {self.waited:.0f} s"
        if self.first.at < self.signalled:
            return f"not recovered: got {self.first.describe()} before the signal"
        if self.first.type != RECOVERED:
            return f"not recovered: got {self.first.describe()}"
        if reason is not None and self.first.data.get("reason") != reason:
            return f"recovered with reason {self.first.data.get('reason')!r}, not {reason!r}"
        return None

    def note(self) -> str:
        parts = [f"{self.signal}:"]
        if self.recovered is not None and self.first is not None:
            parts.append(
                f"execution:recovered after {self.recovered:.2f} s "
                f"(reason {self.first.data.get('reason')}, recovery "
                f"{self.first.data.get('recovery')}, {len(self.kept)} blocks kept, "
                f"rerun {self.rerun} with attempts {self.attempts});"
            )
            if self.again:
                parts.append(f"blocks kept from the checkpoint ran again: {self.again};")
        else:
            parts.append(f"{self.failure()};")
        if self.last is not None and self.terminal is not None:
            parts.append(f"{self.last.describe()} after {self.terminal:.2f} s;")
        else:
            parts.append("no terminal event seen;")
        if self.exited is None:
            parts.append("the process overstayed its stop timeout and was killed.")
        else:
            parts.append(f"the process had exited {self.exited - self.signalled:.2f} s after.")
        return " ".join(parts)


class Recovery:
    """Runs the SIGKILL and SIGTERM cases on two replicas of its own; adds the rows."""

    def __init__(
        self, stack: Stack, config: Config, report: Report, http: httpx.AsyncClient
    ) -> None:
        self.config = config
        self.report = report
        self.http = http
        env = stack.flowcast_env(
            FLOWCAST_REDIS_PREFIX="fcrec",
            FLOWCAST_LEASE_SECONDS=str(config.recovery_lease_seconds),
            FLOWCAST_SHUTDOWN_GRACE_SECONDS=str(config.recovery_grace_seconds),
            FLOWCAST_SECRET_KEY=secrets.token_urlsafe(32),  # replicas must share it
        )
        self.a = FlowcastServer(data_dir=stack.root / "recovery-a", env=env)
        self.b = FlowcastServer(data_dir=stack.root / "recovery-b", env=env)

    async def run(self) -> None:
        config = self.config
        kills: list[Outcome] = []
        terms: list[Outcome] = []
        self.report.notes.append(
            f"recovery: two replicas with FLOWCAST_LEASE_SECONDS="
            f"{config.recovery_lease_seconds:g} and FLOWCAST_SHUTDOWN_GRACE_SECONDS="
            f"{config.recovery_grace_seconds:g}; a chain of {config.recovery_blocks} `delay` "
            f"blocks of {config.recovery_block_ms} ms started on A, one SSE client through B, "
            f"A signalled once block {config.recovery_signal_at} has started (its "
            "block:started seen by the client: that block is in flight); "
            f"{config.recovery_runs} run(s) of each, A started again after each."
        )
        try:
            await asyncio.gather(self.a.start(), self.b.start())
            workflow = next(w for w in workflows(config) if w["id"] == "bench-recovery")
            response = await self.http.put(
                f"{self.a.url}/api/workflows/bench-recovery", json=workflow
            )
            response.raise_for_status()
            for _ in range(config.recovery_runs):
                kills.append(await self.once(signal.SIGKILL))
                await self.a.start()
                terms.append(await self.once(signal.SIGTERM))
                await self.a.start()
        finally:
            await asyncio.gather(self.a.stop(), self.b.stop(), return_exceptions=True)
        self.add_rows(kills, terms)

    async def once(self, sig: signal.Signals) -> Outcome:
        """Start on A, watch through B, signal A once some blocks completed."""
        config = self.config
        lease, grace = config.recovery_lease_seconds, config.recovery_grace_seconds
        response = await self.http.post(
            f"{self.a.url}/api/workflows/bench-recovery/execute", json={"input": {}}
        )
        response.raise_for_status()
        execution_id: str = response.json()["executionId"]
        log = EventLog()
        request = http_request(
            "GET",
            f"/api/executions/{execution_id}/stream",
            port=self.b.port,
            headers={**SSE, "Last-Event-ID": "0"},
        )
        client = await open_stream(self.b.port, request, log)
        client.done.add_done_callback(lambda _: log.close())
        outcome = Outcome(signal=sig.name, waited=lease + grace + 20)
        try:
            going = await log.nth(
                frozenset({"block:started"}), config.recovery_signal_at, timeout=30
            )
            if going is None:
                seen = [seen.describe() for seen in log.events[-3:]]
                raise RuntimeError(f"the execution did not get going (last events: {seen})")
            async with asyncio.TaskGroup() as group:
                stopping = group.create_task(self.stop(self.a, sig, timeout=grace + 15))
                outcome.first = await log.nth(RECOVERED_OR_TERMINAL, timeout=outcome.waited)
                if outcome.first is not None and outcome.first.type in TERMINAL:
                    outcome.last = outcome.first
                elif outcome.first is not None:
                    run_seconds = config.recovery_blocks * config.recovery_block_ms / 1000
                    outcome.last = await log.nth(TERMINAL, timeout=run_seconds + lease + 30)
            outcome.signalled, outcome.exited = stopping.result()
        finally:
            client.close()
        if outcome.first is not None and outcome.first.type == RECOVERED:
            outcome.rerun = list(outcome.first.data.get("rerun") or [])
            outcome.kept = list(outcome.first.data.get("completed") or [])
            started = {
                seen.data.get("blockId"): seen.data.get("attempt")
                for seen in log.events
                if seen.type == "block:started" and seen.at >= outcome.first.at
            }
            outcome.again = [block for block in outcome.kept if block in started]
            outcome.attempts = [started.get(block) for block in outcome.rerun]
        self.report.notes.append(f"recovery: {outcome.note()}")
        return outcome

    @staticmethod
    async def stop(
        server: FlowcastServer, sig: signal.Signals, *, timeout: float
    ) -> tuple[float, float | None]:
        """Signal the server and wait for it to exit: (signalled, exited), perf_counter.

        ``exited`` is None when it overstayed ``timeout`` and had to be killed.
        """
        pid = server.pid
        signalled = time.perf_counter()
        try:
            await server.stop(sig, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            return signalled, None
        return signalled, time.perf_counter()

    def add_rows(self, kills: list[Outcome], terms: list[Outcome]) -> None:
        config = self.config
        lease = config.recovery_lease_seconds
        runs = f" ({len(kills)} runs, p50 (max))" if len(kills) > 1 else ""
        failed = next((f for f in (o.failure() for o in kills) if f), None)
        times = [o.recovered for o in kills if o.recovered is not None]
        self.report.add(
            Row(
                f"recovery after SIGKILL: kill → execution:recovered{runs}",
                failed or seconds(times),
                f"lease {lease:g} s",
                ratio(percentile(times, 50), lease) if not failed else "—",
                f"≈ lease (≤ {lease + 2:g} s)",
                verdict(not failed and max(times) <= lease + 2),
            )
        )
        ends = [o.terminal for o in kills if o.terminal is not None]
        kinds = sorted({o.last.describe() for o in kills if o.last is not None})
        completed = len(ends) == len(kills) and kinds == [COMPLETED]
        self.report.add(
            Row(
                f"recovery after SIGKILL: kill → terminal{runs}",
                f"{seconds(ends)}, {' / '.join(kinds)}" if ends else "no terminal event",
                "—",
                "—",
                COMPLETED,
                verdict(completed),
            )
        )
        failed = next((f for f in (o.failure("handoff") for o in terms) if f), None)
        times = [o.recovered for o in terms if o.recovered is not None]
        self.report.add(
            Row(
                f"SIGTERM hand-off: signal → execution:recovered{runs}",
                failed or seconds(times),
                "—",
                "—",
                "≤ 2 s",
                verdict(not failed and max(times) <= 2),
            )
        )


def seconds(values: list[float]) -> str:
    """One value, or the median and the worst of several."""
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    return f"{percentile(values, 50):.2f} s ({max(values):.2f} s)"
