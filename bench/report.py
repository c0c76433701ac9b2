"""The table, its numbers and the results file."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from app.embedded import valkey_binary


@dataclass
class Row:
    metric: str
    flowcast: str
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    result: str = "—"


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hot_spots: list[str] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(
            f"  {row.metric}: {row.flowcast} | baseline {row.baseline} | {row.result}", flush=True
        )


# --- numbers -----------------------------------------------------------------------


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f} ms" if abs(value) < 10 else f"{value:.1f} ms"


def rate(value: float) -> str:
    return f"{value:,.0f} ev/s"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "—"


def verdict(ok: bool) -> str:
    return "pass" if ok else "**miss**"


# --- the machine and the results file ------------------------------------------------


def machine() -> list[str]:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 1024 / 1024:.1f} GiB RAM"
    valkey = subprocess.run(
        [valkey_binary(), "--version"], capture_output=True, text=True, check=False
    ).stdout.split(" sha=")[0]
    packages = []
    for name in ("uvicorn", "uvloop", "starlette", "sse-starlette", "redis", "moto"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            packages.append(f"{name} {version(name)}")
    return [
        f"- {platform.node()}: {platform.system()} {platform.release()} {platform.machine()}, "
        f"{cpu}, {os.cpu_count()} CPUs{memory}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- Python {platform.python_version()}; {valkey} (AOF on, everysec); "
        + ", ".join(packages),
    ]


def render(report: Report, *, mode: str, host: list[str], seconds: float) -> str:
    header = "| metric | Flowcast | baseline | ratio | target | result |"
    lines = [
        "# Flowcast benchmark results",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {mode}, {seconds:.0f} s, with "
        "`python -m bench.run` (see bench/README.md for what each row means).",
        "",
        *host,
        "",
        header,
        "|---|---|---|---|---|---|",
    ]
    for row in report.rows:
        cells = (row.metric, row.flowcast, row.baseline, row.ratio, row.target, row.result)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Baselines: latency and throughput rows compare with the plain sse-starlette "
        "endpoint in bench/baseline_sse.py (no buffer, same frames, its own uvicorn "
        "process); the store row compares with redis-benchmark's XADD rate on the same "
        "Valkey; the starts-cost rows with the bare FastAPI POST of bench/baseline_api.py "
        "(its own uvicorn process, no Redis). Ratios are Flowcast ÷ baseline."
        + (
            " The `floor` rows name what they divide: the relays of bench/relay_sse.py "
            "(the same frames made in another process and delivered through Valkey) and "
            "the plain endpoint after one Redis round trip are baselines there too."
            if any(row.metric.startswith("floor:") for row in report.rows)
            else ""
        ),
        "",
    ]
    if report.notes:
        lines += ["## Notes", "", *[f"- {note}" for note in report.notes], ""]
    if report.hot_spots:
        lines += ["## Hot spots (py-spy, after the measured runs)", "", *report.hot_spots]
    return "\n".join(lines) + "\n"
