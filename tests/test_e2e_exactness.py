"""Exactness end to end: generated programs on real processes give the weights of
single-process training on the same D*M microbatches, under any failure set.

Each case compiles a schedule with a real solver, writes the programs, runs
them with `schedc.runtime.launch` (gloo, one process per live rank) and
compares every parameter with `reference_train`. Ranks fork from a warm
forkserver, so one case costs well under a second.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from schedc.codegen import write_programs
from schedc.diagnostics import InfeasibleError
from schedc.instance import make_instance
from schedc.runtime import launch, load_manifest, reference_train
from test_runtime_support import max_weight_diff, report_precision, schedule_for, spec_for

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
SHAPES = [(2, 2), (2, 3), (3, 2)]
FAILURES = {
    "none": dict(),
    "one": dict(failed=[(1, 0)]),
    "two": dict(failed=[(1, 0), (0, 1)]),  # two GPUs, different stages
    "slow": dict(slow={(0, 1): 0.5}),
}
SOLVERS = ["1f1b", "greedy", "cpsat"]


@pytest.fixture(scope="module")
def reached():
    """(case, max abs weight difference) of each case of this file that ran, reported when the
    last of them is done, whichever ran and in whatever order."""
    cases: list[tuple[str, float]] = []
    yield cases
    report_precision(cases, "exactness", TOLERANCE)


def run_case(tmp_path, reached, *, model: str, dp: int, pp: int, failure: str, solver: str, optimizer: str,
             iterations: int, microbatches: int = 3, decouple: bool = True, stagger: bool = True,
             partition=None) -> float:
    inst = make_instance(dp, pp, microbatches, decouple_backward=decouple, stagger_optimizer=stagger,
                         latency=10, **FAILURES[failure])
    try:
        sched = schedule_for(inst, solver)
    except InfeasibleError:
        if solver in ("greedy", "cpsat"):
            raise  # schedc's own planners must schedule every failure set of this matrix
        pytest.skip(f"{solver} is a fault-free template: it refuses failure set `{failure}`")
    from schedc.verify import verify_schedule

    verify_schedule(sched)
    lr = 1e-3 if optimizer == "adam" else 0.05
    spec = spec_for(inst, source=f"schedc.models.{model}:build", optimizer=optimizer, lr=lr,
                    partition=partition)
    write_programs(spec, sched, tmp_path)
    result = launch(tmp_path, iterations=iterations, want_weights=True, timeout=30)
    ref, ref_losses = reference_train(load_manifest(tmp_path), iterations)
    diff = max_weight_diff(result.state_dict, ref)
    assert diff <= TOLERANCE, f"max abs weight difference {diff:.3g}"
    assert result.losses == pytest.approx(ref_losses, abs=1e-6)
    reached.append((f"{model} {dp}x{pp} {failure}, {solver}, {optimizer}, {iterations} it"
                    + ("" if decouple else ", no decoupling") + ("" if stagger else ", barrier"), diff))
    # The weights moved: comparing untrained copies would prove nothing.
    from schedc.runtime.manifest import build_model

    init = dict(torch.nn.Sequential(*build_model(load_manifest(tmp_path))[0]).state_dict())
    assert max_weight_diff(init, ref) > 1e-4
    return diff


def _mlp_matrix():
    """Every shape x failure set x solver (1f1b only where it schedules), SGD and Adam alternating
    so each solver, shape and failure set meets both optimizers while the matrix stays quick."""
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, failure in enumerate(FAILURES):
            for k, solver in enumerate(SOLVERS):
                if solver == "1f1b" and failure in ("one", "two"):
                    continue  # a fault-free template
                optimizer = "adam" if (i + j + k) % 2 else "sgd"
                cases.append(pytest.param(shape, failure, solver, optimizer,
                                          id=f"{shape[0]}x{shape[1]}-{failure}-{solver}-{optimizer}"))
    return cases


@pytest.mark.parametrize("shape, failure, solver, optimizer", _mlp_matrix())
def test_mlp_matches_single_process_training(tmp_path, reached, shape, failure, solver, optimizer):
    run_case(tmp_path, reached, model="mlp", dp=shape[0], pp=shape[1], failure=failure, solver=solver,
             optimizer=optimizer, iterations=2 if optimizer == "adam" else 1,
             stagger=failure != "slow")  # the slow cases also cover the global optimizer barrier


@pytest.mark.parametrize("case", [
    dict(dp=2, pp=2, failure="one", solver="greedy", optimizer="adam", iterations=2),
    dict(dp=2, pp=3, failure="two", solver="cpsat", optimizer="sgd", iterations=1,
         partition=((0, 2), (2, 4), (4, 6))),
    dict(dp=3, pp=2, failure="slow", solver="1f1b", optimizer="adam", iterations=1),
    dict(dp=3, pp=2, failure="none", solver="greedy", optimizer="sgd", iterations=2, decouple=False),
], ids=lambda c: f"{c['dp']}x{c['pp']}-{c['failure']}-{c['solver']}-{c['optimizer']}")
def test_gpt_matches_single_process_training(tmp_path, reached, case):
    run_case(tmp_path, reached, model="gpt", **case)


def test_mlp_without_decoupling_and_with_a_failure(tmp_path, reached):
    run_case(tmp_path, reached, model="mlp", dp=2, pp=3, failure="two", solver="greedy", optimizer="adam",
             iterations=2, decouple=False, stagger=False)


def test_cli_saves_the_whole_model(tmp_path, capsys):
    from schedc.cli import run as run_cli

    inst = make_instance(2, 2, 2, failed=[(0, 0)])
    write_programs(spec_for(inst, optimizer="sgd", lr=0.05), schedule_for(inst, "greedy"), tmp_path / "out")
    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    weights = tmp_path / "w.pt"
    assert run_cli.run(parser.parse_args([str(tmp_path / "out"), "--iterations", "2",
                                          "--save-weights", str(weights)])) == 0
    out = capsys.readouterr().out
    assert "iteration 1:" in out and "loss" in out and "weights saved" in out
    saved = torch.load(weights, weights_only=True)
    ref, _ = reference_train(load_manifest(tmp_path / "out"), 2)
    assert list(saved) == list(ref)  # the keys of model.source's full nn.Sequential, in order
    assert max_weight_diff(saved, ref) <= TOLERANCE
