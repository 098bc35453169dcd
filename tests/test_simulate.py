"""The simulator: closed forms, steady state, metrics, and properties over random instances."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from strategies import instances
from test_verify import gpipe_programs, hand_schedule, one_f_one_b_programs

from schedc.diagnostics import InfeasibleError
from schedc.instance import make_instance
from schedc.schedule import OpId, Schedule, ScheduledOp
from schedc.simulate import metrics_of, simulate, steady_period
from schedc.simulate_engine import DeadlockError
from schedc.verify import verify_schedule

F, B_FULL, O = 1000, 2000, 300


def uniform(dp=1, pp=4, mbs=8, **kw):
    args = dict(forward=F, backward_input=B_FULL // 2, backward_weight=B_FULL // 2, optimizer=O,
                decouple_backward=False, stagger_optimizer=True)
    args.update(kw)
    return make_instance(dp, pp, mbs, **args)


@pytest.mark.parametrize("programs", [one_f_one_b_programs, gpipe_programs])
@pytest.mark.parametrize("dp,pp,mbs", [(1, 4, 8), (2, 3, 5), (1, 1, 3), (3, 2, 1)])
def test_closed_form_hand_written(programs, dp, pp, mbs):
    inst = uniform(dp, pp, mbs)
    sim = simulate(hand_schedule(inst, programs))
    assert sim.iteration_time == (mbs + pp - 1) * (F + B_FULL) + O


def _solver(name):
    """A registered solver: one that is missing or fails to import fails the test, not skips it."""
    from schedc.solvers import SolveOptions, get_solver

    return get_solver(name), SolveOptions()


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("dp,pp,mbs", [(1, 4, 8), (2, 4, 6), (1, 2, 2)])
def test_closed_form_solvers(name, dp, pp, mbs):
    solve, options = _solver(name)
    sched = solve(uniform(dp, pp, mbs), options)
    verify_schedule(sched)
    assert simulate(sched).iteration_time == (mbs + pp - 1) * (F + B_FULL) + O


def test_zb_h1_bubble_is_about_a_third_of_1f1b():
    inst = make_instance(1, 4, 12, forward=1000, backward_input=1000, backward_weight=1000, optimizer=0)
    ref_inst = replace(inst, decouple_backward=False)
    zb, opts = _solver("zb-h1")
    ofob, _ = _solver("1f1b")
    zb_sched, ref_sched = zb(inst, opts), ofob(ref_inst, opts)
    verify_schedule(zb_sched)
    verify_schedule(ref_sched)
    work = 12 * 3000  # per GPU and iteration
    bubble_zb = simulate(zb_sched).iteration_time - work
    bubble_ref = simulate(ref_sched).iteration_time - work
    assert bubble_ref == 3 * 3000  # (p - 1)(F + B + W)
    assert bubble_ref / 3 - 500 <= bubble_zb <= bubble_ref / 3 + 500


def test_metrics_busy_bubble_memory_and_lower_bound():
    inst = uniform(2, 3, 4, activation=1 << 20, stash=0, static=1 << 10)
    sched = hand_schedule(inst, gpipe_programs)
    m = metrics_of(sched)
    it = m.iteration_time
    busy = 4 * (F + B_FULL) + O
    assert all(v == busy for v in m.busy_time.values())
    assert all(v == pytest.approx(1 - busy / it) for v in m.bubble_ratio.values())
    assert all(v == (1 << 10) + 4 * (1 << 20) for v in m.peak_memory.values())  # GPipe holds all 4
    assert m.lower_bound == inst.lower_bound == (2 * 4 * (F + B_FULL) + 2 * O) / 2
    assert m.ratio_to_lower_bound == pytest.approx(it / inst.lower_bound)
    j = m.to_json()
    assert j["peak_memory"]["0"] == (1 << 10) + 4 * (1 << 20) and j["solver"]["name"] == "hand"


def test_steady_period_uses_the_last_window():
    assert steady_period((100, 150, 300, 400, 500, 600, 700, 800)) == 100
    assert steady_period((100, 201)) == 101
    assert steady_period((7,)) == 7
    assert steady_period((0, 10, 21, 33, 46, 59)) == -(-(59 - 10) // 4)


def test_iterations_overlap_across_stages():
    # Without a global barrier, stage 0 starts the next iteration while the last stage still works,
    # so the period is shorter than one iteration's makespan.
    inst = uniform(1, 4, 2, forward=[1000, 1000, 1000, 3000], optimizer=0)
    sched = hand_schedule(inst, one_f_one_b_programs)
    assert simulate(sched).iteration_time <= sched.makespan


def test_deadlock_is_reported():
    # Rank 0 runs B before F of the same microbatch: B waits for stage 1, which waits for that F.
    inst = uniform(1, 2, 1)
    progs = {0: [OpId("B", 0, 0, 0), OpId("F", 0, 0, 0), OpId("O", 0, 0)],
             1: [OpId("F", 0, 1, 0), OpId("B", 0, 1, 0), OpId("O", 0, 1)]}
    ops = tuple(ScheduledOp(rank=r, kind=o.kind, dp=o.dp, pp=o.pp, mb=o.mb, start=10 * i, end=10 * i + 5)
                for r, prog in progs.items() for i, o in enumerate(prog))
    with pytest.raises(DeadlockError) as exc:
        simulate(Schedule(instance=inst, ops=ops))
    assert exc.value.codes == ["E420"]


# -- properties over random instances --------------------------------------------------

BASELINES = ["1f1b", "gpipe", "zb-h1", "greedy", "reroute-1f1b", "drop-pipeline", "redundant"]


def test_every_baseline_is_registered_and_loads():
    """Each of BASELINES imports: one that does not is a failure here, not a silently smaller
    parametrization below."""
    from schedc.solvers import get_solver, solver_names

    assert set(BASELINES) <= set(solver_names())
    for name in BASELINES:
        assert callable(get_solver(name)), name


@pytest.mark.parametrize("name", BASELINES)
@given(inst=instances())
def test_baselines_verify_and_respect_bounds(name, inst):
    from schedc.solvers import SolveOptions, get_solver
    try:
        sched = get_solver(name)(inst, SolveOptions(time_limit=1.0))
    except InfeasibleError:
        return
    verify_schedule(sched)
    sim = simulate(sched)
    assert sim.iteration_time >= sched.instance.lower_bound - 1e-6
    assert sim.iteration_time <= sched.makespan
    assert all(0.0 <= b <= 1.0 for b in sim.bubble_ratio.values())
    assert all(p <= sched.instance.gpu_memory for p in sim.peak_memory.values())


@given(inst=instances(failures=False))
def test_hand_written_1f1b_is_valid_and_bounded(inst):
    sched = hand_schedule(inst, one_f_one_b_programs)
    try:
        verify_schedule(sched)
    except Exception as exc:  # only memory may fail: the hand-written order ignores the limit
        assert set(exc.codes) == {"E406"}
        return
    sim = simulate(sched)
    assert inst.lower_bound - 1e-6 <= sim.iteration_time <= sched.makespan
