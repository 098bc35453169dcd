"""The program runner against a naive reference written straight from docs/architecture.md."""

from __future__ import annotations

import pytest
from hypothesis import given
from strategies import instances

from schedc.diagnostics import InfeasibleError
from schedc.instance import Instance, make_instance
from schedc.opgraph import data_deps, last_backward_kind, optimizer_waits_for
from schedc.schedule import OpId, SolverInfo
from schedc.solvers import SolveOptions, get_solver
from schedc.simulate_engine import STEADY_ITERATIONS, DeadlockError, run_programs, schedule_from_programs, steady_period


def reference_iteration_ends(inst: Instance, programs: dict[int, list[OpId]], iterations: int) -> list[int]:
    """Relax start times to a fixed point, one iteration at a time: slow, obviously right."""
    executor = {op: r for r, prog in programs.items() for op in prog}
    gpu_ready = {r: 0 for r in programs}
    ends = []
    for _ in range(iterations):
        end: dict[OpId, int] = {}
        changed = True
        while changed:
            changed = False
            for r, prog in programs.items():
                t_prev = gpu_ready[r]
                for op in prog:
                    if op.kind == "O":
                        kind = last_backward_kind(inst)
                        deps = [(OpId(kind, d, s, m), 0) for s in optimizer_waits_for(inst, op.pp)
                                for d in range(inst.dp) for m in range(inst.microbatches)]
                    else:
                        deps = [(dep.op, dep.delay) for dep in data_deps(inst, op)]
                    if any(dep not in end for dep, _ in deps) or t_prev is None:
                        t_prev = None
                        continue
                    start = max([t_prev] + [end[dep] + delay for dep, delay in deps])
                    new_end = start + inst.duration(op.kind, op.pp, executor[op])
                    if end.get(op) != new_end:
                        end[op] = new_end
                        changed = True
                    t_prev = new_end
        assert len(end) == len(executor), "reference deadlocked"
        for r, prog in programs.items():
            gpu_ready[r] = max((end[op] for op in prog), default=gpu_ready[r])
        ends.append(max(end.values()))
    return ends


@given(inst=instances())
def test_runner_matches_the_reference(inst):
    try:
        # Any valid programs do; greedy's local search (a 5 s budget by default) adds nothing here.
        sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    except InfeasibleError:
        return
    programs = {r: [op.id for op in prog] for r, prog in sched.programs.items()}
    got = run_programs(inst, programs, iterations=STEADY_ITERATIONS).iteration_end
    assert list(got) == reference_iteration_ends(inst, programs, STEADY_ITERATIONS)


def test_one_f_one_b_closed_form():
    # (M + S - 1)(F + B) + O with uniform stages and no transfer time.
    inst = make_instance(1, 2, 2, decouple_backward=False, optimizer=100)
    F = lambda s, m: OpId("F", 0, s, m)  # noqa: E731
    B = lambda s, m: OpId("B", 0, s, m)  # noqa: E731
    progs = {0: [F(0, 0), F(0, 1), B(0, 0), B(0, 1), OpId("O", 0, 0)],
             1: [F(1, 0), B(1, 0), F(1, 1), B(1, 1), OpId("O", 0, 1)]}
    run = run_programs(inst, progs, iterations=4)
    assert run.iteration_end == (9100, 18200, 27300, 36400)
    assert steady_period(run.iteration_end) == 9100
    sched = schedule_from_programs(inst, progs, SolverInfo("hand"))
    assert {(str(o), o.start, o.end) for o in sched.ops if o.rank == 1} == {
        ("d0:1F0", 1000, 2000), ("d0:1B0", 2000, 4000), ("d0:1F1", 4000, 5000),
        ("d0:1B1", 5000, 7000), ("d0:1O", 7000, 7100)}


def test_deadlock_names_each_stuck_rank():
    inst = make_instance(1, 2, 1, decouple_backward=False)
    progs = {0: [OpId("B", 0, 0, 0), OpId("F", 0, 0, 0)], 1: [OpId("F", 0, 1, 0), OpId("B", 0, 1, 0)]}
    with pytest.raises(DeadlockError) as exc:
        run_programs(inst, progs)
    text = exc.value.render()
    assert "E420" in text
    assert "rank 0 step 0: d0:0B0 waits for d0:1B0 on rank 1" in text
    assert "rank 1 step 0: d0:1F0 waits for d0:0F0 on rank 0" in text


def test_missing_and_duplicate_ops_are_reported():
    inst = make_instance(1, 2, 1, decouple_backward=False)
    with pytest.raises(DeadlockError) as exc:
        run_programs(inst, {0: [OpId("F", 0, 0, 0), OpId("B", 0, 0, 0)], 1: [OpId("B", 0, 1, 0)]})
    assert "d0:1B0 on rank 1 waits for d0:1F0, which no rank runs" in exc.value.render()
    with pytest.raises(DeadlockError) as exc:
        run_programs(inst, {0: [OpId("F", 0, 0, 0), OpId("B", 0, 0, 0)],
                            1: [OpId("F", 0, 1, 0), OpId("B", 0, 1, 0), OpId("F", 0, 1, 0)]})
    assert exc.value.codes == ["E421"]


