"""`schedc.replan`: verified, deterministic plans within the deadline after any event sequence."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings, strategies as st

import schedc
from schedc.diagnostics import InfeasibleError, SchedcError, SpecError
from schedc.plan import compile
from schedc.solvers.cpsat import warm_up
from schedc.verify import verify_schedule

SPEC = """
cluster {
    dp = 3  pp = 3  gpus_per_node = 3
    gpu { memory = 8GiB }
    link { latency = 10us  bandwidth = 10GB/s }
}
stages {
    all {
        forward = 1ms  backward_input = 1ms  backward_weight = 0.5ms  optimizer = 0.2ms
        activation = 512MiB  stash = 128MiB  static = 2GiB  send = 8MiB
    }
}
train { microbatches = 6 }
"""

replan_module = importlib.import_module("schedc.replan")  # (`schedc.replan` is the function)
DEADLINE = 0.3
#: A deadline no replan here comes near.
NEVER = 60.0
#: The work budget (`SolveOptions.time_limit`) each replan without a deadline gets here: about
#: what a 0.3 s deadline buys (`replan.work_budget(0.3)`), so the tests stay quick.
WORK = 0.05


@pytest.fixture(scope="module")
def plan():
    warm_up()
    return compile(schedc.load(SPEC), time_limit=0.5)


gpus = st.tuples(st.integers(0, 2), st.integers(0, 2))
events = st.one_of(
    gpus.map(lambda g: f"fail gpu(dp={g[0]}, pp={g[1]})"),
    st.tuples(gpus, st.sampled_from(["0.5", "0.6", "0.8"])).map(
        lambda x: f"slow gpu(dp={x[0][0]}, pp={x[0][1]}) speed = {x[1]}"),
    gpus.map(lambda g: f"recover gpu(dp={g[0]}, pp={g[1]})"),
    st.integers(0, 2).map(lambda n: f"fail node {n}"),
)


# Each example runs the planner twice per event (each CP-SAT solve loads its model for up to a
# second): keep the count modest even under the CI profile, or this one test would take minutes.
@pytest.mark.slow
@settings(max_examples=min(settings().max_examples, 20))
@given(st.lists(events, min_size=1, max_size=3))
def test_replan_after_any_events_is_verified_and_deterministic(plan, evs):
    """Determinism is a property of searches the work budget ends (`SolverInfo.stopped_by ==
    "work"`); one a wall-clock deadline cuts short may differ from run to run by design, so the
    deadline's effect has its own test below, and how long a replan takes is
    `bench/replan_latency.py`'s to measure."""
    current = plan
    for ev in evs:
        try:
            nxt = schedc.replan(current, ev, deadline=None, time_limit=WORK)
        except SpecError as exc:
            # Events a launcher may get wrong: recovering a healthy GPU, slowing a dead one,
            # losing a stage's last replica (E301, which is also an InfeasibleError).
            assert set(exc.codes) <= {"E208", "E216", "E301"}, exc.render()
            continue
        verify_schedule(nxt.schedule)
        assert nxt.schedule.solver.stopped_by == "work", nxt.schedule.solver
        again = schedc.replan(current, ev, deadline=None, time_limit=WORK)
        assert again.schedule.ops == nxt.schedule.ops
        assert nxt.metrics.iteration_time >= nxt.metrics.lower_bound - 1
        current = nxt


@pytest.mark.parametrize("event", ["fail node 0", "fail gpu(dp=1, pp=1)", "slow gpu(dp=1, pp=1) speed = 0.6"])
def test_a_deadline_that_cuts_the_search_short_still_gives_a_verified_plan_that_says_so(plan, event):
    """A deadline too short for any search (it has passed before the solver starts, however
    fast the machine): the answer is still a verified plan, and it says that the deadline, not
    the work, decided it, so a launcher knows a rerun may give another plan."""
    new = schedc.replan(plan, event, deadline=1e-3)
    verify_schedule(new.schedule)
    assert new.schedule.solver.stopped_by == "deadline", new.schedule.solver
    assert new.metrics.iteration_time >= new.metrics.lower_bound - 1
    # With time to spare the same event is planned by the work budget.
    assert schedc.replan(plan, event, deadline=None, time_limit=WORK).schedule.solver.stopped_by == "work"


