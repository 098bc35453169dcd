"""From spec text to trained weights: schedc.load -> schedc.compile -> write_programs -> run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import schedc
from schedc.codegen import write_programs
from schedc.runtime import launch, load_manifest, reference_train
from test_runtime_support import max_weight_diff

pytestmark = pytest.mark.e2e

SPEC = Path(__file__).parent.parent / "specs" / "mlp-2x2.sched"


def _compile(text: str, out: Path, solver: str | None = None):
    plan = schedc.compile(schedc.load(text), solver=solver)
    write_programs(plan.spec, plan.schedule, out, metrics=plan.metrics.to_json())
    return plan


@pytest.mark.parametrize("failures", ["", "failures { fail gpu(dp=1, pp=0) }",
                                      "failures { slow gpu(dp=0, pp=1) speed = 0.5 }"])
def test_spec_with_bound_model_trains_exactly(tmp_path, failures):
    plan = _compile(SPEC.read_text() + "\n" + failures + "\n", tmp_path)
    m = load_manifest(tmp_path)
    assert (m.source, m.data, m.partition, m.optimizer, m.iterations) == (
        "schedc.models.mlp:build", "schedc.models.mlp:batch", ((0, 4), (4, 7)), "sgd", 2)
    assert m.metrics["iteration_time"] == plan.metrics.iteration_time
    result = launch(tmp_path, want_weights=True, timeout=30)  # iterations from the spec
    ref, losses = reference_train(m, 2)
    assert max_weight_diff(result.state_dict, ref) <= 1e-5
    assert result.losses == pytest.approx(losses, abs=1e-6)


def test_schedc_run_through_the_dispatcher(tmp_path, capsys):
    from schedc.cli import main

    _compile(SPEC.read_text() + "\nfailures { fail gpu(dp=0, pp=1) }\n", tmp_path / "out")
    weights = tmp_path / "w.pt"
    assert main(["run", str(tmp_path / "out"), "--iterations", "2", "--json",
                 "--save-weights", str(weights)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["iterations"] == 2 and len(summary["losses"]) == 2
    saved = torch.load(weights, weights_only=True)
    ref, losses = reference_train(load_manifest(tmp_path / "out"), 2)
    assert max_weight_diff(saved, ref) <= 1e-5
    assert summary["losses"] == pytest.approx(losses, abs=1e-6)


def test_schedc_run_reports_a_missing_folder(tmp_path, capsys):
    from schedc.cli import main

    assert main(["run", str(tmp_path / "nothing")]) == 1
    assert "error[E520]" in capsys.readouterr().err


def test_a_partition_that_does_not_fit_the_model_is_a_diagnostic(tmp_path, capsys):
    from schedc.cli import main

    text = SPEC.read_text().replace("layers = 7", "layers = 9").replace("layers[4:7]", "layers[4:9]")
    _compile(text, tmp_path / "out")
    assert main(["run", str(tmp_path / "out"), "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "error[E513]" in err and "7 layers" in err
