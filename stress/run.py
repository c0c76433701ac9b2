"""``python -m stress.run [--long] [--only NAME] [--seed N] [--keep]``:
run the scenarios one after another, print one line per scenario, exit 1 if any
invariant broke."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from stress.harness import Report
from stress.scenarios import SCENARIOS, SEED


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stress.run", description=__doc__)
    parser.add_argument("--long", action="store_true", help="scale every scenario by 5-10x")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only this scenario",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the random plan")
    parser.add_argument(
        "--keep", action="store_true", help="keep the data directories (always kept on findings)"
    )
    return parser.parse_args(argv)


async def run(names: list[str], *, long: bool, seed: int, root: Path) -> list[Report]:
    reports = []
    for name in names:
        report = await SCENARIOS[name](root / name, long=long, seed=seed)
        print(report.summary(), flush=True)
        for finding in report.listing():
            print(f"  - {finding}", flush=True)
        reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = args.only or list(SCENARIOS)
    root = Path(tempfile.mkdtemp(prefix="flowcast-stress-"))
    reports = asyncio.run(run(names, long=args.long, seed=args.seed, root=root))
    total = sum(report.seconds for report in reports)
    failed = [report.name for report in reports if not report.ok]
    print(f"{len(reports)} scenarios in {total:.1f}s: " + (f"FAILED {failed}" if failed else "ok"))
    if failed or args.keep:
        print(f"data directories and server logs kept under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
