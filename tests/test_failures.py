"""schedc.failures on its own: statements -> Failure, their text, the ranks they name, GPUs resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

import schedc
from schedc.diagnostics import InfeasibleError, LostStageError, SpecError
from schedc.failures import (describe_failure, failure_from_statement, failure_ranks, failures_from_block,
                             resolve_gpus, validate_failures)
from schedc.parse import parse_statements, parse_text
from schedc.printer import human_bytes
from schedc.spec import ClusterSpec, Failure, GpuSpec, LinkSpec

SPEC = """
cluster { dp = 2  pp = 3  gpus_per_node = 3  gpu { memory = 40GiB } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 0us
               activation = 1MiB  stash = 1MiB  static = 1GiB  send = 1MiB } }
train { microbatches = 4 }
"""


def _cluster(dp=2, pp=3, tp=1, gpus_per_node=3) -> ClusterSpec:
    return ClusterSpec(dp=dp, pp=pp, gpus_per_node=gpus_per_node, placement="pipeline_major",
                       gpu=GpuSpec(memory=2**30), link=LinkSpec(latency=0, bandwidth=10**9), tp=tp)


def _one(text: str, *, allow_recover: bool = True):
    (st,) = parse_statements(text)
    return failure_from_statement(st, allow_recover=allow_recover)


@pytest.mark.parametrize("text, failure", [
    ("fail gpu(dp=1, pp=2)", Failure(kind="fail_gpu", dp=1, pp=2)),
    ("fail gpu(pp=2, dp=1)", Failure(kind="fail_gpu", dp=1, pp=2)),
    ("fail rank 4", Failure(kind="fail_rank", rank=4)),
    ("fail node 1", Failure(kind="fail_node", node=1)),
    ("slow gpu(dp=0, pp=1) speed = 0.25", Failure(kind="slow_gpu", dp=0, pp=1, speed=0.25)),
    ("recover gpu(dp=1, pp=0)", Failure(kind="recover_gpu", dp=1, pp=0)),
])
def test_statements_become_failures_and_print_back(text, failure):
    f, problems = _one(text)
    assert problems == [] and f == failure and f.span is not None
    again, _ = _one(describe_failure(f))
    assert again == f


@pytest.mark.parametrize("text, code, column, words", [
    ("fail gpu(dp=1)", "E203", 6, "missing `pp`"),
    ("fail gpu(dp=1, dp=2)", "E202", 16, "given twice"),
    ("fail gpu(dq=1, pp=0)", "E201", 10, "unknown coordinate `dq`"),
    ("fail gpu(dp=1.5, pp=0)", "E205", 13, "whole number"),
    ("fail gpu 3", "E205", 6, "needs coordinates"),
    ("fail host 1", "E201", 6, "cannot name `host`"),
    ("slow node 1 speed = 0.5", "E201", 6, "cannot name `node`"),
    ("slow gpu(dp=0, pp=0) sped = 0.5", "E201", 22, "unknown setting `sped`"),
    ("slow gpu(dp=0, pp=0) speed = 2", "E206", 30, "must be in (0, 1]"),
    ("slow gpu(dp=0, pp=0) speed = 0.0001", "E206", 30, "at least 0.001"),
    ("slow gpu(dp=0, pp=0) speed = 5ms", "E205", 30, "plain number"),
])
def test_bad_statements_are_diagnostics(text, code, column, words):
    f, problems = _one(text)
    assert f is None
    (d,) = problems
    assert (d.code, d.span.column) == (code, column) and words in d.message, d


def test_recover_is_an_event_not_a_spec_statement():
    f, (d,) = _one("recover gpu(dp=0, pp=0)", allow_recover=False)
    assert f is None and d.code == "E201" and "replan event" in d.message


def test_a_block_keeps_order_and_reports_every_bad_line():
    (block,) = parse_text("failures { fail rank 1  slow gpu(dp=0, pp=2) speed = 0.5 }").items
    failures, problems = failures_from_block(block)
    assert problems == [] and [f.kind for f in failures] == ["fail_rank", "slow_gpu"]
    (block,) = parse_text("failures { fial = 1  fail gpu(dp=0)  fail rank 2 }").items
    failures, problems = failures_from_block(block)
    assert failures is None and [d.code for d in problems] == ["E201", "E203"]
    assert "did you mean `fail`?" == problems[0].label


@pytest.mark.parametrize("failure, ranks", [
    (Failure(kind="fail_gpu", dp=1, pp=2), [5]),
    (Failure(kind="slow_gpu", dp=0, pp=1, speed=0.5), [1]),
    (Failure(kind="fail_rank", rank=3), [3]),
    (Failure(kind="fail_node", node=1), [3, 4, 5]),
])
def test_failures_name_ranks(failure, ranks):
    assert failure_ranks(_cluster(), failure) == (ranks, None)


def test_a_rank_is_a_real_gpu_under_tensor_parallelism():
    cluster = _cluster(tp=2, gpus_per_node=4)  # 6 TP groups of 2 real GPUs, 2 groups per node
    assert failure_ranks(cluster, Failure(kind="fail_rank", rank=7))[0] == [3]
    assert failure_ranks(cluster, Failure(kind="fail_node", node=2))[0] == [4, 5]
    _, d = failure_ranks(cluster, Failure(kind="fail_rank", rank=12))
    assert d.code == "E207" and "ranks 0..11 (dp * pp * tp = 12)" in d.hint
    # Both real GPUs of one group are one failure, not a GPU listed twice.
    gpus, diags = resolve_gpus(cluster, [Failure(kind="fail_rank", rank=6), Failure(kind="fail_rank", rank=7)])
    assert diags == [] and [g.rank for g in gpus if not g.live] == [3]


@pytest.mark.parametrize("failure, words", [
    (Failure(kind="fail_gpu", dp=2, pp=0), "there is no GPU (dp=2, pp=0)"),
    (Failure(kind="fail_rank", rank=6), "there is no rank 6"),
    (Failure(kind="fail_node", node=2), "there is no node 2"),
])
def test_targets_outside_the_cluster_are_e207(failure, words):
    ranks, d = failure_ranks(_cluster(), failure)
    assert ranks == [] and d.code == "E207" and d.message == words


def test_resolving_applies_failures_and_speeds_in_rank_order():
    gpus, diags = resolve_gpus(_cluster(), [Failure(kind="fail_gpu", dp=1, pp=2),
                                            Failure(kind="slow_gpu", dp=0, pp=0, speed=0.5)])
    assert diags == [] and [g.rank for g in gpus] == list(range(6))
    assert [(g.state, g.speed) for g in gpus] == [("live", 0.5)] + [("live", 1.0)] * 4 + [("failed", 1.0)]
    assert gpus[4].node == 1 and (gpus[4].dp, gpus[4].pp) == (1, 1)


def test_resolving_reports_a_gpu_listed_twice_and_a_lost_stage():
    _, (d,) = resolve_gpus(_cluster(), [Failure(kind="fail_node", node=1), Failure(kind="fail_gpu", dp=1, pp=0)])
    assert d.code == "E208" and "GPU (dp=1, pp=0) (rank 3) is listed twice" in d.message
    _, (d,) = resolve_gpus(_cluster(), [Failure(kind="fail_rank", rank=0), Failure(kind="fail_rank", rank=3)])
    assert d.code == "E301" and d.message.startswith("stage 0 has no live GPU left")


def test_validate_failures_replaces_a_specs_failures():
    spec = schedc.load(SPEC + "failures { fail rank 1 }")
    again = validate_failures(spec, [Failure(kind="fail_gpu", dp=1, pp=1)])
    assert [g.rank for g in again.gpus if not g.live] == [4] and "failures.0" not in again.spans
    with pytest.raises(LostStageError) as exc:
        validate_failures(spec, [Failure(kind="fail_rank", rank=0), Failure(kind="fail_rank", rank=3)])
    assert isinstance(exc.value, InfeasibleError) and isinstance(exc.value, SpecError)
    assert exc.value.codes == ["E301"]


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * 2**20, 40 * 2**30)] == \
        ["0B", "1023B", "1KiB", "1.5GiB", "40GiB"]


def test_failures_do_not_import_the_validator():
    # validate -> failures, never back: events and the live runtime use failures without it.
    import ast

    import schedc.failures

    tree = ast.parse(Path(schedc.failures.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "fractions", "types", "typing",
                        "schedc.diagnostics", "schedc.parse", "schedc.spec"}, imported


def test_lost_stage_error_is_still_importable_from_the_validator():
    from schedc import validate

    assert validate.LostStageError is LostStageError
