"""The CP-SAT planner: valid, never worse than greedy, above the lower bound, deterministic, E3xx."""

from __future__ import annotations

import math
import os
import pathlib
import time

import pytest
from hypothesis import given

from schedc.diagnostics import InfeasibleError
from schedc.instance import make_instance
from schedc.simulate import simulate
from schedc.solvers import SolveOptions, get_solver
from schedc.solvers.cpsat import check_feasible, deterministic_budget, period_lower_bound, solve, warm_up
from schedc.solvers.cpsat_bound import chain_bound, placement_bound
from schedc.verify import verify_schedule
from tests.strategies import bench_explicit, instances

GOLDEN = pathlib.Path(__file__).parent / "golden" / "infeasible"
FAST = SolveOptions(time_limit=0.05)  # a work budget: small, so 100 examples stay quick


@given(instances(max_dp=3, max_pp=3, max_microbatches=4))
def test_cpsat_is_valid_and_never_worse_than_its_greedy_seed(instance):
    import schedc.solvers.cpsat as cpsat

    schedule = solve(instance, FAST)
    verify_schedule(schedule)
    t = simulate(schedule).iteration_time
    assert t >= math.ceil(instance.lower_bound - 1e-9)
    # Its seed is greedy's plan with the seed's share of the work budget (`cpsat.SEED_SHARE`).
    seed_options = SolveOptions(time_limit=FAST.time_limit * cpsat.SEED_SHARE)
    assert t <= simulate(get_solver("greedy")(instance, seed_options)).iteration_time
    info = schedule.solver
    assert info.name == "cpsat" and info.status in ("optimal", "feasible", "fallback")
    # The solver's own objective is a period the schedule can repeat at: never below the simulation.
    assert info.objective is None or info.objective >= t or info.status == "optimal"
    if info.status == "optimal":
        assert t <= info.bound


def test_cpsat_moves_work_off_a_slow_gpu():
    # One GPU at half speed: keeping all its microbatches makes it the bottleneck.
    inst = make_instance(3, 4, 8, slow={(1, 2): 0.5})
    schedule = solve(inst, SolveOptions(time_limit=1.0))
    verify_schedule(schedule)
    slow_rank = inst.gpu(1, 2).rank
    moved = [op for op in schedule.ops if op.dp == 1 and op.pp == 2 and op.rank != slow_rank]
    assert moved, "no work left the slow GPU"
    assert simulate(schedule).iteration_time < 48_000  # everything on the slow GPU takes 48 ms


def test_cpsat_is_deterministic():
    inst = make_instance(4, 4, 8, failed=[(0, 1)], gpu_memory=4 << 20, send=1 << 20, latency=20)
    a = solve(inst, SolveOptions(time_limit=0.5))
    b = solve(inst, SolveOptions(time_limit=0.5))
    assert a.ops == b.ops


@pytest.fixture
def cpsat_runs(monkeypatch):
    """What each CP-SAT search of the test was told and did: its limits (deterministic units and
    wall seconds), the deterministic units it used, its model's size and its status."""
    import schedc.solvers.cpsat as cpsat

    runs = []
    real = cpsat.solve_contained

    def spy(solver, model, stop_at=None):
        solved = real(solver, model, stop_at)
        p = solver.parameters
        runs.append(dict(max_det=p.max_deterministic_time, max_wall=p.max_time_in_seconds,
                         det=solved.deterministic_time, variables=len(model.Proto().variables),
                         status=solved.status_name))
        return solved

    monkeypatch.setattr(cpsat, "solve_contained", spy)
    return runs


def test_cpsat_stops_on_its_work_budget_not_on_the_clock(monkeypatch, cpsat_runs):
    """Without a deadline, CP-SAT's search is limited by the work budget alone (deterministic
    time, the same on a quiet or a loaded machine) and has no wall-clock limit. What the budget
    costs in seconds is a benchmark figure (`schedc bench`: the cpsat_solve_s column), not a test's."""
    # Greedy's plan is above the proven bound here, so CP-SAT runs (see below).
    import schedc.solvers.cpsat as cpsat

    inst = bench_explicit(slow={(1, 0): 0.5, (1, 3): 0.6})
    given = []
    real_budget = cpsat.search_budget
    monkeypatch.setattr(cpsat, "search_budget", lambda *a: given.append(real_budget(*a)) or given[-1])
    schedule = solve(inst, SolveOptions(time_limit=0.2))
    verify_schedule(schedule)
    (run,) = cpsat_runs
    # CP-SAT's share of the budget (what greedy's seed left), as deterministic units.
    (work,) = given
    assert 0 < work <= 0.2
    assert run["max_det"] == pytest.approx(deterministic_budget(work, run["variables"]))
    assert run["max_wall"] == math.inf  # nothing stops it on the clock
    # It ended on that budget (or a proof): the limit is checked between batches of work, so it
    # may overshoot a little, in deterministic units too (measured: 0.174 of 0.137).
    assert run["status"] == "OPTIMAL" or run["max_det"] <= run["det"] <= 1.5 * run["max_det"], run
    assert schedule.solver.stopped_by == "work"


