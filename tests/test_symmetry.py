"""Symmetric plans (schedc.symmetry, schedc.decompose): a cluster planned by classes of alike
pipelines is the same schedule as its expansion op by op, for the verifier, the simulator, the
schedule file, `changed_ranks`, the exports and the generated programs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schedc.decompose import decompose, plan_by_classes
from schedc.instance import make_instance
from schedc.schedule import Schedule
from schedc.simulate import metrics_of, simulate
from schedc.solvers import SolveOptions, get_solver
from schedc.symmetry import Layout, PipelineClass, SymmetricSchedule
from schedc.verify import check_schedule, verify_schedule


@st.composite
def symmetric_cases(draw):
    """A random cluster with a few faulty pipelines among untouched ones, planned by classes."""
    dp = draw(st.integers(4, 10))
    pp = draw(st.integers(1, 3))
    mb = draw(st.integers(1, 3))
    places = [(d, s) for d in range(dp) for s in range(pp)]
    failed = draw(st.lists(st.sampled_from(places), max_size=2, unique=True))
    slow_at = draw(st.lists(st.sampled_from(places), max_size=1, unique=True))
    slow = {p: draw(st.sampled_from([0.5, 0.7])) for p in slow_at if p not in failed}
    assume(all(sum(1 for d, t in failed if t == s) < dp for s in range(pp)))
    inst = make_instance(
        dp, pp, mb, failed=failed, slow=slow,
        forward=draw(st.integers(1, 4)) * 500, backward_input=draw(st.integers(1, 4)) * 500,
        backward_weight=draw(st.integers(1, 4)) * 500, optimizer=draw(st.integers(0, 3)) * 200,
        latency=draw(st.integers(0, 50)), decouple_backward=draw(st.booleans()),
        stagger_optimizer=draw(st.booleans()))
    dec = decompose(inst, helpers=draw(st.integers(1, 2)))
    assume(dec is not None)
    greedy = get_solver("greedy")
    return plan_by_classes(inst, dec, greedy, SolveOptions(time_limit=1), "greedy", fallback=greedy)


def _same_metrics(a, b) -> None:
    assert a.iteration_time == b.iteration_time
    assert a.iteration_end == b.iteration_end
    assert dict(a.busy_time) == dict(b.busy_time)
    assert dict(a.peak_memory) == dict(b.peak_memory)
    assert dict(a.bubble_ratio) == dict(b.bubble_ratio)
    assert a.lower_bound == b.lower_bound


@settings(max_examples=40)
@given(symmetric_cases())
def test_checked_by_classes_is_checked_op_by_op(sched):
    """The verifier's verdict and the simulator's figures are those of the expanded schedule."""
    expanded = sched.expand()
    assert check_schedule(sched) == [] and check_schedule(expanded) == []
    _same_metrics(simulate(sched), simulate(expanded))
    assert len(expanded.ops) == sched.n_ops
    assert sched.layout.reduced_dp < sched.instance.dp


@settings(max_examples=60)
@given(symmetric_cases(), st.data())
def test_a_broken_part_fails_both_ways(sched, data):
    """Corrupt one op of one part (its time, its length or its executor within the class):
    the symmetric schedule is rejected exactly when its expansion is."""
    c = data.draw(st.integers(0, len(sched.parts) - 1))
    part = sched.parts[c]
    i = data.draw(st.integers(0, len(part.ops) - 1))
    op = part.ops[i]
    how = data.draw(st.sampled_from(["earlier", "later", "shorter", "executor"]))
    if how == "earlier":
        op = replace(op, start=max(0, op.start - 700), end=max(0, op.start - 700) + op.duration)
    elif how == "later":
        op = replace(op, start=op.start + 900, end=op.end + 900)
    elif how == "shorter":
        op = replace(op, end=op.start + max(0, op.duration - 100))
    else:
        pp = part.instance.pp
        op = replace(op, rank=data.draw(st.sampled_from(
            [r for r in range(len(part.instance.gpus)) if r % pp == op.pp])))
    broken_part = replace(part, ops=part.ops[:i] + (op,) + part.ops[i + 1:])
    broken = replace(sched, parts=sched.parts[:c] + (broken_part,) + sched.parts[c + 1:])
    assert bool(check_schedule(broken)) == bool(check_schedule(broken.expand()))


def _planned(dp=8, pp=2, mb=2, failed=((1, 1),), slow=None, **kw) -> SymmetricSchedule:
    inst = make_instance(dp, pp, mb, failed=list(failed), slow=slow, optimizer=300, **kw)
    dec = decompose(inst)
    assert dec is not None
    greedy = get_solver("greedy")
    return plan_by_classes(inst, dec, greedy, SolveOptions(time_limit=1), "greedy", fallback=greedy)


def test_classes_are_the_untouched_pipelines_and_one_component_per_failure():
    sched = _planned(dp=12, pp=2, mb=2, failed=((1, 1), (7, 1)))
    classes = sched.layout.classes
    assert classes[0].size == 1 and classes[0].count == 12 - 2 * 3  # untouched, planned once
    assert classes[1].copies == ((1, 2, 3), (7, 8, 9))  # faulty first, then the next free pipelines
    assert sched.layout.reduced_dp == 4


def test_a_copy_unlike_its_class_is_refused():
    sched = _planned()
    cls = sched.layout.classes
    # Swap an untouched copy with the faulty pipeline of the component: the copies no longer match.
    untouched = cls[0].copies
    comp = cls[1].copies[0]
    bad = Layout(classes=(PipelineClass(copies=((comp[0],),) + untouched[1:]),
                          PipelineClass(copies=((untouched[0][0],) + comp[1:],))))
    broken = replace(sched, layout=bad)
    diags = check_schedule(broken)
    assert diags and {d.code for d in diags} == {"E409"}
    assert "failed" in diags[0].message
    assert check_schedule(broken.expand())  # op by op: ops on a failed GPU


def test_schedule_file_v2_round_trip(tmp_path):
    from schedc.schedule_io import parse_schedule, read_schedule, write_schedule

    sched = _planned(dp=10, pp=3, mb=2, failed=((4, 2),), slow={(8, 0): 0.5})
    path = write_schedule(tmp_path / "schedule.json", sched, metrics_of(sched))
    obj = json.loads(path.read_text())
    assert obj["format"] == "schedc.schedule/v2"
    assert len(obj["ops"]) == len(sched.reduced.ops) < sched.n_ops  # one copy of each class
    back, raw = read_schedule(path)
    assert isinstance(back, SymmetricSchedule)
    assert back.layout == sched.layout and back.instance == sched.instance
    assert back.reduced.instance == sched.reduced.instance
    assert sorted(back.reduced.ops, key=str) == sorted(sched.reduced.ops, key=str)
    verify_schedule(back)
    assert simulate(back).iteration_time == raw["iteration_time"]
    # An op of a copy other than the first is not a v2 file's business: E603, with its path.
    other = obj["classes"][0]["copies"][1][0]
    obj["ops"][0]["dp"] = other
    from schedc.schedule_io import ScheduleFileError

    with pytest.raises(ScheduleFileError) as exc:
        parse_schedule(obj)
    assert exc.value.diagnostics[0].code == "E603" and "$.ops[0].dp" in exc.value.diagnostics[0].message
    # An op on a GPU of another class: its copies would run on other copies' GPUs.
    obj = json.loads(path.read_text())
    k = next(k for k, o in enumerate(obj["ops"]) if o["kind"] == "F" and o["dp"] == 4)
    obj["ops"][k]["rank"] = sched.instance.gpu(0, obj["ops"][k]["pp"]).rank
    with pytest.raises(ScheduleFileError) as exc:
        parse_schedule(obj)
    assert "a GPU of another class" in exc.value.diagnostics[0].message
    obj = json.loads(path.read_text())
    obj["classes"][0]["copies"][0].append(obj["classes"][1]["copies"][0][0])
    with pytest.raises(ScheduleFileError) as exc:
        parse_schedule(obj)
    assert exc.value.diagnostics[0].code == "E603"


def test_exports_draw_the_first_copies(tmp_path):
    from schedc.export import write_torch_csvs
    from schedc.export.svg import render_timeline
    from schedc.export.torch_csv import dumps_pipeline_csv
    from schedc.export.trace import trace_events

    sched = _planned(dp=12, pp=2, mb=2, failed=((1, 1),))
    tracks = [e for e in trace_events(sched)["traceEvents"] if e.get("name") == "thread_name"]
    assert len(tracks) == sched.layout.reduced_dp * 2
    assert any("x9" in t["args"]["name"] for t in tracks)  # the untouched pipeline, 9 copies
    svg = render_timeline(sched, metrics_of(sched))
    assert "first copy of 2 of 2 classes" in svg and "stands for 9" in svg
    assert "1 more alike helper pipelines not drawn" in svg  # the component has 2 helpers, 1 drawn
    big = _planned(dp=20, pp=4, mb=2, failed=((1, 0), (5, 1), (9, 2), (13, 3)))
    assert len(big.layout.classes) == 5  # untouched, and a failed GPU at each of the 4 stages
    drawn = render_timeline(big, metrics_of(big))
    assert "first copy of 4 of 5 classes of alike pipelines (1 more in trace.json)" in drawn
    paths = write_torch_csvs(tmp_path, sched)
    assert [p.name for p in paths] == ["pipeline_0.csv"]  # the untouched class's first copy
    assert paths[0].read_text() == dumps_pipeline_csv(sched.expand(), 0)


def _spec_text(dp: int, pp: int, mb: int, failure: str, gpus_per_node: int = 8) -> str:
    """A spec with explicit costs, one failure and greedy (the specs of the tests below)."""
    return (f"cluster {{ dp = {dp}  pp = {pp}  gpus_per_node = {gpus_per_node}  gpu {{ memory = 40GiB }} }}\n"
            "stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 0.8ms  optimizer = 0.4ms\n"
            "               activation = 2GiB  stash = 512MiB  static = 12GiB  send = 16MiB } }\n"
            f"train {{ microbatches = {mb} }}\nfailures {{ {failure} }}\nschedule {{ solver = greedy }}\n")


@pytest.mark.slow  # three compiles of 1,024 GPUs: ~40 s
def test_compile_plans_large_clusters_by_classes(tmp_path):
    """From 1,024 GPUs on compile plans by classes on its own; the plan is no slower than greedy's
    candidates for every pipeline, and writes one program per rank of each class.

    (Greedy's local search, path-dependent, may end elsewhere on the whole cluster than on the
    class: here one order move takes the whole to the proven bound, 41.608 ms, where the class
    ends at 41.720 ms; both beat the candidates' 42.264 ms.)"""
    from schedc.plan import compile

    spec = _spec_text(128, 8, 8, "fail gpu(dp=5, pp=3)")
    plan = compile(spec)
    assert isinstance(plan.schedule, SymmetricSchedule)
    assert plan.schedule.layout.reduced_dp == 1 + 9
    whole = compile(spec, symmetric=False, time_limit=0.001)  # too little work for the search
    assert isinstance(whole.schedule, Schedule) and "moves" not in whole.schedule.solver.detail
    assert plan.metrics.iteration_time <= whole.metrics.iteration_time
    searched = compile(spec, symmetric=False)
    assert plan.metrics.iteration_time <= 1.005 * searched.metrics.iteration_time
    out = plan.write(tmp_path / "out")
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.startswith("rank_") for n in names)
    assert sum(n.startswith("program_c") for n in names) == (1 + 9) * 8 - 1  # the failed GPU has none
    manifest = json.loads((out / "programs.json").read_text())
    assert len(manifest["programs"]) == 1023 and len(manifest["copy_tables"]) == 119 + 1


