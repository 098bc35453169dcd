"""Replan latency: `schedc.replan` end to end (events applied, planned, verified, simulated).

    python bench/replan_latency.py [--calls 7] [--deadlines 0.1 1.0] [--json]

For 16, 32 and 64 GPUs (explicit costs; 16 microbatches at 16 GPUs, 32 at
32 and 64) and four events (one GPU failed, one slowed to 0.6, two failed, a
node failed), calls `schedc.replan` `--calls` times per deadline on a plan
compiled beforehand (`warm_up()` done, as a launcher would) and prints the
median, p95 and max wall time, and the new plan's iteration time against
the lower bound (docs/architecture.md, the simulator) and against `cpsat_bound.period_lower_bound`.
The specs are `schedc bench`'s explicit-cost scenario.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--deadlines", type=float, nargs="+", default=[0.1, 1.0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args(argv)
    warm_up()
    if not args.json:
        print("| GPUs | event | deadline s | median s | p95 s | max s | plan / LB (work) | plan / proven bound | status |")
        print("|---|---|---|---|---|---|---|---|---|")
    for dp, pp, mb in SHAPES:
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
                    "gpus": dp * pp, "shape": f"{dp}x{pp}x{mb}", "event": label, "deadline_s": deadline,
                    "median_s": statistics.median(walls), "p95_s": percentile(walls, 0.95), "max_s": max(walls),
                    "iteration_us": new.metrics.iteration_time, "distinct_plans": len(times),
                    "vs_lb": new.metrics.iteration_time / inst.lower_bound,
                    "vs_bound": new.metrics.iteration_time / period_lower_bound(inst),
                    "status": new.schedule.solver.status,
                }
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"| {row['gpus']} ({row['shape']}) | {label} | {deadline} | {row['median_s']:.3f} | "
                          f"{row['p95_s']:.3f} | {row['max_s']:.3f} | {row['vs_lb']:.3f} | "
                          f"{row['vs_bound']:.3f} | {row['status']}"
                          + ("" if len(times) == 1 else f" ({len(times)} distinct plans)") + " |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
