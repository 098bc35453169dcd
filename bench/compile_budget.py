"""Compile time against `time_limit`: does a whole `schedc.compile` cost about its work budget?

    python bench/compile_budget.py [--time-limits 1 2 5] [--solvers greedy cpsat] [--random 4]
                                   [--specs specs/*.sched] [--scenarios NAME ...] [--json rows.json]

Run it on a quiet machine, alone: `flock /tmp/schedc-heavy.lock python bench/compile_budget.py`.

`time_limit` is a work budget (counted candidates and local-search moves,
CP-SAT's deterministic time), calibrated so that a whole compile (greedy's
seed, CP-SAT, the checks and the fault-free reference) takes about that long
on 2 idle cores (`cpsat._WALL_MODEL`, `greedy.UNITS_PER_S`,
`plan.REFERENCE_SHARE`). Each spec is compiled in a fresh process (so no
fault-free reference is reused and OR-Tools is imported before the clock
starts) with each solver at each time limit. Per compile it prints the wall
time and its ratio to `time_limit`, the CPU time (CP-SAT runs one task at a
time, so on a busy machine the CPU time is the better guess of the idle wall
time), the CP-SAT solves' share of it, the plan's status, and whether a
search ran out of its budget (`budget`) or every search ended before it
(`early`: greedy's list reached the proven bound, CP-SAT proved optimality;
such a compile is expected to take less than `time_limit`). The summary gives
the median, min and max of wall / time_limit, for all compiles and for those
that spent their budget.

The specs: the ones named (default: every specs/*.sched), a spread of
`schedc bench` scenarios (`--scenarios`, default `DEFAULT_SCENARIOS`), and
`--random N` random 2 x 5 clusters with one failed GPU (seeded, the same on
every run). `--json` writes every compile's row, with each CP-SAT solve's
model size, deterministic limit and use, wall and CPU seconds: the data
`cpsat._WALL_MODEL` is fitted on (docs/planner.md says how).
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Bench scenarios of several sizes and kinds (16-64 GPUs, failed, slow and none).
DEFAULT_SCENARIOS = ("explicit-4x4x8-fault-free-s0", "explicit-4x4x8-1-failed-s0", "explicit-4x4x8-2-slow-s0",
                     "gpt3-1.3b-2x8x16-1-failed-s0", "gpt3-1.3b-8x4x16-2-failed-s0", "gpt3-1.3b-8x4x16-2-slow-s0",
                     "gpt3-2.7b-4x8x32-2-failed-s0", "explicit-8x4x16-node-failed-s0")


def random_spec(seed: int, time_limit: float = 1.0) -> str:
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


def scenario_specs(names) -> list[tuple[str, str]]:
    from schedc.bench.scenarios import scenarios

    known = {sc.name: sc for sc in scenarios(quick=False, seeds=1)}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"unknown scenarios: {', '.join(missing)}")
    return [(n, known[n].spec_text()) for n in names]


_ONE = """
import json, os, sys, time
import schedc
from schedc.solvers import cpsat, greedy
spec = schedc.load(sys.stdin.read(), name=sys.argv[1])
cpsat.warm_up()
def cpu():  # this process and the children it waited for (a CP-SAT solve runs in one)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
solves, seeds = [], []
contained = cpsat.solve_contained
def solve_contained(solver, model, stop_at=None):
    proto = model.Proto()
    t, c = time.perf_counter(), cpu()
    out = contained(solver, model, stop_at)
    solves.append({"variables": len(proto.variables), "constraints": len(proto.constraints),
                   "det_limit": solver.parameters.max_deterministic_time, "det_used": out.deterministic_time,
                   "wall_s": time.perf_counter() - t, "cpu_s": cpu() - c, "status": out.status_name})
    return out
cpsat.solve_contained = solve_contained
counted = greedy.solve_counted
def solve_counted(instance, options):
    t = time.perf_counter()
    out = counted(instance, options)
    seeds.append({"limit": options.time_limit, "spent": out[1], "wall_s": time.perf_counter() - t,
                  "status": out[0].solver.status})
    return out
