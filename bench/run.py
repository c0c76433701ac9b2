"""Flowcast's benchmark: one command, real processes, one table (SPEC section 11).

    .venv/bin/python -m bench.run [--quick] [--only METRIC[,METRIC]] [--profile]

Starts a Valkey server, moto's S3 server, two Flowcast processes under uvicorn on the
same Valkey (A runs the executions, B serves readers from Redis), and the plain
sse-starlette baseline (``bench/baseline_sse.py``) in its own uvicorn process; measures
each metric next to its baseline in the same run, prints the table and writes it with
the machine's description to ``bench/RESULTS.md``. Everything listens on 127.0.0.1 and
everything it starts is stopped when it ends. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench import traces
from bench.metrics import Bench
from bench.profile import profile
from bench.report import Report, Row, machine, render
from bench.stack import FULL, QUICK, Stack
from tests.support.servers import ROOT

METRICS = (
    "ttfe",
    "sl",
    "so",
    "throughput",
    "replay",
    "fanout",
    "memory",
    "recovery",
    "starts",
    "starts-cost",
    "streams",
    "queue",
    "floor",
    "traces",
)


async def main(args: argparse.Namespace) -> int:
    config = QUICK if args.quick else FULL
    if args.share_seconds is not None:
        config = replace(config, queue_share_seconds=args.share_seconds)
    chosen = set(METRICS) if not args.only else {m for o in args.only for m in o.split(",")}
    unknown = chosen - set(METRICS)
    if unknown:
        print(f"unknown metric(s): {', '.join(sorted(unknown))}; choose from {', '.join(METRICS)}")
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 8192), hard), hard))
    mode = "quick run" if args.quick else "full run"
    if args.only:
        mode += f" (only {', '.join(m for m in METRICS if m in chosen)})"
    host = machine()
    print("\n".join(host), flush=True)
    report = Report()
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="flowcast-bench-"))
    try:
        async with asyncio.timeout(args.timeout), Stack(root, config).running() as stack:
            bench = Bench(stack, config, report)
            try:
                await bench.setup()
                xadd_rps = await bench.xadd() if "throughput" in chosen else None
                steps: dict[str, Callable[[], Awaitable[None]]] = {
                    "ttfe": bench.ttfe,
                    "sl": bench.sl,
                    "so": bench.so,
                    "throughput": lambda: bench.throughput(xadd_rps),
                    "replay": bench.replay,
                    "fanout": bench.fanout,
                    "memory": bench.memory,
                    "recovery": bench.recovery,
                    "starts": bench.starts,
                    "starts-cost": bench.starts_cost,
                    "streams": bench.streams,
                    "queue": bench.queue,
                    "floor": bench.floor,
                    "traces": lambda: traces.measure(
                        root,
                        stack.flowcast_env(),
                        report,
                        count=50 if args.quick else 200,
                        rounds=3 if args.quick else 5,
                    ),
                }
                for name in METRICS:
                    if name not in chosen:
                        continue
                    print(f"{name} …", flush=True)
                    try:
                        await steps[name]()
                    except Exception as exc:  # one broken metric must not hide the others
                        report.add(Row(name, f"error: {type(exc).__name__}: {exc}"[:200]))
                if args.profile:
                    print("profiling …", flush=True)
                    await profile(bench, report, root)
            finally:
                await bench.close()
    except TimeoutError:
        report.notes.append(f"the run hit its {args.timeout:.0f} s limit and was stopped.")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = render(report, mode=mode, host=host, seconds=time.perf_counter() - began)
    print()
    print(text)
    Path(args.output).write_text(text)
    print(f"written to {args.output}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (about 3 minutes)")
    parser.add_argument(
        "--only",
        action="append",
        metavar="METRIC",
        help=f"one of {', '.join(METRICS)} (repeatable)",
    )
    parser.add_argument("--profile", action="store_true", help="add py-spy hot spots of server A")
    parser.add_argument(
        "--share-seconds",
        type=float,
        metavar="S",
        help="the queue's share window (default 60 s, 15 s with --quick)",
    )
    parser.add_argument("--output", default=str(ROOT / "bench" / "RESULTS.md"))
    parser.add_argument("--timeout", type=float, default=1500, help="stop everything after this")
    return parser.parse_args(argv)


def run() -> None:
    args = parse_args()
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main(args)))
    sys.exit(uvloop.run(main(args)))


if __name__ == "__main__":
    run()
