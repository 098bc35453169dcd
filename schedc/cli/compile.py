"""`schedc compile SPEC -o OUT`: compile a spec, write the schedule, exports and a summary."""

from __future__ import annotations

import argparse
import json
import re
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help="the spec file, or - to read standard input")
    parser.add_argument("-o", "--out", required=True, metavar="OUT", help="output directory")
    parser.add_argument("--solver", metavar="NAME", help="override schedule.solver (cpsat, greedy, 1f1b, ...)")
    parser.add_argument("--time-limit", type=float, metavar="S", help="solver work budget, in seconds of a 2-core machine (the same plan under any load)")
    parser.add_argument("--seed", type=int, default=0, help="solver random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print machine-readable output")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from schedc.cli.simulate import summary_table
    from schedc.schedule_io import metrics_of_first_copies
    from schedc.load import load_argument
    from schedc.plan import check_output_dir, compile
    from schedc.solvers.sandbox import failure_of

    check_output_dir(Path(args.out))  # before the solve, not after it
    from schedc.cli.terminal import status

    spec, _ = load_argument(args.spec)
    solver = args.solver or spec.schedule.solver
    limit = spec.schedule.time_limit if args.time_limit is None else args.time_limit
    with status(f"planning {spec.dp * spec.pp:,} GPUs with {solver} (time limit {limit:g} s), then verifying "
                "and simulating"):
        plan = compile(spec, solver=args.solver, time_limit=args.time_limit, seed=args.seed)
    out = plan.write(args.out)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    if args.json:
        print(json.dumps({"ok": True, "out": str(out), "files": files,
                          "metrics": metrics_of_first_copies(plan.schedule, plan.metrics.to_json())}, indent=2))
    else:
        print(summary_table(plan.metrics))
        print(f"wrote {describe_files(files)} to {out}")
    failed = failure_of(plan.schedule.solver.detail)
    if failed:
        print(f"warning: {failed}; the plan written is the one found before its search (verified)",
              file=sys.stderr)
    return 0


def describe_files(files: list[str]) -> str:
    """The written files in a line that stays short at any scale: rank programs and pipeline
    CSVs are counted, with the first and last named ("16,383 rank programs rank_00000.py ...")."""
    groups: dict[str, list[str]] = {"rank": [], "pipeline": [], "program": []}
    single = []
    def natural(name: str):  # pipeline_2.csv before pipeline_10.csv
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

    for name in sorted(files, key=natural):
        prefix = name.split("_", 1)[0]
        (groups[prefix] if prefix in groups and "_" in name else single).append(name)
    parts = list(single)
    for prefix, what in (("rank", "rank programs"), ("program", "class programs"), ("pipeline", "pipeline CSVs")):
        names = groups[prefix]
        if len(names) > 3:
            parts.append(f"{len(names):,} {what} ({names[0]} ... {names[-1]})")
        else:
            parts.extend(names)
    return ", ".join(sorted(parts, key=lambda x: x.lstrip("0123456789,")))