@pytest.mark.parametrize("event", ["fail gpu(dp=1, pp=1)", "slow gpu(dp=1, pp=1) speed = 0.6"])
def test_a_deadline_that_passes_during_the_first_candidate_gives_that_plan_verified(plan, event):
    """A fake clock that jumps past the deadline while greedy list-schedules its first
    candidate (a machine that stalled the call), under a deadline no real replan here comes
    near: every step after it sees no time left (the other candidates, the local search, the
    previous plan's re-timing, CP-SAT), and what comes back is that first plan, verified and
    simulated, saying that the deadline decided it (or optimal, which no search could beat).
    Without the jump the same call ends on its work budget."""
    import time

    import schedc.solvers.greedy as greedy

    real_clock, real_schedule = time.monotonic, greedy.list_schedule
    jumped = [0.0]

    def clock() -> float:
        return real_clock() + jumped[0]

    def stalled(*args, **kwargs):
        jumped[0] = 10 * NEVER
        return real_schedule(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", clock)
        mp.setattr(greedy, "list_schedule", stalled)
        new = schedc.replan(plan, event, deadline=NEVER)
    assert jumped[0] > 0  # the first candidate did run
    verify_schedule(new.schedule)
    info = new.schedule.solver
    assert info.stopped_by == "deadline" or info.status == "optimal", info
    assert info.detail.startswith("greedy"), info  # greedy's plan: neither CP-SAT's nor the old one
    assert new.metrics.iteration_time >= new.metrics.lower_bound - 1
    assert schedc.replan(plan, event, deadline=None, time_limit=WORK).schedule.solver.stopped_by == "work"


def test_a_plan_proven_optimal_is_not_blamed_on_the_deadline(plan):
    """Greedy's first plan meets the lower bound here: no search could do better, so even under
    a deadline that cut everything short the plan is the work's (the same on any rerun)."""
    new = schedc.replan(plan, "fail gpu(dp=0, pp=0)", deadline=1e-3)
    verify_schedule(new.schedule)
    assert new.schedule.solver.status == "optimal" and new.schedule.solver.stopped_by == "work"


def test_replan_updates_the_spec(plan):
    new = schedc.replan(plan, ["fail gpu(dp=1, pp=2)", "slow gpu(dp=0, pp=0) speed = 0.5"])
    assert not new.spec.gpu(1, 2).live
    assert new.spec.gpu(0, 0).speed == 0.5
    assert all(op.rank != new.spec.gpu(1, 2).rank for op in new.schedule.ops)
    assert new.metrics.fault_free_iteration_time == plan.metrics.fault_free_iteration_time
    back = schedc.replan(new, "recover gpu(dp=1, pp=2)")
    assert back.spec.gpu(1, 2).live
    # The printed spec loads back to the same spec: what a launcher keeps with the job.
    assert schedc.load(schedc.print_spec(back.spec)) == back.spec


def test_slow_at_speed_one_is_full_speed_so_a_recover_after_it_is_e216(plan):
    """`speed = 1.0` is full speed: the GPU is no longer slow (no `slow` line stays, every GPU
    runs at speed 1), and `recover` of it finds nothing to recover (E216), whether the two
    events come in two replans or in one list (there the diagnostic points at the slow line)."""
    slow, recover = "slow gpu(dp=1, pp=1) speed = 1.0", "recover gpu(dp=1, pp=1)"
    full = schedc.replan(plan, slow)
    assert full.spec.failures == () and all(g.live and g.speed == 1.0 for g in full.spec.gpus)
    assert full.instance.fault_free and not full.instance.slow_gpus
    with pytest.raises(SpecError) as exc:
        schedc.replan(full, recover)
    assert exc.value.codes == ["E216"], exc.value.render()
    assert "`slow ... speed = 1.0` is full speed" in exc.value.diagnostics[0].hint
    with pytest.raises(SpecError) as exc:
        schedc.replan(plan, [slow, recover])
    (d,) = exc.value.diagnostics
    assert d.code == "E216" and "already put this one back at full speed" in d.hint
    assert [n.message for n in d.notes] == ["`speed = 1.0` is full speed: the GPU is not slow from here on"]
    assert "1 | slow gpu(dp=1, pp=1) speed = 1.0" in exc.value.render()
    # Slowed below full speed, then back to it: the slowness ends as a `recover` would end it.
    back = schedc.replan(schedc.replan(plan, "slow gpu(dp=1, pp=1) speed = 0.5"), slow)
    assert back.spec.failures == () and back.spec.gpu(1, 1).speed == 1.0


def test_replan_reports_a_lost_stage(plan):
    with pytest.raises(InfeasibleError) as exc:
        schedc.replan(plan, ["fail gpu(dp=0, pp=1)", "fail gpu(dp=1, pp=1)", "fail gpu(dp=2, pp=1)"])
    assert "E301" in exc.value.codes
    assert "checkpoint" in exc.value.render()


def test_replan_rejects_bad_events(plan):
    with pytest.raises(SchedcError):
        schedc.replan(plan, "explode gpu(dp=0, pp=0)")


def test_replan_warm_starts_from_a_slowdown(plan):
    # After a slowdown every executor is still live: the old programs re-timed are a seed.
    new = schedc.replan(plan, "slow gpu(dp=2, pp=1) speed = 0.8")
    verify_schedule(new.schedule)
    assert new.metrics.iteration_time <= plan.metrics.iteration_time / 0.8 + 1


@pytest.mark.parametrize("enabled", [True, False])
def test_replan_leaves_the_garbage_collector_as_it_found_it(plan, enabled):
    import gc

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        schedc.replan(plan, "fail gpu(dp=0, pp=1)", deadline=0.3)
        assert gc.isenabled() is enabled
        with pytest.raises(SchedcError):
            schedc.replan(plan, "fail gpu(dp=9, pp=1)", deadline=0.3)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_replan_says_which_ranks_programs_changed(plan):
    """`Plan.changed_ranks`: a rank outside it runs exactly the op sequence it ran before (and
    talks to the same peers); the failed rank and its stage's peers (whose all-reduce group
    shrank) are in it; a compiled plan has none."""
    assert plan.changed_ranks is None
    new = schedc.replan(plan, "fail gpu(dp=1, pp=1)", deadline=DEADLINE)
    failed = plan.instance.gpu(1, 1).rank
    stage_peers = {g.rank for g in plan.instance.gpus if g.pp == 1}
    assert failed in new.changed_ranks and stage_peers <= new.changed_ranks
    old_progs = {r: [op.id for op in ops] for r, ops in plan.schedule.programs.items()}
    new_progs = {r: [op.id for op in ops] for r, ops in new.schedule.programs.items()}
    for r in set(old_progs) | set(new_progs):
        if r not in new.changed_ranks:
            assert old_progs.get(r) == new_progs.get(r), r
    from schedc.program_diff import changed_ranks

    assert changed_ranks(new.schedule, new.schedule) == frozenset()
    # The recovered GPU is back in the plan, so it changed again.
    back = schedc.replan(new, "recover gpu(dp=1, pp=1)", deadline=DEADLINE)
    assert failed in back.changed_ranks


def test_the_reserve_grows_on_a_busy_machine():
    """`_slowdown`: a call whose thread got little CPU over its wall time (a busy machine: here, a
    window of 10 s in which this thread did not run) is that much slower, up to `_MAX_SLOWDOWN`,
    and the checks' reserve is scaled by it; a window too short to tell falls back on the load
    average per core, within the same limits."""
    import time

    now, cpu = time.monotonic(), time.thread_time()
    assert replan_module._slowdown((now - 10.0, cpu)) == replan_module._MAX_SLOWDOWN
    assert replan_module._slowdown((now - 10.0, cpu - 5.0)) == pytest.approx(2.0, rel=0.01)
    assert 1.0 <= replan_module._slowdown((time.monotonic(), time.thread_time())) <= replan_module._MAX_SLOWDOWN


def test_a_typo_in_an_event_reads_as_the_cli_would_print_it(plan):
    """A library caller's traceback shows the caret and the suggestion, not only the code
    (`schedc train --inject` printed both; `schedc.replan` said `E102 unknown statement`)."""
    with pytest.raises(SpecError) as exc:
        schedc.replan(plan, "fial gpu(dp=0, pp=0)")
    assert str(exc.value) == exc.value.render()
    assert str(exc.value).splitlines() == [
        "error[E102]: unknown statement `fial`",
        " --> <event>:1:1",
        "  |",
        "1 | fial gpu(dp=0, pp=0)",
        "  | ^^^^ did you mean `fail`?",
        "  = hint: statements start with `fail`, `slow` or `recover`",
    ]
    assert exc.value.args[0] == "error[E102]: unknown statement `fial`"  # the one-line summary
