"""The validator: resolved values, defaults, placement, failures, and every bad spec's exact diagnostics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from schedc.diagnostics import InfeasibleError, SpecError
from schedc.load import load
from schedc.diagnostics import LostStageError

ROOT = Path(__file__).parent.parent
BAD = sorted((Path(__file__).parent / "bad_specs").glob("*.sched"))
GOLDEN = Path(__file__).parent / "golden" / "spec" / "errors"
UPDATE = bool(os.environ.get("SCHEDC_UPDATE_GOLDEN"))


def test_example_resolves_to_integers():
    spec = load(ROOT / "specs" / "example.sched")
    assert spec.cluster.gpu.memory == 40 * 2**30
    assert (spec.cluster.link.latency, spec.cluster.link.bandwidth) == (20, 25 * 10**9)
    s0, s3 = spec.stages[0], spec.stages[3]
    assert (s0.forward, s0.backward_input, s0.backward_weight, s0.optimizer) == (1200, 1000, 800, 400)
    assert (s3.forward, s3.backward_input) == (1400, 1500)
    assert (s0.activation, s0.stash, s0.static, s0.send) == (2**30, 256 * 2**20, 12 * 2**30, 16 * 2**20)
    assert spec.gpu(1, 2).state == "failed" and spec.gpu(1, 2).rank == 6
    assert spec.gpu(0, 3).speed == 0.5 and spec.gpu(0, 3).live
    assert [g.rank for g in spec.gpus] == list(range(16))
    assert spec.gpus[5].node == 1
    assert spec.span("stages.3.forward").line == 18
    assert spec.span("stages.1.forward").line == 13  # from `all`
    assert spec.span("failures.1").line == 25
    assert spec.span("cluster.dp").line == 3


def test_defaults():
    spec = load("cluster { dp = 1  pp = 1  gpu { memory = 1GiB } }\n"
                "stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 0us\n"
                "  activation = 1MiB  stash = 0B  static = 0B  send = 0B } }\ntrain { microbatches = 2 }")
    assert (spec.schedule.decouple_backward, spec.schedule.stagger_optimizer) == (True, True)
    assert (spec.schedule.solver, spec.schedule.time_limit) == ("cpsat", 5.0)
    assert (spec.train.optimizer, spec.train.lr, spec.train.iterations) == ("adam", 1e-3, 1)
    assert (spec.cluster.placement, spec.cluster.gpus_per_node) == ("pipeline_major", 8)
    assert (spec.cluster.link.latency, spec.cluster.link.bandwidth) == (0, 25 * 10**9)


def test_stage_major_placement_and_node_failure():
    spec = load(ROOT / "specs" / "multi-failure.sched")
    assert spec.cluster.placement == "stage_major"
    assert spec.gpu(1, 1).rank == 1 * 4 + 1 and spec.gpu(1, 1).state == "failed"  # `fail rank 5`
    assert {(g.dp, g.pp) for g in spec.gpus if not g.live} == {(0, 0), (1, 1), (2, 2)}
    node = load(ROOT / "specs" / "node-failure.sched")
    assert [g.rank for g in node.gpus if not g.live] == [4, 5, 6, 7]


def test_lost_stage_is_both_spec_and_infeasible_error():
    with pytest.raises(LostStageError) as e:
        load(Path(__file__).parent / "bad_specs" / "stage-lost.sched")
    assert isinstance(e.value, SpecError) and isinstance(e.value, InfeasibleError)
    (d,) = e.value.diagnostics
    assert d.code == "E301" and [n.span.line for n in d.notes] == [15, 16]
    assert "checkpoint" in d.hint


def test_all_errors_are_collected():
    with pytest.raises(SpecError) as e:
        load(Path(__file__).parent / "bad_specs" / "many-errors.sched")
    assert sorted(e.value.codes) == ["E201", "E204", "E206", "E207", "E215"]


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_spec_golden(path):
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), "each bad spec names its expected codes"
    expected = sorted(first.removeprefix("# expect: ").split())
    with pytest.raises(SpecError) as e:
        load(path, name=f"bad_specs/{path.name}")
    assert sorted(set(e.value.codes)) == expected, e.value.render()
    text = e.value.render() + "\n"
    golden = GOLDEN / f"{path.stem}.txt"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.read_text(encoding="utf-8") == text


def test_every_bad_spec_has_a_golden():
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == [p.stem for p in BAD]