def test_seed_and_search_share_one_work_budget():
    """CP-SAT gets what greedy's counted work left of the budget, at least its minimum share, less
    the model's estimated build; nothing when the build alone would use it up."""
    from schedc.solvers.cpsat import _BUILD_S_PER_OP, MIN_SEARCH_SHARE, search_budget

    assert search_budget(1.0, 0.25, 0) == pytest.approx(0.75)
    assert search_budget(1.0, 0.95, 0) == pytest.approx(MIN_SEARCH_SHARE)
    assert search_budget(1.0, 0.25, 1000) == pytest.approx(0.75 - 1000 * _BUILD_S_PER_OP)
    assert search_budget(0.01, 0.0, 10_000) == 0.0


def test_cpsat_proves_the_bound_when_greedy_reaches_it():
    schedule = solve(make_instance(2, 1, 4), FAST)  # one stage: no bubble, the bound is exact
    assert schedule.solver.status == "optimal"
    assert simulate(schedule).iteration_time == math.ceil(schedule.instance.lower_bound)


# -- the chain bound ----------------------------------------------------------------


def test_chain_bound_by_hand():
    # One pipeline, two stages, 3 microbatches, transfers of 5 us. From stage 0's first F:
    # F0 + transfer (105), then stage 1 runs 3 x (F1 + B1) = 1800, the last B comes back
    # (transfer + B0 = 305), then W0 and O0 (60): 2270. The work bound is only 1880.
    inst = make_instance(1, 2, 3, forward=[100, 200], backward_input=[300, 400],
                         backward_weight=[50, 60], optimizer=[10, 20], latency=5, send=0)
    assert chain_bound(inst) == 2270
    assert period_lower_bound(inst) == 2270 > inst.lower_bound
    schedule = solve(inst, FAST)
    assert simulate(schedule).iteration_time >= 2270
    # Without decoupling B carries the weight gradient and there is no W: 105 + 3 x 660 + 365 + 10.
    whole = make_instance(1, 2, 3, forward=[100, 200], backward_input=[300, 400],
                          backward_weight=[50, 60], optimizer=[10, 20], latency=5, send=0,
                          decouple_backward=False)
    assert chain_bound(whole) == 105 + 3 * 660 + 5 + 350 + 10


def test_chain_bound_queues_moved_work_on_the_busiest_gpu():
    # The round trip runs through stage 1's busiest GPU whatever the placement: a failed or slow
    # GPU's microbatches land on some live GPU of the stage and queue there.
    base = dict(forward=[100, 200], backward_input=[300, 400], backward_weight=[50, 60],
                optimizer=[10, 20], latency=5, send=0)
    healthy = chain_bound(make_instance(2, 2, 3, **base))
    assert healthy == 2270
    # Pipeline 0's stage 1 failed: the one live GPU of stage 1 runs all 6 microbatches' F + B.
    assert chain_bound(make_instance(2, 2, 3, failed=[(0, 1)], **base)) == 105 + 6 * 600 + 305 + 60
    # Both GPUs of stage 1 at half speed (F + B = 1200 us): 3 microbatches each at best.
    both_slow = make_instance(2, 2, 3, slow={(0, 1): 0.5, (1, 1): 0.5}, **base)
    assert chain_bound(both_slow) == 105 + 3 * 1200 + 305 + 60
    # One at half speed: its 3 microbatches go to the earliest completions, 1 on the slow GPU
    # (1200) and 2 more on the full-speed one (1800 + 600, then the slow one's 2400): 2400.
    one_slow = make_instance(2, 2, 3, slow={(0, 1): 0.5}, **base)
    assert chain_bound(one_slow) == 105 + 2400 + 305 + 60


