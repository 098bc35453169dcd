"""Fault-free comparison grid: schedc's plan against ZB-H1 and ZB-H2 reference constructions.

    python bench/zero_bubble_grid.py [--time-limit 5] [--solver cpsat] [--csv out.csv] [--quick]

One pipeline (dp = 1), p in {4, 8} stages, m in {8, 16, 32} microbatches,
F = B = W = 1 ms or F : B : W = 1 : 1.2 : 0.8 ms, communication 10 us or
250 us (link latency; no bytes sent), activation 1 GiB, stash 512 MiB,
static 1 GiB, GPU memory static + p GiB or static + 2p GiB (p or 2p
microbatches' activations in flight), the optimizer (0 us) staggered or behind
a global barrier: 96 instances, each a spec compiled by `schedc.compile`.

The references are schedc's own constructions of the Zero Bubble paper's
schedules (Qi et al., ICLR 2024), timed by the same simulator on the same
instance: ZB-H1 (1F1B warm-up, W of stage s deferred by s backwards) and
ZB-H2 (warm-up 2(p - s) - 1 forwards, W deferred by 2s backwards), both cut
to fit memory (`solvers/static_programs.py`). For each instance it prints schedc's
steady iteration time, the best reference's, their ratio, and schedc's ratio
to the proven lower bound (`optimal` when equal), then a summary per optimizer
and memory setting. `--csv` writes one row per instance; the plan columns
(everything but `wall_s`) are what two runs must agree on.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedc
from schedc.instance import from_spec
from schedc.load import load_text
from schedc.solvers.common import finish
from schedc.solvers.cpsat import iteration_time
from schedc.solvers.cpsat_bound import period_lower_bound
from schedc.solvers.one_f_one_b import template_programs

RATIOS = {"F=B=W": (1.0, 1.0, 1.0), "1:1.2:0.8": (1.0, 1.2, 0.8)}
REFERENCES = {"ZB-H1": "zb-h1", "ZB-H2": "zb-h2"}
#: Columns two runs of the bench must agree on (the plan), and the one they need not (time).
PLAN_COLUMNS = ["p", "m", "fbw", "comm_us", "memory", "optimizer", "zb_h1_ms", "zb_h2_ms",
                "schedc_ms", "bound_ms", "vs_reference", "vs_bound", "status"]


def spec_text(p: int, m: int, fbw: str, comm_us: int, memory_p: int, staggered: bool,
              solver: str, time_limit: float) -> str:
    f, b, w = RATIOS[fbw]
    return f"""# Zero Bubble comparison grid: p = {p}, m = {m}, F:B:W = {fbw}, {comm_us} us, memory {memory_p}p
cluster {{
    dp = 1
    pp = {p}
    gpu {{ memory = {1 + memory_p * p}GiB }}
    link {{ latency = {comm_us}us }}
}}
stages {{
    all {{
        forward = {f}ms  backward_input = {b}ms  backward_weight = {w}ms  optimizer = 0us
        activation = 1GiB  stash = 512MiB  static = 1GiB  send = 0B
    }}
}}
train {{ microbatches = {m} }}
schedule {{
    decouple_backward = true
    stagger_optimizer = {"true" if staggered else "false"}
    solver = {solver}
    time_limit = {time_limit}s
}}
"""


def reference_time(instance, style: str) -> int:
    """A reference construction's steady iteration time on `instance` (its optimizer setting)."""
    return iteration_time(finish(instance, template_programs(instance, style), style, time.perf_counter()))


def run_instance(p: int, m: int, fbw: str, comm_us: int, memory_p: int, staggered: bool,
                 solver: str, time_limit: float) -> dict:
    spec = load_text(spec_text(p, m, fbw, comm_us, memory_p, staggered, solver, time_limit),
                     name=f"grid-p{p}-m{m}.sched")
    instance = from_spec(spec)
    refs = {name: reference_time(instance, style) for name, style in REFERENCES.items()}
    t0 = time.perf_counter()
    plan = schedc.compile(spec)
    wall = time.perf_counter() - t0
    ours = plan.metrics.iteration_time
    bound = period_lower_bound(instance)
    best_ref = min(refs.values())
    return {
        "p": p, "m": m, "fbw": fbw, "comm_us": comm_us, "memory": f"{memory_p}p",
        "optimizer": "staggered" if staggered else "barrier",
        "zb_h1_ms": f"{refs['ZB-H1'] / 1000:.3f}", "zb_h2_ms": f"{refs['ZB-H2'] / 1000:.3f}",
        "schedc_ms": f"{ours / 1000:.3f}", "bound_ms": f"{bound / 1000:.3f}",
        "vs_reference": f"{ours / best_ref:.4f}", "vs_bound": f"{ours / bound:.4f}",
        "status": plan.schedule.solver.status, "wall_s": f"{wall:.2f}",
    }


def grid(quick: bool) -> list[tuple]:
    ps = (4,) if quick else (4, 8)
    ms = (8,) if quick else (8, 16, 32)
    return [(p, m, fbw, comm, mem, stag) for stag in (True, False) for mem in (1, 2) for p in ps
            for m in ms for fbw in RATIOS for comm in (10, 250)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=5.0,
                    help="the specs' schedule.time_limit, a work budget in seconds (default 5, as in a spec)")
    ap.add_argument("--solver", default="cpsat")
    ap.add_argument("--csv", help="write one row per instance here")
    ap.add_argument("--quick", action="store_true", help="p = 4, m = 8 only (16 instances)")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'p':>2} {'m':>3} {'F:B:W':>9} {'comm':>5} {'mem':>4} {'optimizer':>9} {'ZB-H1':>8} "
          f"{'ZB-H2':>8} {'schedc':>8} {'vs ref':>7} {'bound':>8} {'vs LB':>7} {'status':>8} {'wall':>6}")
    for case in grid(args.quick):
        row = run_instance(*case, solver=args.solver, time_limit=args.time_limit)
        rows.append(row)
        print(f"{row['p']:>2} {row['m']:>3} {row['fbw']:>9} {row['comm_us']:>5} {row['memory']:>4} "
              f"{row['optimizer']:>9} {row['zb_h1_ms']:>8} {row['zb_h2_ms']:>8} {row['schedc_ms']:>8} "
              f"{row['vs_reference']:>7} {row['bound_ms']:>8} {row['vs_bound']:>7} {row['status']:>8} "
              f"{row['wall_s']:>5}s", flush=True)
    print()
    print(f"{'optimizer':>9} {'mem':>4} {'n':>3} {'slower':>6} {'worst':>7} {'faster':>6} {'best':>7} "
          f"{'med vs LB':>9} {'max vs LB':>9} {'optimal':>7}")
    for opt in ("staggered", "barrier"):
        for mem in ("1p", "2p"):
            sel = [r for r in rows if r["optimizer"] == opt and r["memory"] == mem]
            if not sel:
                continue
            vs = [float(r["vs_reference"]) for r in sel]
            lb = [float(r["vs_bound"]) for r in sel]
            print(f"{opt:>9} {mem:>4} {len(sel):>3} {sum(v > 1.00001 for v in vs):>6} {max(vs):>7.4f} "
                  f"{sum(v < 0.99999 for v in vs):>6} {min(vs):>7.4f} {statistics.median(lb):>9.4f} "
                  f"{max(lb):>9.4f} {sum(r['status'] == 'optimal' for r in sel):>7}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=PLAN_COLUMNS + ["wall_s"])
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
