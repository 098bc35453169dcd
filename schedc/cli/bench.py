"""`schedc bench`: schedc's planner against the baselines, under failures (docs/baselines.md).

Argument parsing and printing only; the benchmark is `schedc.bench.compare.run_benchmark`
(also `python bench/run.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from schedc.diagnostics import RunError, error
from schedc.limits import seconds_problem

#: The most failure placements per shape: the matrix is built whole, 5 to 6 scenarios per
#: shape and seed, before any is run.
MAX_SEEDS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="bench/results", help="output directory (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="a small subset that runs in seconds (CI smoke)")
    parser.add_argument("--time-limit", type=float, default=1.0,
                        help="cpsat/greedy time limit, seconds, above 0 and at most 1e6 (default 1)")
    parser.add_argument("--scale-time-limit", type=float, default=10.0,
                        help="time limit at the scale points, seconds, above 0 and at most 1e6 (default 10)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"failure placements per shape, 1 to {MAX_SEEDS} (default 2; 1 with --quick)")
    parser.add_argument("--no-scale", action="store_true", help="skip the 256-4096 GPU latency points")
    parser.add_argument("--no-ablation", action="store_true", help="skip the decoupling/staggering ablation")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N quality scenarios (N >= 1)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> None:
    """E206 for option values out of range, before anything runs: a time limit of 0 or nan, or
    `--limit -1` (a slice that dropped the last scenario), ran a whole benchmark without a word."""
    problems = []
    for name in ("time_limit", "scale_time_limit"):
        value = getattr(args, name)
        option = "--" + name.replace("_", "-")
        problem = seconds_problem(value, option)
        if problem:
            problems.append(error("E206", problem, hint=f"e.g. {option} 2"))
    if args.seeds is not None and not 1 <= args.seeds <= MAX_SEEDS:
        problems.append(error("E206", f"--seeds must be a whole number from 1 to {MAX_SEEDS}, got {args.seeds}",
                              hint="leave it out for the default (2; 1 with --quick)"))
    if args.limit is not None and args.limit < 1:
        problems.append(error("E206", f"--limit must be at least 1, got {args.limit}",
                              hint="leave it out to run every quality scenario"))
    if problems:
        raise RunError(problems)


def run(args: argparse.Namespace) -> int:
    check(args)  # before the matrix is built or OR-Tools loaded
    from schedc.bench.compare import run_benchmark

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    command = "schedc bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    written = run_benchmark(Path(args.output), quick=args.quick, time_limit=args.time_limit,
                            scale_time_limit=args.scale_time_limit, seeds=args.seeds, scale=not args.no_scale,
                            ablation=not args.no_ablation, limit=args.limit, command=command, log=log)
    print(f"wrote {written[0]}, " + ", ".join(p.name for p in written[1:]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python bench/run.py` (the same as `schedc bench`)."""
    from schedc.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
