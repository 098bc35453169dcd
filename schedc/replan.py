"""`schedc.replan(plan, event, deadline=...) -> Plan`: a new plan when the cluster changes.

A launcher calls this on every failure, slowdown or rejoin:

    >>> plan = schedc.compile("specs/example.sched")                    # doctest: +SKIP
    >>> plan = schedc.replan(plan, "fail gpu(dp=2, pp=1)", deadline=1.0)  # doctest: +SKIP
    >>> print_spec(plan.spec)  # the updated spec, to keep with the job  # doctest: +SKIP

The events are applied to `plan.spec` (`schedc.events.apply_events`), and the
new instance is planned by `cpsat` warm-started from the current schedule
(`SolveOptions.hint`: when its programs still fit, e.g. after a slowdown or a
rejoin, they are re-timed and compete with greedy as CP-SAT's seed). The
solver gets what is left of `deadline` after a reserve for verifying and
simulating the result, so the whole call, verification and simulation
included, ends within `deadline` (measured: `bench/replan_latency.py`, and
`schedc bench`). The reserve is measured as the call goes: the checks' cost on
an idle core times how much slower this call runs than its CPU time says
(`_slowdown`: a busy machine), and at least a share of what is left; every
search inside the solver also times itself and stops before a step it cannot
finish, so what comes back is the best plan found by then, verified. Every
returned plan passed `verify_schedule`. Deterministic: the same plan and
events give the same new plan. `deadline=None` with a `time_limit` plans on that work
budget alone (no clock): what `schedc.Replanner` prepares in the background for the likely
next events, so that a launcher gets them in microseconds. Never prints, never exits; raises
`SchedcError`s (E2xx for bad events, E301 when a stage loses every replica,
E3xx when nothing fits in memory).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import replace
from typing import Sequence

from schedc.diagnostics import InfeasibleError, VerificationError, error
from schedc.decompose import classes_for, decomposition_of, known_parts, plan_by_classes
from schedc.events import apply_events
from schedc.instance import Instance, from_spec
from schedc.plan import Plan
from schedc.schedule import Schedule
from schedc.simulate import metrics_of, simulate
from schedc.spec import Failure
from schedc.verify import verify_schedule

#: Seconds per op kept out of the solver's share of the deadline for verifying and simulating
#: the new schedule, and a floor: what lets a replan whose solver stopped in time still end
#: within its deadline. 2.5x the per-op time of `verify_schedule` and `simulate` together at
#: 6,000 ops when this was set (8 us); since the simulator reuses the planner's graph and run
#: (`simulate_engine.graph_of`) the two take 1.7 us per op at 6,144 ops, and the margin is
#: kept for a plan the simulator must build a graph for and for the parts of a plan by
#: classes. Re-measure: `python bench/verify_speed.py` (the verifier per size), and
#: `python bench/replan_latency.py --deadlines 0.1` must keep its max wall time under the
#: deadline.
_CHECK_S_PER_OP = 20e-6
_CHECK_S_MIN = 0.02
#: Seconds per GPU kept out for what a plan by classes does per GPU, not per op (the layout's
#: check, the per-GPU metrics): 2x what they took at 65,536 GPUs x pp 16 when this was set
#: (3.5 us). Re-measure: `python bench/scale.py --sizes 65536 --pp 16`, whose replan p95 must
#: stay under `--deadline`.
_CHECK_S_PER_GPU = 7e-6
#: Share of the deadline the solver may use at most; the rest absorbs Python overheads.
_SOLVER_SHARE = 0.8
#: Share of what is left of the deadline when the solver starts that is kept for the checks
#: after it, at least (a reserve that grows with the time left, so a long deadline on a busy
#: machine keeps room in proportion), and the most the reserve is scaled up for a busy machine
#: (`_slowdown`). Check: `python bench/replan_latency.py --busy 2`, max within the deadline.
_RESERVE_SHARE = 0.25
_MAX_SLOWDOWN = 4.0
#: Work budget (`SolveOptions.time_limit`) per second of the solver's wall budget: small enough
#: that on an idle machine the work budget, not the deadline, ends the search, so replans are
#: reproducible (`stopped_by == "work"`). CP-SAT gets half the wall time left
#: (`cpsat.WALL_SHARE`) after greedy and the model build, and a second of work costs one to
#: three seconds of wall depending on the model (the calibration, docs/planner.md). Check:
#: `python bench/scale.py` marks every replan the deadline cut with "(deadline)".
_WORK_SHARE = 0.2


def _n_ops(instance: Instance) -> int:
    kinds = 3 if instance.decouple_backward else 2
    return instance.dp * instance.pp * instance.microbatches * kinds + len(instance.live_gpus())


def work_budget(deadline: float) -> float:
    """The work budget (`SolveOptions.time_limit`, calibrated seconds) of a replan with `deadline`:
    a function of the deadline alone, so that the same call gets the same budget."""
    return deadline * _SOLVER_SHARE * _WORK_SHARE


def replan(plan: Plan, event: str | Failure | Sequence[str | Failure], deadline: float | None = 1.0, *,
           solver: str = "cpsat", seed: int = 0, symmetric: bool | None = None,
           time_limit: float | None = None) -> Plan:
    """A verified plan for `plan.spec` with `event` applied, computed within `deadline` seconds.

    `event`: one event or a list, as text (``"fail gpu(dp=1, pp=2)"``,
    ``"fail node 3"``, ``"slow gpu(dp=0, pp=3) speed = 0.7"``,
    ``"recover gpu(dp=1, pp=2)"``) or `Failure`s. The new `Plan.spec` is the
    updated spec; its metrics keep the fault-free iteration time of `plan`
    (events change which GPUs are live, not the fault-free job).

    `symmetric` as for `schedc.compile`: from 1,024 GPUs on the cluster is planned by
    classes of alike pipelines (`schedc.decompose`), keeping the components around
    earlier failures that the events leave alone and the programs of classes planned
    before, so the call costs what the events touch, not the cluster's size.

    `time_limit` is the searches' work budget (`SolveOptions.time_limit`), by default
    `work_budget(deadline)`. `deadline=None` plans on the work budget alone, without a clock
    (then `time_limit` is required): the plan a quiet machine returns under `deadline` whenever
    its `stopped_by` is "work", on any machine (what `schedc.Replanner` prepares).
    """
    started = time.monotonic()
    cpu_started = time.thread_time()
    if deadline is not None and deadline <= 0:
        raise InfeasibleError([error("E320", f"replan deadline must be positive, got {deadline}",
                                     hint="pass deadline in seconds, e.g. deadline=1.0")])
    if time_limit is None:
        if deadline is None:
            raise InfeasibleError([error("E320", "a replan without a deadline needs a work budget",
                                         hint="pass a deadline, or time_limit (a work budget in calibrated seconds: "
                                              "0.16 x a deadline is what one buys)")])
        time_limit = work_budget(deadline)
    with _collector_paused():
        return _replan(plan, event, deadline, time_limit, solver, seed, (started, cpu_started), symmetric)


def _slowdown(started: tuple[float, float]) -> float:
    """How much slower than on an idle core this call runs: its wall time over its thread's CPU
    time so far, when that window is long enough to tell (a few ms), or else the load average per
    core (what a busy machine leaves to each runnable process); between 1 and `_MAX_SLOWDOWN`.
    The checks' reserve is their idle-machine cost times this, so that on a busy machine the
    solver stops early enough for them (measured as the call goes, not assumed)."""
    wall = time.monotonic() - started[0]
    cpu = time.thread_time() - started[1]
    if wall >= 0.005 and cpu > 0:
        factor = wall / cpu
    else:
        try:
            factor = os.getloadavg()[0] / (os.cpu_count() or 1)
        except OSError:
            factor = 1.0
    return min(_MAX_SLOWDOWN, max(1.0, factor))


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the call, back as it was after.

    A plan at 64 GPUs makes tens of thousands of small objects; each time the
    collector's thresholds trip it scans them, and a full pass over a
    launcher's heap took 30-50 ms, a third of a 0.1 s deadline (measured:
    p95 0.12 s with it, 0.065 s without, `bench/replan_latency.py`). Pausing
    loses nothing: acyclic garbage is freed by reference counting as usual,
    and whatever cycles the call leaves are collected once the collector
    runs again. Calls on several threads (a `schedc.Replanner`'s preparing beside a launcher's
    call) overlap: the first to start pauses it and the last to end restores it.
    """
    global _paused_calls, _was_enabled
    with _pause_lock:
        if _paused_calls == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused_calls += 1
    try:
        yield
    finally:
        with _pause_lock:
            _paused_calls -= 1
            if _paused_calls == 0 and _was_enabled:
                gc.enable()


