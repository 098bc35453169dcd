"""Replan latency: `schedc.replan` end to end (events applied, planned, verified, simulated).

    python bench/replan_latency.py [--calls 7] [--deadlines 0.1 1.0] [--gpus 64] [--busy 2] [--json]

For 16, 32 and 64 GPUs (explicit costs; 16 microbatches at 16 GPUs, 32 at
32 and 64) and four events (one GPU failed, one slowed to 0.6, two failed, a
node failed), calls `schedc.replan` `--calls` times per deadline on a plan
compiled beforehand (`warm_up()` done, as a launcher would) and prints the
median, p95 and max wall time, and the new plan's iteration time against
the lower bound (docs/architecture.md, the simulator) and against `cpsat_bound.period_lower_bound`.
The specs are `schedc bench`'s explicit-cost scenario.

`--busy N` measures the same calls on a busy machine: the script starts N
processes that spin on a core each (before the plans are compiled, so the
load is there from the first call) and ends them, by pid, when it is done;
the `busy` column says how many ran. A deadline is a promise a launcher
relies on: the max column should stay within it, busy or not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time

import schedc
from schedc.bench.compare import percentile
from schedc.bench.scenarios import Scenario
from schedc.plan import compile
from schedc.solvers.cpsat import warm_up
from schedc.solvers.cpsat_bound import period_lower_bound

SHAPES = [(4, 4, 16), (8, 4, 32), (8, 8, 32)]  # (dp, pp, microbatches)


def spec_text(dp: int, pp: int, mb: int) -> str:
    """The bench's explicit-cost scenario, fault-free (`schedc bench`'s `explicit` model)."""
    return Scenario(f"replan-{dp}x{pp}x{mb}", "explicit", dp, pp, mb).spec_text()


def events(dp: int, pp: int) -> dict[str, list[str]]:
    return {
        "fail 1": [f"fail gpu(dp=1, pp={pp // 2})"],
        "slow 0.6": [f"slow gpu(dp=0, pp={pp - 1}) speed = 0.6"],
        "fail 2": ["fail gpu(dp=1, pp=1)", f"fail gpu(dp={dp - 1}, pp={pp - 2})"],
        "fail node": ["fail node 1"],
    }


@contextlib.contextmanager
def busy_loops(n: int):
    """`n` processes that each keep a core busy while the block runs, ended by pid after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--deadlines", type=float, nargs="+", default=[0.1, 1.0])
    ap.add_argument("--gpus", type=int, nargs="+", choices=[dp * pp for dp, pp, _ in SHAPES],
                    help="only these cluster sizes (default: all)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="keep N other processes spinning on a core each during the calls (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args(argv)
    warm_up()
    with busy_loops(args.busy):
        measure(args)
    return 0


def measure(args) -> None:
    if not args.json:
        print("| GPUs | event | busy | deadline s | median s | p95 s | max s | plan / LB (work) | plan / proven bound | status |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for dp, pp, mb in SHAPES:
        if args.gpus and dp * pp not in args.gpus:
            continue
        base = compile(schedc.load(spec_text(dp, pp, mb), name=f"{dp}x{pp}x{mb}"), time_limit=1.0)
        for label, evs in events(dp, pp).items():
            for deadline in args.deadlines:
                walls, plans = [], []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    new = schedc.replan(base, evs, deadline=deadline)
                    walls.append(time.perf_counter() - t)
                    plans.append(new)
                times = {p.metrics.iteration_time for p in plans}
                new = plans[0]
                inst = new.schedule.instance
                row = {
                    "gpus": dp * pp, "shape": f"{dp}x{pp}x{mb}", "event": label, "busy": args.busy,
                    "deadline_s": deadline,
                    "median_s": statistics.median(walls), "p95_s": percentile(walls, 0.95), "max_s": max(walls),
                    "iteration_us": new.metrics.iteration_time, "distinct_plans": len(times),
                    "vs_lb": new.metrics.iteration_time / inst.lower_bound,
                    "vs_bound": new.metrics.iteration_time / period_lower_bound(inst),
                    "status": new.schedule.solver.status,
                }
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"| {row['gpus']} ({row['shape']}) | {label} | {args.busy} | {deadline} | {row['median_s']:.3f} | "
                          f"{row['p95_s']:.3f} | {row['max_s']:.3f} | {row['vs_lb']:.3f} | "
                          f"{row['vs_bound']:.3f} | {row['status']}"
                          + ("" if len(times) == 1 else f" ({len(times)} distinct plans)") + " |",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
