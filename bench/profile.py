"""py-spy on a server while a workload repeats; the top functions of its samples."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.metrics import Bench
from bench.report import Report
from bench.stack import words
from tests.support.servers import ROOT

# --- profiling ---------------------------------------------------------------------


def py_spy() -> str | None:
    candidate = Path(sys.executable).with_name("py-spy")
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


@contextlib.asynccontextmanager
async def sampled(pid: int, output: Path) -> AsyncIterator[None]:
    """Sample a process with py-spy (collapsed stacks) while the block runs."""
    binary = py_spy()
    assert binary is not None
    command = [
        binary, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
        "--output", str(output), "--nonblocking",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    await asyncio.sleep(1.0)  # py-spy has no readiness signal; a late start only loses samples
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        await asyncio.to_thread(process.wait, 30)
        if process.stderr is not None:
            process.stderr.close()


_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def summarize(profile: Path, top: int = 12) -> list[str]:
    """Top functions by own samples and by inclusive samples, from collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        names = [_short(frame) for frame in stack.split(";")]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    # uvloop's C loop waiting in epoll shows up as Runner.run's own time: idle, not work.
    idle = own.pop(_IDLE, 0)
    busy = total - idle
    if not busy:
        return ["(no samples)"]
    lines = [f"{busy} busy samples ({idle} more in the loop's poll); own time, share of busy:"]
    lines += [f"  {n / busy:6.1%}  {name}" for name, n in own.most_common(top)]
    lines.append("inclusive, Flowcast and library frames only:")
    shown = [(name, n) for name, n in inclusive.most_common() if _interesting(name)][:top]
    lines += [f"  {n / busy:6.1%}  {name}" for name, n in shown]
    return lines


_IDLE = "Runner.run (asyncio/runners.py)"
_PACKAGES = ("(lib/", "(app/", "(sse_starlette/", "(starlette/", "(fastapi/", "(redis/")


def _interesting(name: str) -> bool:
    return any(package in name for package in _PACKAGES)


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "python3.11/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['name']} ({path})"


async def profile(bench: Bench, report: Report, root: Path) -> None:
    """Repeat the heavy metrics with py-spy on server A and keep the hot spots."""
    if py_spy() is None:
        report.notes.append("py-spy is not installed (`.venv/bin/pip install py-spy`): no profile.")
        return
    pid = bench.stack.a.pid
    count = bench.config.burst_events
    runs: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        (
            f"throughput burst ({count:,} chunks to one client)",
            lambda: bench.stream(
                bench.stack.a.port,
                "POST",
                "/api/workflows/bench-burst/execute",
                json={"input": {"text": words(count)}},
                timeout=300,
            ),
        ),
        (
            f"fan-out ({bench.config.fanout_clients:,} clients)",
            lambda: _fan_once(bench),
        ),
        ("TTFE (100 streamed executes)", lambda: _ttfe_loop(bench, 100)),
    ]
    for name, run in runs:
        output = root / f"profile-{len(report.hot_spots)}.txt"
        async with sampled(pid, output):
            await run()
        report.hot_spots.append(f"### Server A during {name}\n")
        report.hot_spots.append("```\n" + "\n".join(summarize(output)) + "\n```\n")
    execution_id = await bench.start("bench-burst", {"text": words(10_000 - 4)})
    await bench.wait_status(execution_id, {"completed", "failed"}, timeout=120)
    output = root / "profile-replay.txt"
    async with sampled(bench.stack.b.pid, output):
        for _ in range(10):
            await bench.stream(
                bench.stack.b.port,
                "GET",
                f"/api/executions/{execution_id}/stream",
                headers={"Last-Event-ID": "0"},
            )
    report.hot_spots.append("### Server B during replay (10 replays of 10,000 events)\n")
    report.hot_spots.append("```\n" + "\n".join(summarize(output)) + "\n```\n")


async def _fan_once(bench: Bench) -> None:
    count = bench.config.fanout_events
    execution_id = await bench.start("bench-fanout", {"text": words(count)})
    await bench.wait_status(execution_id, {"paused"}, timeout=30)
    await bench.fan(
        bench.stack.a.port,
        f"/api/executions/{execution_id}/stream",
        "execution:paused",
        bench.resume(execution_id),
        timeout=count / bench.config.fanout_rate + 120,
    )


async def _ttfe_loop(bench: Bench, runs: int) -> None:
    for _ in range(runs):
        await bench.stream(
            bench.stack.a.port, "POST", "/api/workflows/bench-ttfe/execute", json={"input": {}}
        )