def test_chain_bound_with_fewer_gpus_upstream():
    # Stage 0 of pipeline 1 failed: stage 0's one live GPU serves both of stage 1's GPUs (each
    # keeps its own 3 microbatches: 3 x (F1 + B1) = 1800 us after its first F). Their first
    # microbatches start at stage 0 in turn (F0 = 50 us apart) and their last ones come back
    # to it in turn (B0 + W0 = 60 us each), so the later of the two ends with two B + W pairs:
    # (F0 + 5) + 1800 + 5 + 2 x 60 + O0 = 1990, where the pipeline's round trip says 1930.
    # Greedy's plan reaches it: proven optimal.
    base = dict(forward=[50, 200], backward_input=[50, 400], backward_weight=[10, 10], optimizer=[10, 20],
                latency=5, send=0)
    inst = make_instance(2, 2, 3, failed=[(1, 0)], **base)
    assert chain_bound(inst) == 55 + 3 * 600 + 5 + 2 * 60 + 10 == 1990
    assert period_lower_bound(inst) == 1990 > placement_bound(inst) == inst.lower_bound == 1850
    for name in ("greedy", "cpsat"):
        assert simulate(get_solver(name)(inst, FAST)).iteration_time >= 1990
    plan = get_solver("greedy")(inst, FAST)
    assert plan.solver.status == "optimal" and plan.solver.objective == 1990
    # With both GPUs of stage 0 live, each serves its own: the round trip, 1930.
    assert chain_bound(make_instance(2, 2, 3, **base)) == 55 + 1800 + 55 + 10 + 10 == 1930
    # Three GPUs upstream for four: the fourth first microbatch starts F0 late, and four B + W
    # pairs on three GPUs take two turns: max(F0 + 60, 2 x 60) over one pair.
    four = make_instance(4, 2, 3, failed=[(3, 0)], **base)
    assert chain_bound(four) == 55 + 1800 + 5 + max(50 + 60, 2 * 60) + 10 == 1990
    slow_first = make_instance(4, 2, 3, failed=[(3, 0)], **{**base, "forward": [80, 200]})
    assert chain_bound(slow_first) == 85 + 1800 + 5 + max(80 + 60, 2 * 60) + 10 == 2040
    # A stage in the middle with one live GPU for two: one more F (or B) of it on the way.
    middle = make_instance(2, 3, 3, failed=[(1, 1)], forward=[50, 50, 200], backward_input=[50, 50, 400],
                           backward_weight=10, optimizer=[10, 10, 20], latency=5, send=0)
    assert chain_bound(middle) == 110 + 1800 + 110 + 20 + 50 == 2090
    for name in ("greedy", "cpsat"):
        assert simulate(get_solver(name)(middle, FAST)).iteration_time >= 2090


# -- the placement bound ------------------------------------------------------------


def test_placement_bound_by_hand():
    # 4 pipelines x 8 microbatches, one GPU of stage 1 failed: its 8 microbatches go to the 3
    # live peers, so one of them runs 8 + 3 = 11 (not 10.67) microbatches of 300 us, plus O.
    base = dict(forward=100, backward_input=100, backward_weight=100, optimizer=50, send=0)
    inst = make_instance(4, 2, 8, failed=[(1, 1)], **base)
    assert placement_bound(inst) == 11 * 300 + 50
    assert inst.lower_bound == pytest.approx((32 * 300 + 3 * 50) / 3)  # 3250 < 3350
    assert period_lower_bound(inst) >= 3350
    # A GPU at speed 0.5 among 3 at full speed: its 8 microbatches go to the 8 earliest
    # completion slots: the slow GPU's (O = 100, then 700, 1300, 1900, 2500) and the fast
    # ones' (2450 + 300k: 2750, 2750, 2750, 3050): the busiest GPU is a fast one at 3050.
    slow = make_instance(4, 2, 8, slow={(1, 1): 0.5}, **base)
    assert placement_bound(slow) == 10 * 300 + 50
    # Without decoupling the per-microbatch time is F + the full backward.
    whole = make_instance(4, 2, 8, failed=[(1, 1)], decouple_backward=False, **base)
    assert placement_bound(whole) == 11 * 300 + 50
    # Fault-free, it is one pipeline's work per GPU.
    assert placement_bound(make_instance(4, 2, 8, **base)) == 8 * 300 + 50


@given(instances(max_dp=3, max_pp=4, max_microbatches=6))
def test_no_schedule_beats_the_chain_or_placement_bound(instance):
    for name in ("greedy", "reroute-1f1b", "cpsat"):
        try:
            schedule = get_solver(name)(instance, FAST)
        except InfeasibleError:
            continue
        # Each bound on the schedule's own instance: reroute-1f1b plans the instance without
        # decoupling, and at a slow GPU's speed durations round per op (at 0.6, F + B + W is
        # 84 x 3 = 252 us, F + the full backward 84 + 167 = 251 us).
        t = simulate(schedule).iteration_time
        assert t >= chain_bound(schedule.instance), name
        assert t >= placement_bound(schedule.instance), name


