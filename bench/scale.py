"""Scale: `schedc compile` and `schedc.replan` of one event from 1,024 to 65,536 GPUs.

    python bench/scale.py [--sizes 1024 4096 16384 65536] [--pp 8 16] [--calls 7]
                          [--deadline 1.0] [--whole-up-to 4096] [--json]

Each point (GPUs, pp) runs in a process of its own (so its peak memory is
its own): the spec is `schedc bench`'s explicit-cost scenario with 16
microbatches and 0.1% of the GPUs failed at random places; it is compiled
(cpsat, time limit 1 s) and written with `Plan.write` (as `schedc compile`
does: time and size of the output folder), then `schedc.replan` is called
`--calls` times for each of three events on that plan: one more GPU failed,
one node failed (8 GPUs), one GPU slowed to 0.7. Reported: p50/p95/max of
the replan wall time (events applied, planned, verified, simulated), the
new plan's iteration time, whether its classes were all reused or some were
planned, and the peak RSS of the process. Up to `--whole-up-to` GPUs the
same is done planning every pipeline op by op (`symmetric=False`), to
compare the plans' quality and cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def spec_text(gpus: int, pp: int) -> str:
    from schedc.bench.scenarios import Scenario, random_failures

    dp = gpus // pp
    fails = random_failures(dp, pp, max(1, gpus // 1000), random.Random(gpus * 100 + pp))
    return Scenario(f"scale-{gpus}-pp{pp}", "explicit", dp, pp, 16, tuple(fails)).spec_text()


def events(gpus: int, pp: int, spec) -> dict[str, str]:
    """Three events on healthy pipelines (deterministic places)."""
    dp = gpus // pp
    healthy = [d for d in range(dp) if all(spec.gpus[g].live for g in range(len(spec.gpus))
                                         if spec.gpus[g].dp == d)] if gpus <= 4096 else None
    d1 = dp // 2 + 1
    d2 = dp // 3
    if healthy is not None:
        d1 = min(healthy, key=lambda d: abs(d - d1))
        d2 = min((d for d in healthy if d != d1), key=lambda d: abs(d - d2))
    node = next(g.node for g in spec.gpus if g.dp == (d1 + 7) % dp)
    return {"fail gpu": f"fail gpu(dp={d1}, pp={pp // 2 - 1})",
            "fail node": f"fail node {node}",
            "slow gpu": f"slow gpu(dp={d2}, pp={pp // 2}) speed = 0.7"}


def _folder_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def point(gpus: int, pp: int, calls: int, deadline: float, symmetric: bool | None) -> dict:
    """One scale point, in this process."""
    import schedc
    from schedc.plan import compile
    from schedc.replan import replan
    from schedc.solvers.cpsat import warm_up

    warm_up()
    spec = schedc.load(spec_text(gpus, pp), name=f"scale-{gpus}")
    t0 = time.perf_counter()
    plan = compile(spec, time_limit=1.0, symmetric=symmetric)
    compile_s = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="schedc-scale-")) / "out"
    try:
        t0 = time.perf_counter()
        plan.write(out)
        write_s = time.perf_counter() - t0
        n_files, n_bytes = _folder_size(out)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    row = {"gpus": gpus, "pp": pp, "dp": gpus // pp, "mode": "whole" if symmetric is False else "classes",
           "failed_before": sum(1 for g in spec.gpus if not g.live),
           "compile_s": round(compile_s, 3), "write_s": round(write_s, 3), "files": n_files,
           "output_mb": round(n_bytes / 2**20, 1), "iteration_ms": plan.metrics.iteration_time / 1000,
           "reduced_dp": getattr(getattr(plan.schedule, "layout", None), "reduced_dp", gpus // pp),
           "events": {}}
    for label, ev in events(gpus, pp, spec).items():
        walls, new = [], None
        for _ in range(calls):
            t0 = time.perf_counter()
            new = replan(plan, ev, deadline=deadline, symmetric=symmetric)
            walls.append(time.perf_counter() - t0)
        walls.sort()
        detail = new.schedule.solver.detail
        row["events"][label] = {
            "event": ev, "p50_s": round(statistics.median(walls), 3),
            "p95_s": round(walls[min(len(walls) - 1, round(0.95 * (len(walls) - 1)))], 3),
            "max_s": round(walls[-1], 3), "iteration_ms": new.metrics.iteration_time / 1000,
            "stopped_by": new.schedule.solver.stopped_by,
            "classes": ("all reused" if "all reused" in detail else
                        detail.split("(", 1)[1].split(")", 1)[0] if "planned by classes" in detail else "-"),
        }
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--pp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--deadline", type=float, default=1.0)
    ap.add_argument("--whole-up-to", type=int, default=4096,
                    help="also plan every pipeline op by op up to this many GPUs (quality and cost)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--point", nargs=3, metavar=("GPUS", "PP", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.point:
        gpus, pp, mode = int(args.point[0]), int(args.point[1]), args.point[2]
        print(json.dumps(point(gpus, pp, args.calls, args.deadline, False if mode == "whole" else None)))
        return 0
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for gpus in args.sizes:
        for pp in args.pp:
            for mode in ("classes", "whole") if gpus <= args.whole_up_to else ("classes",):
                proc = subprocess.run([sys.executable, __file__, "--point", str(gpus), str(pp), mode,
                                       "--calls", str(args.calls), "--deadline", str(args.deadline)],
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    _print_row(row, header=len(rows) == 1)
    return 0


def _print_row(row: dict, header: bool) -> None:
    if header:
        print("| GPUs | pp | planned | compile s | write s | output | peak RSS | event | replan p50 s | p95 s "
              "| max s | iteration ms | classes |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (label, ev) in enumerate(row["events"].items()):
        lead = (f"| {row['gpus']:,} | {row['pp']} | {row['mode']} ({row['reduced_dp']:,} of {row['dp']:,} "
                f"pipelines) | {row['compile_s']} | {row['write_s']} | {row['files']:,} files, "
                f"{row['output_mb']} MB | {row['peak_rss_mb']:,.0f} MB") if i == 0 else "| | | | | | |"
        print(f"{lead} | {label} | {ev['p50_s']} | {ev['p95_s']} | {ev['max_s']} | {ev['iteration_ms']:.3f} "
              f"| {ev['classes']}{'' if ev['stopped_by'] == 'work' else ' (deadline)'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
