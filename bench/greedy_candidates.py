"""Hand-run benchmark of `greedy`: time per candidate and iteration time / lower bound.

    python bench/greedy_candidates.py

Not a test: timings depend on the machine. Shapes are D x S x M (pipelines x
stages x microbatches), with 0, 1 and 2 failed GPUs, uniform stages
(F = B = 1 ms, W = 0.8 ms, O = 0.2 ms, 4 MiB boundary sends over 25 GB/s links with 20 us latency) and memory for 2S
microbatches in flight.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schedc.instance import make_instance
from schedc.simulate_engine import ProgramGraph
from schedc.solvers import SolveOptions, get_solver
from schedc.solvers.greedy import candidates

SHAPES = [(2, 4, 8), (8, 4, 32), (16, 8, 64)]


def bench_instance(dp: int, pp: int, mb: int, n_failed: int):
    failed = [(1, pp // 2), (dp - 1, pp - 1)][:n_failed]
    return make_instance(dp, pp, mb, forward=1000, backward_input=1000, backward_weight=800,
                         optimizer=200, activation=1 << 30, stash=1 << 28, static=8 << 30,
                         send=4 << 20, latency=20, gpu_memory=(8 << 30) + 2 * pp * (1 << 30),
                         failed=failed)


def main() -> None:
    print(f"{'shape':>9} {'fail':>4} {'ops':>6} {'cands':>5} {'build/cand':>10} "
          f"{'measure/cand':>12} {'total':>7} {'iter/LB':>7}  best")
    for dp, pp, mb in SHAPES:
        for n_failed in (0, 1, 2):
            inst = bench_instance(dp, pp, mb, n_failed)
            build_t = measure_t = 0.0
            n = 0
            for _, build in candidates(inst):
                t0 = time.perf_counter()
                plan = build()
                if plan is None:
                    continue  # a placement equal to an earlier one
                codes, order = plan
                t1 = time.perf_counter()
                ProgramGraph(inst, codes, order).period()
                measure_t += time.perf_counter() - t1
                build_t += t1 - t0
                n += 1
            t0 = time.perf_counter()
            sched = get_solver("greedy")(inst, SolveOptions())
            total = time.perf_counter() - t0
            ratio = sched.solver.objective / inst.lower_bound
            ops = len(sched.ops)
            best = sched.solver.detail.split(": ")[1].split(" (")[0]
            print(f"{dp}x{pp}x{mb:<4} {n_failed:>4} {ops:>6} {n:>5} {build_t / n:>9.3f}s "
                  f"{measure_t / n:>11.3f}s {total:>6.2f}s {ratio:>7.3f}  {best}")


if __name__ == "__main__":
    main()
