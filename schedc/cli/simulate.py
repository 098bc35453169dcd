"""`schedc simulate OUT/schedule.json`: re-verify and re-simulate a schedule file.

Works on any schedule.json, including hand-edited ones: the file is read
(E6xx for a malformed file), verified (E4xx) and simulated, and the same
summary table as `schedc compile` is printed.
"""

from __future__ import annotations

import argparse
import json

from schedc.diagnostics import RunError, error
from schedc.limits import count_problem

#: The most iterations `--iterations` takes. The steady state needs 8 (the period is the mean of
#: the last 4); every iteration more costs memory (its end time, and until the run turns
#: periodic the optimizer steps' ends) and, until then, a pass over every op: 1e8 ran out of memory.
MAX_ITERATIONS = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schedule", metavar="SCHEDULE", help="a schedule.json written by `schedc compile`")
    parser.add_argument("--iterations", type=_number, default=8, metavar="K",
                        help=f"iterations simulated back to back, 1 to {MAX_ITERATIONS:,} (default 8)")
    parser.add_argument("--json", action="store_true", help="print machine-readable output")


def _number(text: str) -> int | float:
    """--iterations as written: a whole number, or another number that `check_iterations` refuses
    with the range (`1e8`, `2.5`, `nan`); text that is no number at all is a usage error."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None


def check_iterations(value: int | float) -> int:
    """`value` when it is a whole number from 1 to MAX_ITERATIONS, else E206."""
    problem = count_problem(value, "--iterations", 1, MAX_ITERATIONS)
    if problem is None:
        return value
    raise RunError([error("E206", problem,
                          hint="the steady state needs 8 iterations (the default); more change little")])


def _ms(us: float) -> str:
    return f"{us / 1000:.3f} ms"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def summary_table(metrics) -> str:
    """The table `schedc compile` and `schedc simulate` print for a `Metrics`."""
    from schedc.schedule import PLAN_SPACE, status_text

    m = metrics
    s = m.solver
    rows = [
        ("iteration time", _ms(m.iteration_time)),
        ("fault-free iteration time", (_ms(m.fault_free_iteration_time)
                                       + (f" ({m.fault_free_solver}'s fault-free plan)" if m.fault_free_solver else ""))
         if m.fault_free_iteration_time else "-"),
        ("slowdown", f"{m.slowdown:.3f}x" if m.slowdown is not None else "-"),
        ("lower bound", f"{_ms(m.lower_bound)} for {PLAN_SPACE}"),
        ("ratio to lower bound", f"{m.ratio_to_lower_bound:.3f}"),
        ("bubble ratio (mean / max)", f"{100 * m.mean_bubble_ratio:.1f}% / {100 * m.max_bubble_ratio:.1f}%"),
        ("peak memory (max / limit)", f"{_gib(m.max_peak_memory)} / {_gib(m.memory_limit)}"),
        ("solver", s.name),
        ("status", status_text(s.status)),
    ]
    if s.bound:
        # The solver's proven bound (cpsat, greedy): usually tighter than the per-stage work bound, so the
        # honest gap. It bounds re-routing plans only: another kind of plan (Bamboo's) may beat it.
        rows.append(("proven bound", f"{_ms(s.bound)} for {PLAN_SPACE} (iteration time "
                                     f"{m.iteration_time / s.bound:.3f}x)"))
    # The whole planning (`schedc.compile`: the solve, its checks and the fault-free reference;
    # `schedc.replan`: the call), not the solver's share of it.
    rows.append(("planning wall time", f"{s.wall_s:.2f} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    from schedc.schedule_io import metrics_of_first_copies, read_schedule
    from schedc.simulate import metrics_of, simulate
    from schedc.verify import verify_schedule

    iterations = check_iterations(args.iterations)  # before the schedule is read
    schedule, stored = read_schedule(args.schedule)
    verify_schedule(schedule)
    sim = simulate(schedule, iterations=iterations)
    ff = stored.get("fault_free_iteration_time")
    ff = ff if isinstance(ff, int) and not isinstance(ff, bool) and ff > 0 else None
    ref = stored.get("fault_free_solver") if ff is not None else None
    ref = ref if isinstance(ref, str) else None
    if ff is None and schedule.instance.fault_free:
        ff, ref = sim.iteration_time, schedule.solver.name
    metrics = metrics_of(schedule, sim, fault_free_iteration_time=ff, fault_free_solver=ref)
    if args.json:
        print(json.dumps({"ok": True, "metrics": metrics_of_first_copies(schedule, metrics.to_json())}, indent=2))
    else:
        print(summary_table(metrics))
    return 0