def test_placement_bound_regression_rounded_durations():
    """A 1x1x1 instance at speed 0.6 whose reroute-1f1b plan (no decoupling) takes 251 us, below
    the decoupled instance's bound of 252: each bound belongs to its own instance."""
    from schedc.instance import make_instance as mk

    inst = mk(1, 1, 1, forward=50, backward_input=50, backward_weight=50, optimizer=0,
              slow={(0, 0): 0.6}, stagger_optimizer=False)
    schedule = get_solver("reroute-1f1b")(inst, FAST)
    assert not schedule.instance.decouple_backward
    assert placement_bound(inst) == 3 * 84
    assert placement_bound(schedule.instance) == 84 + 167 <= simulate(schedule).iteration_time


def test_cpsat_proves_greedy_optimal_on_the_bench_fault_free_4x4x8():
    # Instance.lower_bound (30 ms, the last stage's work) cannot prove this plan optimal;
    # the chain bound (stage 0 waits for 8 microbatches through stage 3 and back) can.
    inst = bench_explicit(gpu_memory=1 << 40)
    schedule = solve(inst, FAST)
    assert inst.lower_bound == 30_000
    assert schedule.solver.status == "optimal"
    assert schedule.solver.bound == simulate(schedule).iteration_time == 34_752


# -- infeasibility (golden) -------------------------------------------------------

INFEASIBLE = {
    "memory_one_stage": dict(dp=2, pp=3, microbatches=4, activation=[1 << 30, 6 << 30, 1 << 30],
                             static=[2 << 30, 6 << 30, 2 << 30], gpu_memory=10 << 30),
    "memory_static_alone": dict(dp=1, pp=2, microbatches=2, activation=1 << 30,
                                static=[4 << 30, 12 << 30], gpu_memory=8 << 30),
    "lost_stage": dict(dp=2, pp=2, microbatches=4, failed=[(0, 1), (1, 1)]),
}


