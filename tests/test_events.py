"""Replan events: parsing and applying fail / slow / recover to a Spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedc.diagnostics import SpecError
from schedc.events import apply_events, parse_events
from schedc.load import load
from schedc.spec import Failure

SPECS = Path(__file__).parent.parent / "specs"


def _down(spec):
    return {(g.dp, g.pp) for g in spec.gpus if not g.live}


def test_parse_events_forms():
    evs = parse_events(["fail gpu(dp=1, pp=2)", "fail node 3", "slow gpu(dp=0, pp=3) speed = 0.7",
                        "recover gpu(dp=1, pp=2)", Failure(kind="fail_rank", rank=4)])
    assert [e.kind for e in evs] == ["fail_gpu", "fail_node", "slow_gpu", "recover_gpu", "fail_rank"]
    assert evs[2].speed == 0.7 and evs[1].node == 3
    assert len(parse_events("fail rank 1 fail rank 2")) == 2


def test_event_errors_point_inside_the_event():
    with pytest.raises(SpecError) as e:
        parse_events("slow gpu(dp=0, pp=3) speed = 1.7")
    d = e.value.diagnostics[0]
    assert (d.code, d.span.file, d.span.column) == ("E206", "<event>", 30)
    with pytest.raises(SpecError) as e:
        parse_events("fial gpu(dp=0, pp=3)")
    assert e.value.diagnostics[0].span.column == 1


def test_apply_fail_slow_recover():
    spec = load(SPECS / "small-2x2.sched")
    s1 = apply_events(spec, "fail gpu(dp=1, pp=0)")
    assert _down(s1) == {(1, 0)} and len(s1.failures) == 1
    s2 = apply_events(s1, "slow gpu(dp=0, pp=1) speed = 0.5")
    assert s2.gpu(0, 1).speed == 0.5
    s3 = apply_events(s2, "slow gpu(dp=0, pp=1) speed = 0.8")  # replaces the speed
    assert s3.gpu(0, 1).speed == 0.8 and len(s3.failures) == 2
    s4 = apply_events(s3, ["recover gpu(dp=1, pp=0)", "recover gpu(dp=0, pp=1)"])
    assert s4 == spec
    assert apply_events(s1, "fail gpu(dp=1, pp=0)") == s1  # repeated event: no change


def test_fail_node_and_recover_one_gpu_of_it():
    spec = load(SPECS / "slow-gpu.sched")  # 3x3, gpus_per_node 3: node 1 = pipeline 1
    s = apply_events(spec, "fail node 1")
    assert _down(s) == {(1, 0), (1, 1), (1, 2)}
    r = apply_events(s, "recover gpu(dp=1, pp=1)")
    assert _down(r) == {(1, 0), (1, 2)}


def test_a_lost_stage_names_what_each_event_fails_and_what_had_failed_before():
    """Node 0 holds both GPUs of stage 0 (stage_major); GPU (dp=0, pp=0) failed in an earlier
    replan. `fail node 0` then fails GPU (dp=1, pp=0) alone: E301 said "all 2 of its replicas
    failed" with two notes, both `<event>:1:1` without a word, one of them the earlier call's."""
    spec = load((SPECS / "small-2x2.sched").read_text().replace("gpus_per_node = 2", "gpus_per_node = 2  "
                                                                "placement = stage_major", 1))
    earlier = apply_events(spec, "fail gpu(dp=0, pp=0)")
    with pytest.raises(SpecError) as e:
        apply_events(earlier, "fail node 0")
    assert e.value.render() == "\n".join([
        "error[E301]: stage 0 has no live GPU left: `fail node 0` fails GPU (dp=1, pp=0); GPU (dp=0, pp=0) had "
        "failed before",
        " --> <event>:1:1",
        "  |",
        "1 | fail node 0",
        "  | ^^^^^^^^^^^ fails GPU (dp=1, pp=0), the last live replica of stage 0",
        "  = hint: the weights of stage 0 exist on no live GPU: restore from a checkpoint onto replacement GPUs",
    ])
    with pytest.raises(SpecError) as e:  # two events of one call: each says what it fails
        apply_events(spec, ["fail gpu(dp=1, pp=0)", "fail node 0"])
    (d,) = e.value.diagnostics
    assert d.message == ("stage 0 has no live GPU left: `fail gpu(dp=1, pp=0)` fails GPU (dp=1, pp=0); "
                         "`fail node 0` fails GPU (dp=0, pp=0)")
    assert (d.span.file, d.label) == ("<event 1>", "fails GPU (dp=0, pp=0), the last live replica of stage 0")
    assert [(n.span.file, n.message) for n in d.notes] == [("<event 0>", "fails GPU (dp=1, pp=0) of stage 0")]


def test_losing_a_stage_is_e301_and_bad_targets_fail():
    spec = load(SPECS / "small-2x2.sched")
    with pytest.raises(SpecError) as e:
        apply_events(spec, ["fail gpu(dp=0, pp=1)", "fail gpu(dp=1, pp=1)"])
    assert e.value.codes == ["E301"]
    with pytest.raises(SpecError) as e:
        apply_events(spec, "fail gpu(dp=5, pp=0)")
    assert e.value.codes == ["E207"]
    with pytest.raises(SpecError) as e:
        apply_events(spec, "recover gpu(dp=0, pp=0)")
    assert e.value.codes == ["E216"]
    with pytest.raises(SpecError) as e:
        apply_events(apply_events(spec, "fail rank 0"), "slow gpu(dp=0, pp=0) speed = 0.5")
    assert e.value.codes == ["E208"]
