"""The ``traces`` rows: what OpenTelemetry tracing costs (SPEC §15, docs/traces.md).

Two Flowcast processes on the stack's Valkey and value store, started alike except for
the OpenTelemetry variables: **off** (none set: nothing of the tracing SDK is imported,
each hook is one test of a module global) and **on** (exporting over OTLP/HTTP to a
receiver on 127.0.0.1 that decodes every request, ``tests/support/otlp.py``). Rounds
alternate between them, so a noisy neighbour hits both. Per execution of a one
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
    off_p50, on_p50 = _p(ttfe["off"], 50) * 1000, _p(ttfe["on"], 50) * 1000
    off_p99, on_p99 = _p(ttfe["off"], 99) * 1000, _p(ttfe["on"], 99) * 1000
    off_cpu, on_cpu = statistics.median(cpu["off"]) * 1000, statistics.median(cpu["on"]) * 1000
    report.add(
        Row(
            "traces: TTFE p50/p99, on vs off",
            f"{on_p50:.1f} / {on_p99:.1f} ms",
            f"{off_p50:.1f} / {off_p99:.1f} ms",
            f"{on_p50 / off_p50:.2f} / {on_p99 / off_p99:.2f}",
        )
    )
    report.add(
        Row(
            "traces: server CPU per execution, on vs off",
            f"{on_cpu:.2f} ms",
            f"{off_cpu:.2f} ms",
            f"{on_cpu / off_cpu:.2f}",
        )
    )
    report.notes.append(
        f"traces: {rounds} alternating rounds of {count} executions per server; 'on' exported "
        f"{spans} spans to a receiver on 127.0.0.1. 'off' imports none of the tracing SDK "
        "(tests/e2e/traces/test_traces_off.py), so it is the build without instrumentation "
        "but for one module-global test per hook."
    )
