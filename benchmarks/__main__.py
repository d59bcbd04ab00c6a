"""Command line of the harness: ``python -m benchmarks run SUITE`` / ``python -m benchmarks compare A B``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import available_suites, compare, load_records, run_suite


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite (or 'all') and write JSON lines")
    run.add_argument("suite", help=f"one of: all, {', '.join(available_suites())}")
    run.add_argument("--output", "-o", type=Path, help="JSON-lines file to append to (default: stdout only)")
    cmp = sub.add_parser("compare", help="print candidate/baseline ratios of two result files")
    cmp.add_argument("baseline", type=Path)
    cmp.add_argument("candidate", type=Path)
    args = parser.parse_args(argv)

    if args.command == "run":
        suites = available_suites() if args.suite == "all" else [args.suite]
        if args.output is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a", encoding="utf-8") if args.output else contextlib.nullcontext() as stream:
            for suite in suites:
                try:
                    run_suite(suite, stream)
                except ValueError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
        return 0

    rows = compare(load_records(args.baseline), load_records(args.candidate))
    if not rows:
        print("no measurement appears in both files", file=sys.stderr)
        return 1
    width = max(len(key) for key, *_ in rows)
    print(f"{'measurement':<{width}}  {'baseline':>12}  {'candidate':>12}  {'ratio':>8}")
    for key, a, b, ratio in rows:
        print(f"{key:<{width}}  {a:>12.6g}  {b:>12.6g}  {ratio:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
