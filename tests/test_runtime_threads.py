"""Deadlock freedom and exactness over many random verified schedules, fast.

The programs run in threads over `schedc.runtime.threads.ThreadTransport`
(in-memory, with the blocking semantics of the gloo transport: sends never
block, receives and the stage all-reduce do). Real model compute (the tiny
MLP), so every example also checks the weights against single-process
training. `tests/test_e2e_runs.py` covers the same property with real
processes and gloo, on fewer examples.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from schedc.codegen import write_programs
from schedc.diagnostics import InfeasibleError, RunError
from schedc.instance import make_instance
from schedc.runtime import load_manifest, reference_train
from schedc.runtime.threads import run_threads
from schedc.schedule import Schedule
from strategies import instances
from test_runtime_support import max_weight_diff, schedule_for, spec_for


# Capped: each example runs real training; 100 already covers the shapes of `instances`.
@settings(max_examples=min(settings.default.max_examples, 100),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(inst=instances(max_dp=3, max_pp=4, max_microbatches=4),
       solver=st.sampled_from(["greedy", "cpsat", "1f1b", "zb-h1", "gpipe"]),
       optimizer=st.sampled_from(["sgd", "adam"]))
def test_random_verified_schedules_complete_and_are_exact(tmp_path_factory, inst, solver, optimizer):
    try:
        sched = schedule_for(inst, solver)
    except InfeasibleError:
        assume(False)
    from schedc.verify import verify_schedule

    verify_schedule(sched)
    out = tmp_path_factory.mktemp("prog")
    write_programs(spec_for(inst, optimizer=optimizer, lr=1e-3 if optimizer == "adam" else 0.05), sched, out)
    state, losses = run_threads(out, iterations=2, timeout=20)
    ref, ref_losses = reference_train(load_manifest(out), 2)
    assert max_weight_diff(state, ref) <= 1e-5
    assert losses == pytest.approx(ref_losses, abs=1e-6)


def test_a_program_order_that_deadlocks_is_reported_not_hung(tmp_path):
    """Swap two ranks' first ops into a cycle: the run fails with E530 within the timeout."""
    inst = make_instance(1, 2, 2, decouple_backward=False)
    sched = schedule_for(inst, "test-list")
    # Put every B of stage 0 before its F on rank 0's timeline: B waits for a gradient that
    # needs this rank's own later F, a cycle the verifier would reject.
    ops = []
    for o in sched.ops:
        if o.rank == 0 and o.kind == "B":
            o = type(o)(o.rank, o.kind, o.dp, o.pp, o.mb, -10 + o.mb, -9 + o.mb)
        ops.append(o)
    write_programs(spec_for(inst), Schedule(inst, tuple(ops), sched.solver), tmp_path)
    with pytest.raises(RunError) as exc:
        run_threads(tmp_path, iterations=1, timeout=1)
    assert "E540" in exc.value.codes or "E530" in exc.value.codes


def test_a_lost_microbatch_changes_the_weights(tmp_path):
    """The exactness check can fail: drop one microbatch's work and the weights differ."""
    inst = make_instance(2, 2, 2)
    sched = schedule_for(inst, "test-list")
    ops = tuple(o for o in sched.ops if not (o.dp == 1 and o.mb == 1 and o.kind != "O"))
    # Without microbatch (1, 1) the executors map lacks it: codegen refuses (E502) ...
    with pytest.raises(RunError):
        write_programs(spec_for(inst), Schedule(inst, ops, sched.solver), tmp_path)
    # ... and a program that silently skips it trains on less data than the reference.
    write_programs(spec_for(inst), sched, tmp_path)
    path = tmp_path / "rank_02.py"
    path.write_text("\n".join(l for l in path.read_text().splitlines() if "mb=1" not in l) + "\n")
    path = tmp_path / "rank_03.py"
    path.write_text("\n".join(l for l in path.read_text().splitlines() if "mb=1" not in l) + "\n")
    state, _ = run_threads(tmp_path, iterations=1, timeout=5)
    ref, _ = reference_train(load_manifest(tmp_path), 1)
    assert max_weight_diff(state, ref) > 1e-4


@pytest.mark.parametrize("solver", ["greedy", "cpsat"])
def test_stage_major_placement_and_gpt(tmp_path, solver):
    """Ranks numbered stage-major (s*D + d) and a model whose first input is token ids."""
    inst = make_instance(3, 2, 2, placement="stage_major", failed=[(0, 1)], slow={(2, 0): 0.5})
    sched = schedule_for(inst, solver)
    from schedc.verify import verify_schedule

    verify_schedule(sched)
    write_programs(spec_for(inst, source="schedc.models.gpt:build", optimizer="adam", lr=1e-3), sched, tmp_path)
    assert load_manifest(tmp_path).coords[1] == (1, 0)  # rank 1 is GPU (dp=1, pp=0) here
    state, losses = run_threads(tmp_path, iterations=2, timeout=20)
    ref, ref_losses = reference_train(load_manifest(tmp_path), 2)
    assert max_weight_diff(state, ref) <= 1e-5
    assert losses == pytest.approx(ref_losses, abs=1e-6)


def test_a_loss_that_is_a_plain_function_trains_exactly(tmp_path):
    """`model.source` may return its loss as a function (torch.nn.functional.mse_loss), not a module."""
    inst = make_instance(2, 2, 2)
    spec = spec_for(inst, source="live_data:mlp_with_a_plain_loss", data="schedc.models.mlp:batch")
    write_programs(spec, schedule_for(inst, "greedy"), tmp_path)
    state, losses = run_threads(tmp_path, iterations=2, timeout=20)
    ref, ref_losses = reference_train(load_manifest(tmp_path), 2)
    assert max_weight_diff(state, ref) <= 1e-5
    assert losses == pytest.approx(ref_losses, abs=1e-6)
