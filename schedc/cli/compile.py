"""`schedc compile SPEC -o OUT`: compile a spec, write the schedule, exports and a summary."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="the spec file")
    parser.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    parser.add_argument("--solver", metavar="NAME", help="override schedule.solver (cpsat, greedy, 1f1b, ...)")
    parser.add_argument("--time-limit", type=float, metavar="S", help="solver time limit in seconds")
    parser.add_argument("--seed", type=int, default=0, help="solver random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print machine-readable output")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from schedc.cli.simulate import summary_table
    from schedc.plan import check_output_dir, compile

    check_output_dir(Path(args.out))  # before the solve, not after it
    plan = compile(args.spec, solver=args.solver, time_limit=args.time_limit, seed=args.seed)
    out = plan.write(args.out)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    if args.json:
        print(json.dumps({"ok": True, "out": str(out), "files": files,
                          "metrics": plan.metrics.to_json()}, indent=2))
    else:
        print(summary_table(plan.metrics))
        print(f"wrote {', '.join(files)} to {out}")
    return 0