@pytest.mark.parametrize("name", sorted(INFEASIBLE))
def test_infeasibility_is_explained(name):
    inst = make_instance(**INFEASIBLE[name])
    with pytest.raises(InfeasibleError) as exc:
        solve(inst, FAST)
    text = exc.value.render() + "\n"
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("SCHEDC_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert all(code.startswith("E3") for code in exc.value.codes)


def test_feasible_instances_pass_the_check():
    check_feasible(make_instance(2, 2, 2, activation=1 << 30, static=7 << 30, gpu_memory=8 << 30))


def test_a_search_the_deadline_cuts_short_says_so(monkeypatch, cpsat_runs):
    """Without a deadline CP-SAT stops only on its work budget; with one (a launcher's replan) it
    also stops there, returns the best plan found by then, and records that the deadline, not
    the work, decided it (so a launcher knows a rerun may differ). How close to the deadline the
    call returns is measured by `bench/replan_latency.py`, not asserted here: load stretches it."""
    import schedc.solvers.cpsat as cpsat

    monkeypatch.setattr(cpsat, "deterministic_budget", lambda *_: 1e6)  # the work budget is never reached
    # The bench's explicit 4 x 4 x 8 costs with two slow GPUs: greedy's 39.122 ms is above the
    # proven 37.652 ms, so CP-SAT runs.
    inst = bench_explicit(slow={(1, 0): 0.5, (1, 3): 0.6})
    warm_up()
    greedy = get_solver("greedy")(inst, SolveOptions(time_limit=0.6))
    # The seed is planned before the clock starts, so that however slow a loaded machine is,
    # the deadline falls in CP-SAT's search (not in greedy's, which has its own test), and the
    # deadline is far enough for the model to be built first.
    monkeypatch.setattr(cpsat, "_seeds", lambda *_: ([greedy], False, 0.0))
    began = time.monotonic()
    plan = cpsat.solve(inst, SolveOptions(time_limit=0.6, deadline=began + 5.0))
    # The search was given a wall limit inside the deadline, and ended before its work budget.
    (run,) = cpsat_runs
    assert run["max_wall"] < 5.0 and run["det"] < run["max_det"], run
    assert plan.solver.stopped_by == "deadline", plan.solver
    assert "deadline" in plan.solver.detail, plan.solver.detail
    verify_schedule(plan)
    assert cpsat.iteration_time(plan) <= cpsat.iteration_time(greedy)


def test_cpsat_bound_is_claimed_only_for_the_whole_instance():
    """With pipelines fixed to the seed the model is a restricted problem: its optimum may lie
    above the instance's, so its bound is no bound on every schedule and is not reported."""
    import schedc.solvers.cpsat as cpsat

    inst = make_instance(6, 2, 2, failed=[(0, 1)])
    seed = get_solver("greedy")(inst, FAST)
    # The failed GPU's two microbatches run on pipelines 1 and 2: those three stay free.
    assert {inst.gpu_of_rank(op.rank).dp for op in seed.ops if op.dp == 0 and op.pp == 1} == {1, 2}
    lb = period_lower_bound(inst)
    whole = cpsat._solve_model(inst, seed, set(range(inst.dp)), FAST, None, lb)
    part = cpsat._solve_model(inst, seed, {0, 1, 2}, FAST, None, lb)
    assert whole.schedule is not None and part.schedule is not None
    assert whole.bound is not None and whole.bound <= simulate(seed).iteration_time
    assert part.bound is None
    inst = bench_explicit(slow={(1, 0): 0.5, (1, 3): 0.6})
    seed = get_solver("greedy")(inst, FAST)
    # Symmetry cuts only where relabelling microbatches loses no schedule: pipelines whose
    # every stage has one executor (here 0, 2 and 3, not the slow GPUs' pipeline 1).
    cuts = cpsat._forward_order_cuts(inst, seed, set(range(inst.dp)))
    assert {a.dp for a, _ in cuts} == {0, 2, 3}


def test_or_tools_counts_as_loaded_only_once_its_import_has_finished(monkeypatch, tmp_path):
    """A replan while `warm_up_in_background` is still importing must not use the half-imported
    module (it would wait for the import): `loaded` says no until the import is done."""
    import builtins
    import sys
    import threading

    import schedc.solvers.cpsat as cpsat

    name = "schedc_test_slow_import"
    (tmp_path / f"{name}.py").write_text("import builtins\nbuiltins._schedc_test_gate.wait(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cpsat, "_CP_MODEL", name)
    gate = threading.Event()
    monkeypatch.setattr(builtins, "_schedc_test_gate", gate, raising=False)
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert not cpsat.loaded()
    thread = cpsat.warm_up_in_background()
    try:
        for _ in range(6000):  # until the import has begun (the module is in sys.modules)
            if name in sys.modules:
                break
            thread.join(0.01)
        assert name in sys.modules and not cpsat.loaded()
    finally:
        gate.set()
        thread.join(60)
    assert not thread.is_alive() and cpsat.loaded()
    monkeypatch.delitem(sys.modules, name)


@given(instances(max_dp=3, max_pp=3, max_microbatches=4, failures=False))
def test_retime_times_the_old_programs_as_the_engine_would_or_refuses(instance):
    """`retime` (the previous plan as a seed) checks and encodes the ops in one pass: where the
    programs still fit it gives exactly `schedule_from_programs` of them, a verified schedule
    within memory; after a failure of a GPU that ran ops, or a changed shape, None."""
    from dataclasses import replace

    from schedc.schedule import SolverInfo
    from schedc.simulate_engine import schedule_from_programs
    from schedc.solvers.cpsat import retime
    from schedc.verify import memory_profile

    old = get_solver("greedy")(instance, SolveOptions(time_limit=0.01))
    info = SolverInfo(name="cpsat", detail="warm start")
    g = instance.gpus[-1]
    slowed = replace(instance, gpus=tuple(replace(x, speed=0.5) if x is g else x for x in instance.gpus))
    got = retime(slowed, old, info)
    programs = {r: [op.id for op in ops] for r, ops in old.programs.items()}
    want = schedule_from_programs(slowed, programs, info)
    fits = all(memory_profile(slowed, r, ops).peak <= slowed.gpu_memory for r, ops in want.programs.items())
    if not fits:
        assert got is None
    else:
        assert got is not None and got.ops == want.ops
        verify_schedule(got)
    if any(ops for r, ops in old.programs.items() if r == g.rank) and len(instance.live_gpus(g.pp)) > 1:
        failed = replace(instance, gpus=tuple(replace(x, state="failed") if x is g else x for x in instance.gpus))
        assert retime(failed, old, info) is None
    if instance.microbatches > 1:
        assert retime(replace(instance, microbatches=instance.microbatches - 1), old, info) is None
