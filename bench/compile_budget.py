"""Compile time against `time_limit`: does a whole `schedc.compile` cost about its work budget?

    python bench/compile_budget.py [--time-limit 1] [--random 12] [--specs specs/slow-gpu.sched ...]

`time_limit` is a work budget (counted candidates and local-search moves,
CP-SAT's deterministic time), calibrated so that a whole compile (greedy's
seed, CP-SAT, the checks and the fault-free reference) takes about that long
on 2 idle cores (`cpsat._WALL_S_PER_DET`, `greedy.UNITS_PER_S`,
`plan.REFERENCE_SHARE`). For each spec it prints the compile's wall time, its
CPU time (CP-SAT runs one task at a time, so on a busy machine the CPU time is
the better guess of the idle wall time), the planning time the plan reports,
and the plan's status. The specs: the ones named, and `--random N` random
2 x 5 clusters with one failed GPU (seeded, the same on every run). Each spec
is compiled in a fresh process, so no fault-free reference is reused.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_spec(seed: int, time_limit: float) -> str:
    """A 2 x 5 cluster with one failed GPU and per-stage costs drawn from `seed`."""
    r = random.Random(seed)
    stages = []
    for s in range(5):
        stages.append(f"  stage {s} {{ forward = {r.randint(500, 3000)}us  backward_input = {r.randint(500, 3000)}us  "
                      f"backward_weight = {r.randint(200, 2000)}us  optimizer = {r.randint(0, 500)}us  "
                      f"activation = {r.choice([256, 512])}MiB  stash = 128MiB  static = 2GiB  "
                      f"send = {r.choice([1, 8, 32])}MiB }}")
    mb = r.choice([8, 10, 12, 16])
    failed = (r.randrange(2), r.randrange(5))
    decouple = r.choice(["true", "false"])
    return "\n".join([
        f"# random 2 x 5 cluster, seed {seed}",
        "cluster { dp = 2  pp = 5  gpus_per_node = 5  gpu { memory = 16GiB }  link { latency = 20us  bandwidth = 25GB/s } }",
        "stages {", *stages, "}",
        f"train {{ microbatches = {mb} }}",
        f"failures {{ fail gpu(dp={failed[0]}, pp={failed[1]}) }}",
        f"schedule {{ decouple_backward = {decouple}  solver = cpsat  time_limit = {time_limit}s }}", ""])


_ONE = """
import json, os, sys, time
import schedc
spec = schedc.load(sys.stdin.read(), name=sys.argv[1])
from schedc.solvers.cpsat import warm_up
warm_up()
def cpu():  # this process and the children it waited for (a solve may run in one)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
t, c = time.perf_counter(), cpu()
plan = schedc.compile(spec, time_limit=float(sys.argv[2]))
print(json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": cpu() - c,
                  "planning_s": plan.schedule.solver.wall_s, "status": plan.schedule.solver.status,
                  "iteration_us": plan.metrics.iteration_time}))
"""


def compile_once(name: str, text: str, time_limit: float) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE, name, str(time_limit)], input=text, text=True,
                         capture_output=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=1.0, help="the work budget of every compile (default 1)")
    ap.add_argument("--random", type=int, default=12, metavar="N", help="random 2 x 5 specs (default 12)")
    ap.add_argument("--specs", nargs="*", default=["specs/slow-gpu.sched"], help="spec files to compile too")
    args = ap.parse_args(argv)
    cases = [(path, (ROOT / path).read_text(encoding="utf-8")) for path in args.specs]
    cases += [(f"random 2x5 seed {i}", random_spec(i, args.time_limit)) for i in range(args.random)]
    print("| spec | time_limit s | wall s | cpu s | planning s | status |")
    print("|---|---|---|---|---|---|")
    walls, cpus = [], []
    for name, text in cases:
        row = compile_once(name, text, args.time_limit)
        walls.append(row["wall_s"])
        cpus.append(row["cpu_s"])
        print(f"| {name} | {args.time_limit:g} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | "
              f"{row['planning_s']:.2f} | {row['status']} |", flush=True)
    print(f"\nwall s: median {statistics.median(walls):.2f}, max {max(walls):.2f}; "
          f"cpu s: median {statistics.median(cpus):.2f}, max {max(cpus):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
