"""Live runs through real failures end with the weights of single-process training.

Every case compiles a small plan bound to a shipped model, runs it under the
live supervisor with real worker processes (gloo), injects real SIGKILLs or
SIGSTOPs at a chosen moment, and compares every parameter and every
iteration's loss with `reference_train`. Each case also checks that its
scenario really happened (the ranks that died, a step undone, an
interrupted all-reduce), so a test cannot pass by missing its moment.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_support import TOLERANCE, check_exact, compiled
from schedc.live import train
from test_runtime_support import max_weight_diff, report_precision

pytestmark = pytest.mark.e2e

ITERATIONS = 4
#: The random cases' tolerance for the GPT with Adam (lr 1e-3). A re-routed plan sums a stage's
#: gradient in another order than single-process training; where a parameter's gradient is a
#: small difference of large float32 terms, that order changes it by a share of itself, which
#: Adam's normalisation turns into the same share of a whole step (up to lr). Seen: up to 6.8e-6
#: over 78 cases, once 1.12e-5 (3 x 2 re-routed from iteration 0, in CI); a step applied twice or
#: skipped moves weights by about lr = 1e-3. The SGD and MLP cases keep 1e-5 (seen: below 1e-7).
ADAM_GPT_TOLERANCE = 3e-5


@pytest.fixture(scope="module")
def reached():
    """(case, max abs weight difference) of each case of this file that ran, reported when the
    last of them is done, whichever ran and in whatever order. The worst is held to the loosest
    tolerance a case has (each case checked its own: 1e-5, the GPT with Adam ADAM_GPT_TOLERANCE);
    with 1e-5 here, the random GPT + Adam case at 1.12e-5 failed the whole file at teardown."""
    cases: list[tuple[str, float]] = []
    yield cases
    report_precision(cases, "live exactness", max(TOLERANCE, ADAM_GPT_TOLERANCE))


def moments(dp: int, pp: int, microbatches: int) -> dict[str, list[str]]:
    """The failure moments the live runtime must survive, for a dp x pp plan."""
    last = pp - 1
    return {
        "during-F": ["at iteration 1 during F: fail gpu(dp=1, pp=1)"],
        "during-B": [f"at iteration 2 during B 1: fail gpu(dp=0, pp={last})"],
        "during-W": ["at iteration 2 during W 0: fail gpu(dp=1, pp=0)"],
        # Stage 0 runs the last W of an iteration; later stages have stepped by then.
        "between-steps": [f"at iteration 2 during W {microbatches - 1}: fail gpu(dp=0, pp=0)"],
        # Its stage peers are in (or entering) the gradient all-reduce when it dies.
        "during-allreduce": ["at iteration 1 during O: fail gpu(dp=0, pp=1)"],
        "two-at-once": ["at iteration 2 during F: fail gpu(dp=0, pp=0)",
                        f"at iteration 2 during B: fail gpu(dp=1, pp={last})"],
        "during-recovery": ["at iteration 1 during B: fail gpu(dp=0, pp=1)", "at recovery 1: fail gpu(dp=1, pp=0)"],
        "node": ["at iteration 2 during B: fail node 1"],
    }


EXPECTED_FAILED = {  # which GPUs (dp, pp) each moment kills, given pp
    "during-F": lambda pp: {(1, 1)}, "during-B": lambda pp: {(0, pp - 1)}, "during-W": lambda pp: {(1, 0)},
    "between-steps": lambda pp: {(0, 0)}, "during-allreduce": lambda pp: {(0, 1)},
    "two-at-once": lambda pp: {(0, 0), (1, pp - 1)}, "during-recovery": lambda pp: {(0, 1), (1, 0)},
    "node": lambda pp: {(1, s) for s in range(pp)},
}


def _cases():
    out = []
    for i, moment in enumerate(EXPECTED_FAILED):
        for j, (model, optimizer) in enumerate([("mlp", "sgd"), ("mlp", "adam"), ("gpt", "sgd"), ("gpt", "adam")]):
            pp = 2 + (i + j) % 2  # each moment meets both shapes
            out.append(pytest.param(moment, model, optimizer, pp, id=f"{moment}-{model}-{optimizer}-2x{pp}"))
    return out


@pytest.mark.parametrize("moment, model, optimizer, pp", _cases())
def test_live_run_through_a_failure_is_exact(tmp_path, reached, moment, model, optimizer, pp):
    microbatches = 3
    out = compiled(tmp_path, model=model, dp=2, pp=pp, optimizer=optimizer, microbatches=microbatches)
    result = train(out, iterations=ITERATIONS, inject=moments(2, pp, microbatches)[moment], want_weights=True)
    diff = check_exact(out, result, ITERATIONS)
    reached.append((f"{moment} {model} {optimizer} 2x{pp}", diff))

    failed = {r for rec in result.recoveries for r in rec.failed}
    assert {(r // pp, r % pp) for r in failed} == EXPECTED_FAILED[moment](pp)
    assert all(rec.t_first is not None for rec in result.recoveries)
    if moment == "between-steps":  # a stage had stepped, another had not: the first undid its step
        assert sum(rec.undone for rec in result.recoveries) >= 1, result.recoveries
    if moment == "during-allreduce":
        assert any("all-reduce" in e["message"] for e in result.events if e["kind"] == "aborted"), result.events
    if moment == "during-recovery":  # the second failure hit while generation 1 formed
        assert [g.number for g in result.generations] == [0, 1, 2]
        assert any(e["kind"] == "injected" and "recovery 1" in e["message"] for e in result.events)
    if moment == "node":
        # The node is named when all its ranks are seen dead at once. Their exits may reach the
        # supervisor in more than one batch (the first GPUs' deaths start the recovery, the last
        # one's extends it: seen under load, 1 run in 40); then each replan names the GPUs it
        # newly routes around, one line each, never the node of a GPU that had failed before.
        events = result.recoveries[0].events
        assert events == ["fail node 1"] or sorted(events) == [f"fail gpu(dp=1, pp={s})" for s in range(pp)], events


def test_a_hung_gpu_is_detected_fenced_and_routed_around(tmp_path):
    """SIGSTOP (the process stops answering): silence detected within the bound, the rank killed, exact."""
    out = compiled(tmp_path, model="mlp", dp=2, pp=2, optimizer="adam")
    result = train(out, iterations=ITERATIONS, inject=["at iteration 2 during B: hang gpu(dp=1, pp=0)"],
                   want_weights=True, detect_timeout=1.0)
    check_exact(out, result, ITERATIONS)
    (rec,) = result.recoveries
    assert "no heartbeat" in rec.causes["2"]  # found by its silence, not by a stall or an exit
    # Not before the bound: 1 s of silence, less up to one heartbeat interval (load can only make
    # it later). How much later is a latency, which load stretches: bench/live_recovery.py's
    # "hang" scenario measures it (detect s), so it is not asserted here.
    assert rec.durations()["detect"] >= 0.9


def test_without_decoupling_and_with_a_global_optimizer_barrier(tmp_path):
    out = compiled(tmp_path, model="gpt", dp=2, pp=3, optimizer="adam", decouple=False, stagger=False)
    result = train(out, iterations=ITERATIONS, inject=["at iteration 1 during B: fail gpu(dp=1, pp=1)"],
                   want_weights=True)
    check_exact(out, result, ITERATIONS)
    assert len(result.recoveries) == 1


def test_a_lost_stage_falls_back_to_the_latest_checkpoint_exactly(tmp_path):
    """Both GPUs of stage 1 die: no re-routing is possible; the run restores the checkpoint after
    2 steps with replacement processes and still ends with the fault-free weights."""
    out = compiled(tmp_path, model="mlp", dp=2, pp=2, optimizer="adam")
    result = train(out, iterations=5, checkpoint_every=2, want_weights=True,
                   inject=["at iteration 3 during F: fail gpu(dp=0, pp=1)",
                           "at iteration 3 during B: fail gpu(dp=1, pp=1)"])
    check_exact(out, result, 5)
    (rec,) = result.recoveries
    assert rec.method == "checkpoint" and rec.resumed_at == 2
    assert result.generations[-1].restore.endswith("iter-000002")
    assert [r.runs for r in result.iterations] == [1, 1, 2, 1, 1]  # iteration 2 ran again


def test_a_lost_stage_without_a_checkpoint_restarts_from_the_initial_weights(tmp_path):
    out = compiled(tmp_path, model="mlp", dp=2, pp=2, optimizer="sgd")
    result = train(out, iterations=3, want_weights=True, inject=["at iteration 1 during B: fail node 1",
                                                                 "at iteration 1 during F: fail gpu(dp=0, pp=1)"])
    check_exact(out, result, 3)
    assert result.generations[-1].restore == "initial"


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    out = compiled(tmp_path, model="gpt", dp=2, pp=2, optimizer="adam")
    train(out, iterations=4, checkpoint_every=2)
    result = train(out, iterations=6, resume=True, want_weights=True)
    assert [r.iteration for r in result.iterations] == [4, 5]
    from schedc.runtime import load_manifest, reference_train

    ref, _ = reference_train(load_manifest(out), 6)
    assert max_weight_diff(result.state_dict, ref) <= 1e-5


@pytest.mark.parametrize("method", ["drop-pipeline", "restart"])
def test_the_comparison_methods_are_exact_too(tmp_path, method):
    out = compiled(tmp_path, model="mlp", dp=2, pp=2, optimizer="adam")
    result = train(out, iterations=5, recovery=method, checkpoint_every=2, want_weights=True,
                   inject=["at iteration 3 during B: fail gpu(dp=1, pp=0)"])
    check_exact(out, result, 5)
    (rec,) = result.recoveries
    assert rec.method == method
    if method == "restart":  # every process restarted from the checkpoint, the GPU replaced
        assert rec.resumed_at == 2 and len(result.generations[-1].members) == 4
    else:  # pipeline 1 leaves: its other GPU stays (it holds weights) but runs no microbatch
        assert result.generations[-1].members == [0, 1, 3]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_injections_keep_training_exact(tmp_path_factory, reached, data):
    """Any shape, model, optimizer and one or two faults at random moments (a lost stage included:
    that one restores the initial weights): the weights are always those of fault-free training."""
    dp, pp = data.draw(st.sampled_from([(2, 2), (2, 3), (3, 2)]), label="shape")
    model = data.draw(st.sampled_from(["mlp", "gpt"]), label="model")
    optimizer = data.draw(st.sampled_from(["sgd", "adam", "adamw"]), label="optimizer")
    microbatches = 3
    injections = []
    for _ in range(data.draw(st.integers(1, 2), label="faults")):
        it = data.draw(st.integers(0, ITERATIONS - 1), label="iteration")
        phase = data.draw(st.sampled_from(["start", "during", "after"]), label="phase")
        target = f"gpu(dp={data.draw(st.integers(0, dp - 1))}, pp={data.draw(st.integers(0, pp - 1))})"
        if phase == "start":
            moment = f"iteration {it}"
        else:
            kind = data.draw(st.sampled_from("FBWO"), label="op")
            mb = "" if kind == "O" else data.draw(st.sampled_from(["", *map(str, range(microbatches))]))
            moment = f"iteration {it} {phase} {kind} {mb}".rstrip()
        injections.append(f"at {moment}: fail {target}")
    out = compiled(tmp_path_factory.mktemp("live"), model=model, dp=dp, pp=pp, optimizer=optimizer,
                   microbatches=microbatches)
    result = train(out, iterations=ITERATIONS, inject=injections, want_weights=True)
    reached.append((f"random {model} {optimizer} {dp}x{pp}: {injections}",
                    check_exact(out, result, ITERATIONS, ADAM_GPT_TOLERANCE if model == "gpt" and
                                optimizer.startswith("adam") else TOLERANCE)))
