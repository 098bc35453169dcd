"""Replan latency: `schedc.replan` end to end (events applied, planned, verified, simulated).

    python bench/replan_latency.py [--calls 7] [--deadlines 0.1 1.0] [--gpus 64] [--busy 2]
                                   [--kinds cold preparing prepared] [--json]

For 16, 32 and 64 GPUs (explicit costs; 16 microbatches at 16 GPUs, 32 at
32 and 64) and four events (one GPU failed, one slowed to 0.6, two failed, a
node failed), calls `schedc.replan` `--calls` times per deadline on a plan
compiled beforehand (`warm_up()` done, as a launcher would) and prints the
median, p95 and max wall time, and the new plan's iteration time against
the lower bound (docs/architecture.md, the simulator) and against `cpsat_bound.period_lower_bound`.
The specs are `schedc bench`'s explicit-cost scenario.

The `call` column says which kind of call a row measures (`--kinds`, all three by default):

- `cold`: `schedc.replan(plan, event, deadline)`, nothing prepared;
- `preparing`: the same through a `schedc.Replanner` whose background thread is
  preparing every single-GPU and node failure meanwhile (`Replanner.prepare()`), for the
  events that are not among them (the slowdown, the two failures): the background
  must not slow a foreground call down;
- `prepared`: `Replanner.replan(event)` once the Replanner prepared the four events
  (`prepare([...])`, then `wait()`); the line after the rows says how long preparing
  took. A prepared plan is the one a cold replan on the deadline's work budget gives.

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
from schedc.events import parse_events
from schedc.plan import compile
from schedc.replanner import likely_events
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
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="which calls to measure (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    args = ap.parse_args(argv)
    warm_up()
    with busy_loops(args.busy):
        measure(args)
    return 0


KINDS = ("cold", "preparing", "prepared")


def measure(args) -> None:
    if not args.json:
        print("| GPUs | event | call | busy | deadline s | median s | p95 s | max s | plan / LB (work) "
              "| plan / proven bound | status |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for dp, pp, mb in SHAPES:
        if args.gpus and dp * pp not in args.gpus:
            continue
        base = compile(schedc.load(spec_text(dp, pp, mb), name=f"{dp}x{pp}x{mb}"), time_limit=1.0)
        evs = events(dp, pp)
        for deadline in args.deadlines:
            if "cold" in args.kinds:
                for label, ev in evs.items():
                    row(args, dp, pp, mb, label, "cold", deadline,
                        lambda: schedc.replan(base, ev, deadline=deadline))
            if "preparing" in args.kinds:
                with schedc.Replanner(base, deadline=deadline) as rp:
                    rp.prepare()
                    likely = set(likely_events(base))
                    for label, ev in evs.items():
                        if parse_events(ev) not in likely:
                            row(args, dp, pp, mb, label, "preparing", deadline, lambda: rp.replan(ev))
                    left = sum(1 for key in likely if rp.prepared(key) is None)
                    notes.append(f"{dp * pp} GPUs, deadline {deadline} s: the background had "
                                 f"{left} of {len(likely)} events left to prepare after the `preparing` rows")
                    rp.close(wait=None)  # its replan under way ends before the next rows
            if "prepared" in args.kinds:
                with schedc.Replanner(base, deadline=deadline) as rp:
                    t = time.perf_counter()
                    rp.prepare(list(evs.values()))
                    rp.wait()
                    notes.append(f"{dp * pp} GPUs, deadline {deadline} s: the {len(evs)} events prepared "
                                 f"in {time.perf_counter() - t:.2f} s")
                    for label, ev in evs.items():
                        row(args, dp, pp, mb, label, "prepared", deadline, lambda: rp.replan(ev))
    if not args.json:
        print()
        for note in notes:
            print(note)


def row(args, dp: int, pp: int, mb: int, label: str, kind: str, deadline: float, call) -> None:
    walls, plans = [], []
    for _ in range(args.calls):
        t = time.perf_counter()
        new = call()
        walls.append(time.perf_counter() - t)
        plans.append(new)
    times = {p.metrics.iteration_time for p in plans}
    new = plans[0]
    inst = new.schedule.instance
    out = {
        "gpus": dp * pp, "shape": f"{dp}x{pp}x{mb}", "event": label, "call": kind, "busy": args.busy,
        "deadline_s": deadline,
        "median_s": statistics.median(walls), "p95_s": percentile(walls, 0.95), "max_s": max(walls),
        "iteration_us": new.metrics.iteration_time, "distinct_plans": len(times),
        "vs_lb": new.metrics.iteration_time / inst.lower_bound,
        "vs_bound": new.metrics.iteration_time / period_lower_bound(inst),
        "status": new.schedule.solver.status, "stopped_by": new.schedule.solver.stopped_by,
    }
    if args.json:
        print(json.dumps(out), flush=True)
        return
    print(f"| {out['gpus']} ({out['shape']}) | {label} | {kind} | {args.busy} | {deadline} | "
          f"{fmt_s(out['median_s'])} | {fmt_s(out['p95_s'])} | {fmt_s(out['max_s'])} | {out['vs_lb']:.3f} | "
          f"{out['vs_bound']:.3f} | {out['status']}"
          + ("" if len(times) == 1 else f" ({len(times)} distinct plans)") + " |", flush=True)


def fmt_s(seconds: float) -> str:
    """Three decimals; below a millisecond, in microseconds (a prepared call)."""
    return f"{seconds:.3f}" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


if __name__ == "__main__":
    sys.exit(main())
