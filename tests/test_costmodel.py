"""The analytic transformer cost model against hand-computed numbers (docs/costmodel.md)."""

from __future__ import annotations


from schedc import costmodel
from schedc.load import load
from schedc.spec import ClusterSpec, GpuSpec, LinkSpec, ModelSpec

# One layer, b=1 s=1024 h=1024 a=16: numbers worked out by hand.
MODEL = ModelSpec(layers=1, hidden=1024, heads=16, seq_len=1024, vocab=1000, microbatch_size=1, precision="bf16")
CLUSTER = ClusterSpec(dp=2, pp=1, gpus_per_node=8, placement="pipeline_major",
                      gpu=GpuSpec(memory=80 << 30, flops=100e12, efficiency=0.5),
                      link=LinkSpec(latency=10, bandwidth=10**10))


def test_one_layer_by_hand():
    c = costmodel.layer_costs(MODEL)
    # 24*b*s*h^2 = 24 * 1024^3 = 25769803776; 4*b*s^2*h = 4 * 1024^3 = 4294967296
    assert c.forward == 25_769_803_776 + 4_294_967_296 == 30_064_771_072
    assert c.backward_input == 25_769_803_776 + 8_589_934_592
    assert c.backward_weight == 25_769_803_776
    assert c.params == 12 * 1024**2 + 13 * 1024 == 12_596_224
    # sbh(34 + 5as/h) bytes = 1024*1024*(34 + 80) = 119537664
    assert c.activation == 119_537_664
    assert c.stash == 16 * 1024 * 1024 * 2 == 33_554_432
    # 30064771072 FLOPs at 100 TFLOPS * 0.5 = 601.3 µs -> 602
    assert costmodel.flops_time(c.forward, CLUSTER) == 602
    assert costmodel.static_bytes_per_param(MODEL, "adam") == 16
    assert costmodel.static_bytes_per_param(MODEL, "sgd") == 8


def test_stage_costs_add_embedding_and_head():
    st = costmodel.stage_costs(MODEL, CLUSTER, "adam", 0, (0, 1))
    layer, emb, head = costmodel.layer_costs(MODEL), costmodel.embedding_costs(MODEL), costmodel.head_costs(MODEL)
    assert head.forward == 2 * 1024 * 1024 * 1000
    params = layer.params + emb.params + head.params
    assert st.static == 16 * params
    assert st.send == 1024 * 1024 * 2
    assert st.activation == layer.activation + emb.activation + head.activation
    assert st.forward == costmodel.flops_time(layer.forward + head.forward, CLUSTER)
    # optimizer: 2 * 16 B/param at 2 TB/s + ring all-reduce of bf16 grads over dp=2 + 2 latencies
    step = -(-2 * 16 * params * 10**6 // costmodel.HBM_BANDWIDTH)
    ring = -(-2 * 1 * 2 * params * 10**6 // (2 * 10**10))
    assert st.optimizer == step + ring + 2 * 10


def test_balanced_partition_is_contiguous_and_optimal():
    model = ModelSpec(layers=10, hidden=512, heads=8, seq_len=512, vocab=50000)
    part = costmodel.balanced_partition(model, 4)
    assert part[0][0] == 0 and part[-1][1] == 10 and all(a < b for a, b in part)
    assert all(part[i][1] == part[i + 1][0] for i in range(3))
    cost = [costmodel.part_of_stage(model, a, b).flops for a, b in part]
    # brute force over every contiguous split: none has a smaller maximum
    import itertools
    best = min(max(costmodel.part_of_stage(model, a, b).flops for a, b in zip((0,) + cuts, cuts + (10,)))
               for cuts in itertools.combinations(range(1, 10), 3))
    assert max(cost) == best
    assert costmodel.balanced_partition(model, 4) == part  # deterministic


def test_derived_spec_uses_partition_or_balances(tmp_path):
    spec = load("specs/gpt-1.3b.sched")
    assert spec.costs == "derived" and spec.partition == ((0, 7), (7, 13), (13, 19), (19, 24))
    assert spec.stages[1].forward == costmodel.flops_time(6 * costmodel.layer_costs(spec.model).forward,
                                                          spec.cluster)
    text = open("specs/gpt-1.3b.sched").read().split("partition")[0] + "train { microbatches = 4 }\n"
    balanced = load(text)
    assert balanced.partition == costmodel.balanced_partition(balanced.model, 4)


def test_explicit_stages_win():
    spec = load("specs/mlp-2x2.sched")
    assert spec.costs == "explicit" and spec.stages[0].forward == 2000
