"""The ``traces`` rows: what OpenTelemetry tracing costs (SPEC §15, docs/traces.md).

Three Flowcast processes on the stack's Valkey and value store, started alike but for
tracing: **without** (``bench/hookless.py``: the hooks of ``lib/tracing.py`` replaced by
bare no-ops, the build as it was before traces), **off** (no OpenTelemetry variable:
nothing of the tracing SDK is imported, each hook is one test of a module global) and
**on** (exporting over OTLP/HTTP to a receiver on 127.0.0.1 that decodes every request,
``tests/support/otlp.py``). Rounds alternate between them, so a noisy neighbour hits
all three. Per execution of a one
``transform`` workflow: TTFE (POST execute → first SSE event) and the server's CPU
(accepted to ``execution:completed``, its spans batched and sent).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.report import Report, Row
from tests.support.otlp import otlp_receiver, traced_env
from tests.support.servers import FlowcastServer


class Hookless(FlowcastServer):
    """A Flowcast server whose tracing hooks are taken out (bench/hookless.py)."""

    def command(self) -> list[str]:
        python, _m, _uvicorn, *arguments = super().command()
        return [python, "-m", "bench.hookless", *arguments]


WORKFLOW: dict[str, Any] = {
    "id": "traced",
    "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
    "edges": [],
}


async def _first_event(client: httpx.AsyncClient) -> tuple[float, str]:
    began = time.perf_counter()
    answer = await client.post("/api/workflows/traced/execute", json={"input": {}})
    answer.raise_for_status()
    started = answer.json()
    async with client.stream("GET", started["streamUrl"]) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - began, started["executionId"]
    raise RuntimeError("the stream ended before its first event")


async def _round(server: FlowcastServer, count: int) -> tuple[list[float], float]:
    """``count`` executions one after another: their TTFEs, and the server's CPU
    seconds per execution until the last one completed."""
    process = psutil.Process(server.pid)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        cpu = process.cpu_times()
        before = cpu.user + cpu.system
        ttfe = []
        last = ""
        for _ in range(count):
            took, last = await _first_event(client)
            ttfe.append(took)
        while (await client.get(f"/api/executions/{last}")).json()["status"] != "completed":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the batch processor's export (OTEL_BSP_SCHEDULE_DELAY)
        cpu = process.cpu_times()
    return ttfe, (cpu.user + cpu.system - before) / count


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def measure(
    root: Path, env: dict[str, str], report: Report, *, count: int, rounds: int
) -> None:
    with otlp_receiver() as receiver:
        servers = {
            "without": Hookless(data_dir=root / "traces-without", env=env),
            "off": FlowcastServer(data_dir=root / "traces-off", env=env),
            "on": FlowcastServer(
                data_dir=root / "traces-on",
                env={**env, **traced_env(receiver), "OTEL_BSP_SCHEDULE_DELAY": "100"},
            ),
        }
        await asyncio.gather(*(server.start() for server in servers.values()))
        try:
            for server in servers.values():
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                    (await client.put("/api/workflows/traced", json=WORKFLOW)).raise_for_status()
                await _round(server, 20)  # warm-up
            ttfe: dict[str, list[float]] = {name: [] for name in servers}
            cpu: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(rounds):
                for name, server in servers.items():
                    took, seconds = await _round(server, count)
                    ttfe[name] += took
                    cpu[name].append(seconds)
        finally:
            await asyncio.gather(*(server.stop() for server in servers.values()))
        spans = len(receiver.spans)
    p50 = {name: _p(values, 50) * 1000 for name, values in ttfe.items()}
    p99 = {name: _p(values, 99) * 1000 for name, values in ttfe.items()}
    per = {name: statistics.median(values) * 1000 for name, values in cpu.items()}
    for name, base in (("off", "without"), ("on", "off")):
        report.add(
            Row(
                f"traces: TTFE p50/p99, {name} vs {base}",
                f"{p50[name]:.1f} / {p99[name]:.1f} ms",
                f"{p50[base]:.1f} / {p99[base]:.1f} ms",
                f"{p50[name] / p50[base]:.2f} / {p99[name] / p99[base]:.2f}",
            )
        )
        report.add(
            Row(
                f"traces: server CPU per execution, {name} vs {base}",
                f"{per[name]:.2f} ms",
                f"{per[base]:.2f} ms",
                f"{per[name] / per[base]:.2f}",
            )
        )
    report.notes.append(
        f"traces: {rounds} alternating rounds of {count} executions (one transform block, "
        "one after another) per server; TTFE is POST execute → first SSE event; CPU is the "
        f"server process's utime+stime ÷ executions (median of the rounds). 'on' exported "
        f"{spans} spans to a receiver on 127.0.0.1; 'off' imports none of the tracing SDK "
        "(tests/e2e/traces/test_traces_off.py); 'without' has the hooks taken out "
        "(bench/hookless.py)."
    )