greedy.solve_counted = solve_counted
t, c = time.perf_counter(), cpu()
plan = schedc.compile(spec, solver=sys.argv[3], time_limit=float(sys.argv[2]))
print(json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": cpu() - c,
                  "planning_s": plan.schedule.solver.wall_s, "status": plan.schedule.solver.status,
                  "iteration_us": plan.metrics.iteration_time, "solves": solves, "seeds": seeds}))
"""


def compile_once(name: str, text: str, time_limit: float, solver: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE, name, str(time_limit), solver], input=text, text=True,
                         capture_output=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spent_budget(row: dict) -> bool:
    """Whether some search of the compile ran out of its work budget (else every one ended early:
    a proven bound, or greedy's list and local search had nothing left to try)."""
    return (any(s["det_used"] >= 0.95 * s["det_limit"] for s in row["solves"])
            or any(g["spent"] >= 0.95 * g["limit"] for g in row["seeds"]))


def summary(label: str, ratios: list[float]) -> str:
    if not ratios:
        return f"{label}: none"
    return (f"{label}: n {len(ratios)}, median {statistics.median(ratios):.2f}, "
            f"min {min(ratios):.2f}, max {max(ratios):.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limits", type=float, nargs="+", default=[1.0, 2.0, 5.0],
                    help="the work budgets of the compiles (default 1 2 5)")
    ap.add_argument("--solvers", nargs="+", default=["greedy", "cpsat"], help="default greedy cpsat")
    ap.add_argument("--random", type=int, default=4, metavar="N", help="random 2 x 5 specs (default 4)")
    ap.add_argument("--specs", nargs="*", default=None, help="spec files (default: specs/*.sched)")
    ap.add_argument("--scenarios", nargs="*", default=list(DEFAULT_SCENARIOS), help="`schedc bench` scenario names")
    ap.add_argument("--json", metavar="FILE", help="write every compile's row here")
    args = ap.parse_args(argv)
    paths = args.specs if args.specs is not None else sorted(glob.glob(str(ROOT / "specs" / "*.sched")))
    cases = [(Path(p).name, Path(p).read_text(encoding="utf-8")) for p in paths]
    cases += scenario_specs(args.scenarios)
    cases += [(f"random-2x5-s{i}", random_spec(i)) for i in range(args.random)]
    print("| spec | solver | time_limit s | wall s | wall / limit | cpu s | CP-SAT cpu s | status | ended |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, text in cases:
        for solver in args.solvers:
            for limit in args.time_limits:
                row = compile_once(name, text, limit, solver)
                row.update(spec=name, solver=solver, time_limit=limit, ended="budget" if spent_budget(row) else "early")
                rows.append(row)
                print(f"| {name} | {solver} | {limit:g} | {row['wall_s']:.2f} | {row['wall_s'] / limit:.2f} | "
                      f"{row['cpu_s']:.2f} | {sum(s['cpu_s'] for s in row['solves']):.2f} | {row['status']} | "
                      f"{row['ended']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print("\nwall / time_limit")
    for solver in args.solvers:
        for limit in args.time_limits:
            mine = [r for r in rows if r["solver"] == solver and r["time_limit"] == limit]
            print(summary(f"  {solver} at {limit:g} s, all", [r["wall_s"] / limit for r in mine]))
            print(summary(f"  {solver} at {limit:g} s, budget spent",
                          [r["wall_s"] / limit for r in mine if r["ended"] == "budget"]))
    print(summary("  every compile", [r["wall_s"] / r["time_limit"] for r in rows]))
    print(summary("  every compile that spent its budget",
                  [r["wall_s"] / r["time_limit"] for r in rows if r["ended"] == "budget"]))
    print(summary("  cpu / time_limit, every compile that spent its budget",
                  [r["cpu_s"] / r["time_limit"] for r in rows if r["ended"] == "budget"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