def test_small_clusters_stay_op_by_op():
    from schedc.plan import compile

    plan = compile("specs/example.sched")
    assert isinstance(plan.schedule, Schedule) and plan.changed_ranks is None


def test_baselines_plan_the_whole_cluster():
    """A baseline plans a transformed instance (the field's options, Bamboo's copies) that a
    class's part cannot stand for, so it is never planned by classes, even when asked: it
    compiles (this was E409) and replans op by op."""
    import schedc
    from schedc.plan import compile

    for solver in ("1f1b", "reroute-1f1b", "redundant"):
        plan = compile("specs/small-2x2.sched", solver=solver, symmetric=True)
        assert not isinstance(plan.schedule, SymmetricSchedule), solver
    assert isinstance(compile("specs/small-2x2.sched", solver="greedy", symmetric=True).schedule,
                      SymmetricSchedule)
    again = schedc.replan(compile("specs/small-2x2.sched", solver="reroute-1f1b"), "fail gpu(dp=0, pp=1)",
                          solver="reroute-1f1b", symmetric=True)
    assert not isinstance(again.schedule, SymmetricSchedule)


def test_replan_reuses_classes_and_says_which_ranks_changed():
    """A failure like an earlier one adds a copy: no search, the same reduced schedule; the
    ranks it reports changed are exactly those whose program changed op by op."""
    from schedc.plan import compile
    from schedc.program_diff import changed_ranks
    from schedc.replan import replan

    spec = _spec_text(12, 2, 2, "fail gpu(dp=1, pp=1)", gpus_per_node=2)
    plan = compile(spec, symmetric=True)
    assert isinstance(plan.schedule, SymmetricSchedule)
    again = replan(plan, "fail gpu(dp=6, pp=1)", deadline=5.0, solver="greedy", symmetric=True)
    assert all(a is b for a, b in zip(again.schedule.parts, plan.schedule.parts))  # nothing planned
    assert again.schedule.layout.classes[1].copies == ((1, 2, 3), (6, 7, 8))
    verify_schedule(again.schedule)
    op_by_op = changed_ranks(plan.schedule.expand(), again.schedule.expand())
    assert again.changed_ranks == op_by_op
    inst = again.instance
    assert inst.gpu(6, 0).rank in again.changed_ranks  # sends its activations to helpers now
    assert {g.rank for g in plan.instance.live_gpus(1)} <= again.changed_ranks  # the group changed
    # Stage 0 of the helpers and of untouched pipelines run what they ran (a helper's extra work
    # is at stage 1), with the same all-reduce group.
    assert not {inst.gpu(d, 0).rank for d in (7, 8, 10)} & again.changed_ranks
    # A slowdown unlike anything before: one new class, planned; the old components are kept.
    slower = replan(again, "slow gpu(dp=10, pp=0) speed = 0.5", deadline=5.0, solver="greedy",
                    symmetric=True)
    assert {c.copies for c in slower.schedule.layout.classes} >= {((1, 2, 3), (6, 7, 8)), ((10, 11),)}
    assert changed_ranks(again.schedule.expand(), slower.schedule.expand()) == slower.changed_ranks
    # The GPU comes back: its component goes, and the plan is what a fresh compile would give.
    back = replan(slower, "recover gpu(dp=6, pp=1)", deadline=5.0, solver="greedy", symmetric=True)
    verify_schedule(back.schedule)
    assert all(6 not in copy for c in back.schedule.layout.classes[1:] for copy in c.copies
               if c.size > 1 and copy[0] == 6)
    assert changed_ranks(slower.schedule.expand(), back.schedule.expand()) == back.changed_ranks


