"""`schedc bench`: schedc's planner against the baselines, under failures (docs/baselines.md).

Argument parsing and printing only; the benchmark is `schedc.bench.compare.run_benchmark`
(also `python bench/run.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="bench/results", help="output directory (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="a small subset that runs in seconds (CI smoke)")
    parser.add_argument("--time-limit", type=float, default=1.0, help="cpsat/greedy time limit, seconds (default 1)")
    parser.add_argument("--scale-time-limit", type=float, default=10.0,
                        help="time limit at the scale points, seconds (default 10)")
    parser.add_argument("--seeds", type=int, default=None, help="failure placements per shape (default 2; 1 with --quick)")
    parser.add_argument("--no-scale", action="store_true", help="skip the 256-4096 GPU latency points")
    parser.add_argument("--no-ablation", action="store_true", help="skip the decoupling/staggering ablation")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N quality scenarios")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
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