_pause_lock = threading.Lock()
_paused_calls = 0  # replans running now, on any thread
_was_enabled = False  # whether the collector ran before the first of them


def _replan(plan: Plan, event, deadline: float | None, time_limit: float, solver: str, seed: int,
            clocks: tuple[float, float], symmetric: bool | None) -> Plan:
    from schedc.solvers import SolveOptions, get_solver

    started = clocks[0]
    spec = apply_events(plan.spec, event)
    instance = from_spec(spec)
    dec = classes_for(instance, symmetric, solver, previous=decomposition_of(plan.schedule))
    # Class programs carry over when only GPU states changed (what events change).
    previous = plan.schedule if plan.instance.dp == instance.dp and plan.instance.same_costs(instance) else None
    solver_deadline = None
    if deadline is not None:
        if dec is None:
            reserve = _CHECK_S_PER_OP * _n_ops(instance)
        else:  # only the classes to plan are verified and simulated op by op; the rest is per GPU
            known = known_parts(previous)
            new_pipelines = sum(cls.size for cls, sig in zip(dec.layout.classes, dec.signatures)
                                if sig not in known)
            reserve = (_CHECK_S_PER_OP * _n_ops(replace(instance, dp=new_pipelines))
                       + _CHECK_S_PER_GPU * len(instance.gpus))
        left = deadline - (time.monotonic() - started)
        reserve = max(max(_CHECK_S_MIN, reserve) * _slowdown(clocks), _RESERVE_SHARE * left)
        solver_deadline = time.monotonic() + max(0.0, min(deadline * _SOLVER_SHARE, left - reserve))
    # The work budget is what the solver's share of the deadline buys on a quiet machine
    # (`work_budget`), so that there the search ends on it (reproducible: stopped_by "work"); the
    # deadline ends it on a loaded one.
    options = SolveOptions(time_limit=time_limit, seed=seed, hint=plan.schedule, deadline=solver_deadline)
    if dec is not None:
        # Only the classes the events made new are planned; the others keep their programs.
        schedule = plan_by_classes(instance, dec, get_solver(solver), options, solver, previous,
                                   fallback=get_solver("greedy"))
    else:
        schedule = get_solver(solver)(instance, options)
    try:
        verify_schedule(schedule)
    except VerificationError:
        # A solver bug must not reach a launcher: fall back to the greedy list scheduler.
        greedy = get_solver("greedy")
        schedule = (greedy(instance, replace(options, hint=None)) if dec is None
                    else plan_by_classes(instance, dec, greedy, options, "greedy", fallback=greedy))
        verify_schedule(schedule)
    schedule = _with_wall(schedule, time.monotonic() - started)
    sim = simulate(schedule)
    fault_free = plan.metrics.fault_free_iteration_time or plan.metrics.iteration_time
    return Plan(spec=spec, schedule=schedule,
                metrics=metrics_of(schedule, sim, fault_free_iteration_time=fault_free,
                                   fault_free_solver=plan.metrics.fault_free_solver),
                previous=plan.schedule)


def _with_wall(schedule: Schedule, wall_s: float) -> Schedule:
    """The schedule with its solver's wall time replaced by the whole replan's so far."""
    return replace(schedule, solver=replace(schedule.solver, wall_s=max(schedule.solver.wall_s, wall_s)))