@pytest.mark.slow  # real gloo training processes: ~20 s
def test_symmetric_programs_train_exactly(tmp_path):
    """Class programs (shared by copies, bound to their copy's ranks at load) on real gloo
    processes give the weights of single-process training."""
    from schedc.codegen import write_programs
    from schedc.runtime import launch, load_manifest, reference_train
    from test_runtime_support import max_weight_diff, spec_for

    sched = _planned(dp=4, pp=2, mb=1, failed=((0, 1),), latency=10)
    assert sched.layout.reduced_dp == 3  # pipelines 2 and 3 share one program per stage
    verify_schedule(sched)
    spec = spec_for(sched.instance, source="schedc.models.mlp:build", optimizer="sgd", lr=0.05)
    write_programs(spec, sched, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("program_c*.py")) == [
        "program_c0_000.py", "program_c0_001.py", "program_c1_000.py", "program_c1_002.py",
        "program_c1_003.py"]
    result = launch(tmp_path, iterations=2, want_weights=True, timeout=30)
    ref, _ = reference_train(load_manifest(tmp_path), 2)
    assert max_weight_diff(result.state_dict, ref) <= 1e-5


def test_nccl_receive_order_reads_the_rank_copy_only():
    from schedc.runtime.channels import receive_order

    sched = _planned(dp=10, pp=3, mb=2, failed=((4, 1),))
    whole = sched.expand()
    for rank in range(len(sched.instance.gpus)):
        assert receive_order(sched, rank) == receive_order(whole, rank)


def test_cli_json_lists_first_copies_only(tmp_path):
    """`schedc compile --json` and `schedc simulate --json` of a plan by classes give per-rank
    figures of each class's first copy (the same as schedule.json), not of every GPU."""
    import subprocess
    import sys

    spec = tmp_path / "big.sched"
    spec.write_text(_spec_text(128, 8, 4, "fail gpu(dp=5, pp=3)"))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "schedc", "compile", str(spec), "-o", str(out), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    compiled = json.loads(run.stdout)["metrics"]
    assert len(compiled["busy_time"]) == (1 + 1 + 4) * 8 - 1  # untouched; failed + 4 helpers; not the failed GPU
    run = subprocess.run([sys.executable, "-m", "schedc", "simulate", str(out / "schedule.json"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    simulated = json.loads(run.stdout)["metrics"]
    assert simulated["busy_time"] == compiled["busy_time"]
    assert simulated["iteration_time"] == compiled["iteration_time"]
