"""Tensor parallelism in the spec: a schedc GPU (dp, pp) is a TP group of `tp` real GPUs.

Real GPUs are numbered rank * tp + t; nodes hold gpus_per_node real GPUs; `fail rank R`
names a real GPU (its group fails), `fail node N` every group on node N. With
placement = stage_major the numbering is Megatron-LM's default order (tp fastest, then dp,
then pp) and torchtitan's ["pp", "dp", "tp"] device mesh.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedc
from schedc.diagnostics import RunError, SpecError

STAGES = """stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 1ms
               activation = 1GiB  stash = 256MiB  static = 10GiB  send = 1MiB } }
train { microbatches = 8 }
schedule { solver = greedy }
"""


def spec(cluster: str, failures: str = "") -> schedc.Spec:
    text = f"cluster {{ {cluster}  gpu {{ memory = 80GiB }} }}\n" + STAGES
    if failures:
        text += f"failures {{ {failures} }}\n"
    return schedc.load(text)


def failed(s) -> list[tuple[int, int]]:
    return [(g.dp, g.pp) for g in s.gpus if not g.live]


def test_a_real_gpu_fails_its_whole_group_and_two_of_one_group_are_one_failure():
    s = spec("dp = 4  pp = 4  tp = 8  gpus_per_node = 8", "fail rank 9  fail rank 15  fail rank 100")
    assert failed(s) == [(0, 1), (3, 0)]  # ranks 9, 15 -> group 1 = (0, 1); 100 -> group 12 = (3, 0)


@pytest.mark.parametrize("tp", [1, 8])
def test_the_same_rank_twice_is_still_listed_twice(tp):
    with pytest.raises(SpecError) as exc:
        spec(f"dp = 4  pp = 4  tp = {tp}  gpus_per_node = 8", "fail rank 9  fail rank 9")
    assert [d.code for d in exc.value.diagnostics] == ["E208"]


def test_a_node_fails_the_groups_on_it():
    s = spec("dp = 2  pp = 4  tp = 4  gpus_per_node = 8", "fail node 1")  # node 1: groups 2 and 3
    assert failed(s) == [(0, 2), (0, 3)]
    assert [g.node for g in s.gpus] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_megatron_order_is_stage_major():
    """Megatron's default rank = t + tp * (d + dp * s): the same real GPU as stage_major's group."""
    c = spec("dp = 4  pp = 2  tp = 2  gpus_per_node = 8  placement = stage_major").cluster
    for d in range(4):
        for s in range(2):
            for t in range(2):
                assert c.device_ranks(c.rank_of(d, s))[t] == t + 2 * (d + 4 * s)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 16]),
       st.sampled_from(["pipeline_major", "stage_major"]), st.data())
def test_every_real_gpu_maps_to_the_group_holding_it(dp, pp, tp, gpn, placement, data):
    c = spec(f"dp = {dp}  pp = {pp}  tp = {tp}  gpus_per_node = {gpn}  placement = {placement}").cluster
    assert c.devices == dp * pp * tp and c.nodes == -(-c.devices // gpn)
    for r in range(c.world_size):
        devices = c.device_ranks(r)
        assert {dev // gpn for dev in devices} == {c.node_of(r)}  # a group sits inside one node
        assert r in c.ranks_on_node(c.node_of(r))
    device = data.draw(st.integers(0, c.devices - 1))
    d, p = c.coords_of(device // tp)
    s = spec(f"dp = {dp}  pp = {pp}  tp = {tp}  gpus_per_node = {gpn}  placement = {placement}",
             f"fail rank {device}") if dp > 1 else None
    if s is not None:
        assert failed(s) == [(d, p)]


@pytest.mark.parametrize("cluster, failures, code", [
    ("dp = 2  pp = 2  tp = 3  gpus_per_node = 8", "", "E206"),  # a group would straddle nodes
    ("dp = 2  pp = 2  tp = 4  gpus_per_node = 8", "fail rank 16", "E207"),  # ranks 0..15
    ("dp = 2  pp = 2  tp = 4  gpus_per_node = 8", "fail node 2", "E207"),  # nodes 0..1
])
def test_bad_tp_specs(cluster, failures, code):
    with pytest.raises(SpecError) as exc:
        spec(cluster, failures)
    assert [d.code for d in exc.value.diagnostics] == [code]


def test_the_cost_model_does_not_guess_tp():
    text = ("model { layers = 4 hidden = 64 heads = 4 seq_len = 64 vocab = 100 }\n"
            "cluster { dp = 2 pp = 2 tp = 2 gpu { memory = 80GiB flops = 1TFLOPS } }\ntrain { microbatches = 4 }\n")
    with pytest.raises(SpecError) as exc:
        schedc.load(text)
    assert exc.value.diagnostics[0].code == "E214"


def test_print_load_round_trip_and_replan_by_real_rank(tmp_path):
    s = spec("dp = 4  pp = 4  tp = 8  gpus_per_node = 8", "fail rank 9")
    assert schedc.load(schedc.print_spec(s)) == s
    plan = schedc.compile(s)
    plan = schedc.replan(plan, "fail rank 100")
    assert failed(plan.spec) == [(0, 1), (3, 0)]
    plan.write(tmp_path / "out")
    assert "tp = 8" in (tmp_path / "out" / "spec.sched").read_text()
    from schedc.runtime import launch

    with pytest.raises(RunError) as exc:
        launch(tmp_path / "out", iterations=1)
    assert exc.value.diagnostics[0].code == "E526"