@given(inst=instances())
def test_a_planners_schedule_simulates_as_the_same_ops_read_back(inst):
    """`simulate` runs a planner's schedule on the graph that made it (`graph_of`: the very ops
    tuple of `scheduled_ops`), with its memory peaks from the op codes (`ProgramGraph.peaks`),
    and `cpsat.span_bound` reads each rank's span off that graph: every figure is what the
    same ops in a tuple of their own (as loaded from schedule.json: no graph known) give."""
    from schedc.schedule import Schedule, ScheduledOp, scheduled_op
    from schedc.simulate import simulate
    from schedc.simulate_engine import graph_of
    from schedc.solvers.cpsat import span_bound

    try:
        sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    except InfeasibleError:
        return
    assert graph_of(sched) is not None
    copy = Schedule(instance=inst, ops=tuple(ScheduledOp(**vars(op)) for op in sched.ops), solver=sched.solver)
    assert graph_of(copy) is None and copy.ops == sched.ops
    fast, slow = simulate(sched), simulate(copy)
    assert (fast.iteration_time, fast.iteration_end) == (slow.iteration_time, slow.iteration_end)
    assert dict(fast.busy_time) == dict(slow.busy_time)
    assert dict(fast.peak_memory) == dict(slow.peak_memory)
    assert span_bound(sched) == span_bound(copy)
    op = sched.ops[0]
    made = scheduled_op(op.rank, op.kind, op.dp, op.pp, op.mb, op.start, op.end)
    assert made == op and hash(made) == hash(op) and repr(made) == repr(op)


def test_a_graph_keeps_a_run_per_number_of_iterations():
    """One iteration (a planner's schedule) and K (its period, the simulator's run) are kept
    side by side: asking for one does not replace the other, and the copies given out are
    the caller's to change."""
    from schedc.simulate_engine import program_graph

    inst = make_instance(2, 3, 4)
    sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    graph = program_graph(inst, {r: [op.id for op in prog] for r, prog in sched.programs.items()})
    k_end, k_ends = graph.run(STEADY_ITERATIONS)
    one_end, _ = graph.run(1)
    k_end[0] = one_end[0] = -1
    assert graph.run(STEADY_ITERATIONS) == graph._run(STEADY_ITERATIONS, None)
    assert graph.run(1) == graph._run(1, None)
    assert set(graph._runs) == {1, STEADY_ITERATIONS}


def test_a_schedule_with_ops_that_start_together_is_simulated_from_its_own_order():
    """Zero-length W ops start when the next op does: the schedule's program order then breaks
    the tie by end and op id (`Schedule.programs`), which need not be the planner's, so
    `graph_of` gives no graph for it and `simulate` runs the schedule's own order."""
    from schedc.simulate import simulate
    from schedc.simulate_engine import graph_of

    inst = make_instance(2, 3, 4, backward_weight=0, optimizer=100)
    sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    starts = [[op.start for op in prog] for prog in sched.programs.values()]
    assert any(len(set(s)) < len(s) for s in starts)  # the case this test is about
    assert graph_of(sched) is None
    programs = {r: [op.id for op in prog] for r, prog in sched.programs.items()}
    assert simulate(sched).iteration_end == run_programs(inst, programs, STEADY_ITERATIONS).iteration_end


@given(inst=instances())
def test_a_run_that_repeats_itself_is_extended_by_its_shift_exactly(inst):
    """Once every O ends exactly P later than in the iteration before, a run without history
    adds P per iteration instead of running the ops: every end of the last iteration and every
    iteration's end are those of running all of them op by op (a run with history)."""
    from schedc.simulate_engine import program_graph

    try:
        sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    except InfeasibleError:
        return
    programs = {r: [op.id for op in prog] for r, prog in sched.programs.items()}
    graph = program_graph(inst, programs)
    for k in (1, 2, 3, STEADY_ITERATIONS, 2 * STEADY_ITERATIONS):
        history: list[list[int]] = []
        assert graph._run(k, None) == graph._run(k, history)


def _settles(graph, iterations: int) -> tuple[int, int] | None:
    """(k, c): the first iteration k whose O ends are all iteration k - c's plus one constant
    (c = 1 or 2), read off a run with history, or None."""
    history: list[list[int]] = []
    graph._run(iterations, history)
    o_ends = [[h[o] for o in graph.o_nodes] for h in history]
    for k in range(1, iterations):
        for c in (1, 2):
            if k >= c and len({a - b for a, b in zip(o_ends[k], o_ends[k - c])}) == 1:
                return k, c
    return None


@pytest.mark.parametrize("cycle, shape", [(1, (3, 3, 6)), (2, (8, 4, 16))])
def test_the_shift_is_taken_where_a_plan_settles_early_and_a_failed_gpu_has_no_o(cycle, shape):
    """The cases the shortcut is for: a plan whose O ends repeat with a constant shift every
    iteration (c = 1), or every second one (c = 2: the bench's 8 x 4 cluster with a failed GPU
    alternates between two iterations), before its last iteration; on a cluster with a failed
    GPU, whose O node no iteration computes, so it stays at 0 in the shifted ends too."""
    from schedc.bench.scenarios import Scenario
    from schedc.events import apply_events
    from schedc.instance import from_spec
    from schedc.load import load
    from schedc.simulate_engine import program_graph

    dp, pp, mb = shape
    inst = from_spec(apply_events(load(Scenario("s", "explicit", dp, pp, mb).spec_text()), "fail gpu(dp=1, pp=1)"))
    sched = get_solver("greedy")(inst, SolveOptions(time_limit=0.01))
    graph = program_graph(inst, {r: [op.id for op in prog] for r, prog in sched.programs.items()})
    iterations = 2 * STEADY_ITERATIONS
    settled = _settles(graph, iterations)
    assert settled is not None and settled[1] == cycle and settled[0] < iterations - 2, settled
    assert len(graph.o_nodes) < len(inst.gpus)  # a GPU has no O
    for k in (STEADY_ITERATIONS, iterations, iterations + 1):
        assert graph._run(k, None) == graph._run(k, [])
