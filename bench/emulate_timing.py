"""Timing fidelity of the runtime: `--emulate` runs vs the simulator's iteration_time.

A 2x4 cluster with one failed GPU, costs of a few milliseconds, scheduled by
`greedy` (or CP-SAT), run with every compute op replaced by a sleep of its
scheduled duration and real gloo messages between the ranks. Reports the
measured steady-state period (mean gap between the last iterations' ends)
over the simulator's `iteration_time` (target: within 10%).

    python bench/emulate_timing.py [--iterations 10] [--scale-ms 3] [--solver greedy]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def measure(*, iterations: int = 10, scale_ms: float = 3.0, solver: str = "greedy") -> dict:
    """Run the emulation once; return measured and simulated periods (seconds) and their ratio."""
    from schedc.codegen import write_programs
    from schedc.instance import make_instance
    from schedc.runtime.launcher import launch
    from schedc.simulate import simulate
    from schedc.solvers import SolveOptions, get_solver
    from schedc.spec import ClusterSpec, GpuSpec, ModelSpec, ScheduleOptions, Spec, TrainSpec

    us = int(scale_ms * 1000)
    inst = make_instance(2, 4, 4, forward=us, backward_input=us, backward_weight=int(0.8 * us),
                         optimizer=us // 2, latency=100, failed=[(1, 2)])
    sched = get_solver(solver)(inst, SolveOptions(time_limit=2.0))
    sim = simulate(sched)
    spec = Spec(cluster=ClusterSpec(dp=2, pp=4, gpus_per_node=8, placement="pipeline_major",
                                    gpu=GpuSpec(memory=inst.gpu_memory), link=inst.link),
                stages=inst.stages, train=TrainSpec(microbatches=4), schedule=ScheduleOptions(),
                gpus=inst.gpus, model=ModelSpec(), source_name="bench/emulate_timing.py")
    with tempfile.TemporaryDirectory() as tmp:
        write_programs(spec, sched, Path(tmp), metrics={"iteration_time": sim.iteration_time})
        result = launch(tmp, iterations=iterations, emulate=True, timeout=60)
    measured = result.iteration_time(last=4)
    simulated = sim.iteration_time / 1e6
    return {"solver": sched.solver.name, "iterations": iterations, "measured_s": measured,
            "simulated_s": simulated, "ratio": measured / simulated}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--scale-ms", type=float, default=5.0, help="forward duration in ms")
    parser.add_argument("--solver", default="greedy")
    args = parser.parse_args(argv)
    report = measure(iterations=args.iterations, scale_ms=args.scale_ms, solver=args.solver)
    print(json.dumps(report, indent=2))
    return 0 if abs(report["ratio"] - 1) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
