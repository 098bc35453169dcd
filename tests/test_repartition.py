"""Re-partitioning (`schedc.repartition`) and the recovery cost model (`schedc.recovery_cost`):
the exact partition against brute force, layouts that keep the global batch and pass the verifier,
the bytes a GPU must receive, the deadline's choice, and the choices the cost model makes."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.diagnostics import InfeasibleError
from schedc.load import load_text
from schedc.printer import print_spec
from schedc.recovery_cost import Costs, Horizon, LossRate, Option, choose, grow_delay_s, transition_s
from schedc.layout import held_units, in_flight, layout_spec, received_bytes, units_of
from schedc.repartition import candidate_shapes, partition_units, place, repartition, shapes
from schedc.verify import verify_schedule

GPT = """
model "gpt" {{ layers = {layers} hidden = 1024 heads = 16 seq_len = 2048 vocab = 50304 }}
cluster {{ dp = {dp} pp = {pp} gpus_per_node = 1
          gpu {{ memory = {memory} flops = 312TFLOPS efficiency = 0.45 }}
          link {{ latency = 20us bandwidth = 25GB/s }} }}
train {{ microbatches = {mb} }}
{failures}
"""


def gpt(*, layers=24, dp=2, pp=8, mb=16, memory="40GiB", failures="") -> str:
    return GPT.format(layers=layers, dp=dp, pp=pp, mb=mb, memory=memory, failures=failures)


def stage_spec(costs: list[tuple[int, int, int]], memory_mib: int, dp: int = 2, mb: int = 4) -> str:
    """Explicit stages (the units): (work us, activation MiB, static MiB) each."""
    lines = ["cluster {", f"  dp = {dp}  pp = {len(costs)}  gpus_per_node = 8",
             f"  gpu {{ memory = {memory_mib}MiB }}", "  link { latency = 10us  bandwidth = 1GB/s }", "}",
             "stages {"]
    for s, (w, act, static) in enumerate(costs):
        lines.append(f"  stage {s} {{ forward = {w}us  backward_input = {w}us  backward_weight = {w}us  "
                     f"optimizer = 10us  activation = {act}MiB  stash = 0MiB  static = {static}MiB  send = 1KiB }}")
    return "\n".join(lines + ["}", f"train {{ microbatches = {mb} }}"])


def brute_force(units, dp, pp, mb, memory, holes=0):
    """The smallest bottleneck (work per GPU) over every contiguous split that fits, by enumeration;
    the first `holes` stages have dp - 1 GPUs sharing dp GPUs' work and activations."""
    n, best = units.count, None
    load = [Fraction(dp, dp - 1) if s < holes else 1 for s in range(pp)]
    for cuts in combinations(range(1, n), pp - 1):
        ends = (0, *cuts, n)
        slices = [(ends[i], ends[i + 1]) for i in range(pp)]
        costs = [units.shape_free(a, b) for a, b in slices]
        if all(c.static + math.ceil(in_flight(s, pp, mb) * load[s]) * c.activation <= memory
               for s, c in enumerate(costs)):
            v = max((c.forward + c.backward_input + c.backward_weight) * load[s] for s, c in enumerate(costs))
            best = v if best is None else min(best, v)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 8), st.integers(0, 8)), min_size=2, max_size=7),
       st.integers(12, 60), st.integers(1, 4), st.integers(1, 6))
def test_partition_is_the_smallest_bottleneck_that_fits(costs, memory_mib, dp, mb):
    units = units_of(load_text(stage_spec(costs, 200, dp=dp, mb=mb)))
    memory = memory_mib * 2**20
    for pp in range(1, units.count + 1):
        got = partition_units(units, dp, pp, mb, memory)
        want = brute_force(units, dp, pp, mb, memory)
        if want is None:
            assert got is None
            continue
        assert got is not None and got[0][0] == 0 and got[-1][1] == units.count
        assert all(a < b and (s == 0 or got[s - 1][1] == a) for s, (a, b) in enumerate(got))
        cs = [units.shape_free(a, b) for a, b in got]
        assert all(c.static + in_flight(s, pp, mb) * c.activation <= memory for s, c in enumerate(cs))
        assert max(c.forward + c.backward_input + c.backward_weight for c in cs) == want


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 8), st.integers(0, 8)), min_size=2, max_size=6),
       st.integers(12, 60), st.integers(2, 4), st.integers(1, 6), st.integers(1, 6))
def test_partition_with_holes_is_the_smallest_work_per_gpu(costs, memory_mib, dp, mb, holes):
    units = units_of(load_text(stage_spec(costs, 200, dp=dp, mb=mb)))
    memory = memory_mib * 2**20
    for pp in range(max(1, holes), units.count + 1):
        got = partition_units(units, dp, pp, mb, memory, holes=holes)
        want = brute_force(units, dp, pp, mb, memory, holes=holes)
        if want is None:
            assert got is None
            continue
        load = [Fraction(dp, dp - 1) if s < holes else 1 for s in range(pp)]
        cs = [units.shape_free(a, b) for a, b in got]
        assert max((c.forward + c.backward_input + c.backward_weight) * load[s] for s, c in enumerate(cs)) == want


def test_a_layout_with_a_hole_reaches_a_gpu_count_equal_pipelines_cannot():
    spec = load_text(gpt())
    live = list(range(11))  # 11 GPUs: no D x P of equal pipelines with D dividing 32 uses them all
    rep = repartition(spec, live, deadline=5.0)
    lay = rep.layout
    assert lay.holes == 1 and len(lay.gpus) == 11 and lay.ranks[-1][0] is None
    assert rep.plan.spec.gpus[(lay.dp - 1) * lay.pp].live is False  # the hole is a failed GPU of the layout
    verify_schedule(rep.plan.schedule)
    equal = min(sh.estimate_us for sh in candidate_shapes(spec, 11) if not sh.holes)
    assert min(sh.estimate_us for sh in candidate_shapes(spec, 11) if sh.holes) < equal


def test_shapes_keep_the_global_batch_and_fit_the_gpus():
    for d, p in shapes(32, 24, 13):
        assert 32 % d == 0 and d * p <= 13 and 1 <= p <= 24
    assert (2, 6) in shapes(32, 24, 13) and (1, 13) in shapes(32, 24, 13)
    assert shapes(32, 24, 0) == []


def test_a_lost_stage_is_laid_out_anew_on_the_survivors():
    # Both GPUs of stage 3 (ranks 3 and 11) are gone: re-routing cannot go on, re-partitioning can.
    spec = load_text(gpt())
    live = [r for r in range(16) if r not in (3, 11)]
    rep = repartition(spec, live)
    lay = rep.layout
    assert lay.dp * lay.microbatches == 32 and lay.gpus <= set(live) and len(lay.gpus) == lay.dp * lay.pp
    assert [a for a, _ in lay.slices][0] == 0 and lay.slices[-1][1] == 24
    verify_schedule(rep.plan.schedule)
    # What each GPU receives is exactly the state of the layers it did not hold.
    units, held = units_of(spec), held_units(spec)
    for r, got in rep.received.items():
        s = next(s for row in lay.ranks for s, x in enumerate(row) if x == r)
        need = set(range(*lay.slices[s])) - held[r]
        assert got == sum(units.state_bytes(u, u + 1) for u in need)
    assert rep.max_received < sum(units.state_bytes(u, u + 1) for u in range(24))


def test_the_layout_spec_is_an_ordinary_valid_spec_with_the_same_global_batch():
    spec = load_text(gpt())
    live = list(range(15))
    shape = candidate_shapes(spec, 15)[0]
    new = layout_spec(spec, place(spec, shape, live, held_units(spec)))
    assert (new.dp, new.pp, new.microbatches) == (shape.dp, shape.pp, shape.microbatches)
    assert new.partition == shape.slices and all(g.live for g in new.gpus)
    assert load_text(print_spec(new)) == new


def test_gpus_keep_the_layers_they_hold_where_they_can():
    spec = load_text(gpt(dp=4, pp=4, mb=8))
    units, held = units_of(spec), held_units(spec)
    shape = next(sh for sh in candidate_shapes(spec, 16) if (sh.dp, sh.pp) == (4, 4))
    lay = place(spec, shape, list(range(16)), held)
    assert shape.slices == spec.partition  # the same split as the user's: nothing should move
    assert set(received_bytes(units, lay, held).values()) == {0}


def test_a_slow_gpu_is_left_out_when_a_spare_exists():
    spec = load_text(gpt(failures="failures { slow gpu(dp=0, pp=2) speed = 0.5  fail gpu(dp=1, pp=7) }"))
    live = [g.rank for g in spec.gpus if g.live]
    rep = repartition(spec, live)
    assert len(rep.layout.gpus) == 14 < len(live) and 2 not in rep.layout.gpus


def test_nothing_fits_is_e330():
    spec = load_text(gpt(memory="7GiB", dp=2, pp=8))
    with pytest.raises(InfeasibleError) as info:
        repartition(spec, [0])
    assert info.value.codes[0] == "E330"


def test_repartition_is_deterministic():
    spec = load_text(gpt())
    live = [r for r in range(16) if r not in (4, 12, 7)]
    a, b = repartition(spec, live), repartition(spec, live)
    assert a.layout == b.layout and a.iteration_time == b.iteration_time


def test_a_whole_stage_spec_re_partitions_by_stages():
    spec = load_text(stage_spec([(100, 1, 1)] * 4, 200, dp=2, mb=4))
    rep = repartition(spec, [0, 1, 2, 4, 5, 6])  # stage 3 lost (ranks 3 and 7)
    assert rep.unit == "stage" and rep.layout.slices[-1][1] == 4
    verify_schedule(rep.plan.schedule)


# -- the cost model -----------------------------------------------------------------------------------


def test_choose_never_stalls_while_an_option_can_train():
    stall = Option("reroute", None, 0.0)
    slow_restore = Option("repartition", 0.2, 5000.0, restore=True)  # longer than the horizon
    assert choose([stall, slow_restore], 10.0) is slow_restore


def test_choose_weighs_iteration_time_against_the_transition():
    quick = Option("reroute", 0.20, 1.0)
    fast_but_costly = Option("repartition", 0.10, 60.0)
    assert choose([quick, fast_but_costly], 100).method == "reroute"  # 21 s against 70 s
    assert choose([quick, fast_but_costly], 10_000).method == "repartition"  # 2001 s against 1060 s
    tie = [Option("drop-pipeline", 0.1, 1.0), Option("reroute", 0.1, 1.0)]
    assert choose(tie, 100).method == "reroute"


def test_transition_prices_moves_rollback_and_restores():
    c = Costs(reconfigure_s=1.0, restart_s=30.0, checkpoint_every_s=600.0)
    assert transition_s(c, lost_gpus=False, moved_bytes=0, bandwidth=10, previous_iteration_s=0.5) == 1.0
    assert transition_s(c, lost_gpus=True, moved_bytes=20, bandwidth=10, previous_iteration_s=0.5) == 3.5
    assert transition_s(c, lost_gpus=True, moved_bytes=0, bandwidth=10, previous_iteration_s=0.5,
                        restore=True) == 1.0 + 0.5 + 30.0 + 300.0
    assert transition_s(c, lost_gpus=False, moved_bytes=0, bandwidth=10, previous_iteration_s=0.5,
                        restore=True, planned=True) == 31.0


def test_ski_rental_buys_once_the_rent_reaches_the_price():
    assert grow_delay_s(0.2, Option("repartition", 0.1, 5.0)) == pytest.approx(10.0)  # half the time lost
    assert grow_delay_s(0.2, Option("repartition", 0.2, 5.0)) is None
    assert grow_delay_s(0.2, Option("repartition", None, 0.0)) is None


def test_horizon_is_the_mean_gap_after_the_default():
    h = Horizon(900.0)
    assert h.seconds == 900.0
    h.event(0.0)
    h.event(0.0)  # the same moment: not a gap
    assert h.seconds == 900.0
    h.event(100.0)
    h.event(400.0)
    assert h.seconds == pytest.approx(200.0)


def test_failures_of_one_burst_are_one_event_for_the_horizon():
    h = Horizon(900.0, burst_s=60.0)
    for t in (0.0, 0.2, 1.5, 59.0):  # one reclaim, its GPUs found failed one after another
        h.event(t)
    assert h.seconds == 900.0
    h.event(300.0)
    h.event(330.0)  # (the second burst's)
    h.event(600.0)
    assert h.seconds == pytest.approx(300.0)


def test_a_burst_found_in_several_decisions_is_one_loss_for_the_loss_rate():
    loss = LossRate(burst_s=60.0)
    loss.event(3, 12, 0.0, plan="a")  # a reclaim: 3 of 12 GPUs found first ...
    loss.event(3, 12, 0.1, plan="a")  # ... decided again on the same plan (a dump first): the same 3
    loss.event(1, 9, 0.5, plan="b")  # ... one more found after a plan of the 9 left ...
    loss.event(2, 9, 0.6, plan="b")  # ... and another, on that plan (it names both since it began)
    assert loss.fraction == pytest.approx(5 / 12)
    grown = LossRate(burst_s=60.0)
    grown.event(3, 12, 0.0, plan="a")
    grown.event(2, 12, 0.3, plan="c")  # a plan as large (replacements): its losses are new ones
    assert grown.fraction == pytest.approx(5 / 12)
    loss.event(0, 8)  # a GPU back: an event that is no loss
    loss.event(2, 9, 400.0)  # another burst
    assert loss.fraction == pytest.approx((5 / 12 + 2 / 9) / 2) and loss.share == pytest.approx(2 / 3)
    # Without times (the replay's events are whole already) every call is an event.
    plain = LossRate(burst_s=60.0)
    plain.event(3, 12)
    plain.event(1, 9)
    assert plain.fraction == pytest.approx((3 / 12 + 1 / 9) / 2)


# -- the spec's `recovery` block ---------------------------------------------------------------------

RECOVERY_SPEC = """
cluster { dp = 2  pp = 2  gpu { memory = 8GiB } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 0.5ms  optimizer = 0.2ms
               activation = 512MiB  stash = 128MiB  static = 1GiB  send = 8MiB } }
train { microbatches = 4 }
recovery { policy = POLICY  horizon = 600s  checkpoint_every = 60s  restart_cost = 0.5s }
"""


def test_the_recovery_block_sets_the_costs_and_options_override_it():
    spec = load_text(RECOVERY_SPEC.replace("POLICY", "drop-pipeline"))
    assert load_text(print_spec(spec)) == spec
    c = Costs.of(spec.recovery)
    assert (c.horizon_s, c.checkpoint_every_s, c.restart_s, c.reconfigure_s) == (600.0, 60.0, 0.5, 1.0)
    assert Costs.of(spec.recovery, horizon_s=30.0, restart_s=None).horizon_s == 30.0
    assert Costs.of(None) == Costs()


def test_train_takes_the_spec_policy_unless_told_otherwise():
    from schedc.diagnostics import RunError
    from schedc.live.options import TrainOptions

    spec = load_text(RECOVERY_SPEC.replace("POLICY", "drop-pipeline"))
    assert (TrainOptions().with_spec(spec).recovery, TrainOptions().with_spec(spec).horizon) == ("drop-pipeline", 600.0)
    assert TrainOptions(recovery="reroute", horizon=5.0).with_spec(spec).recovery == "reroute"
    plain = load_text(RECOVERY_SPEC.split("recovery {")[0])
    assert (TrainOptions().with_spec(plain).recovery, TrainOptions().with_spec(plain).horizon) == ("auto", 900.0)
    assert TrainOptions().with_spec(load_text(RECOVERY_SPEC.replace("POLICY", "repartition"))).recovery == "repartition"
    # Several hosts re-partition too (each rank of the new layout starts on its GPU's host).
    assert TrainOptions(hosts=2).with_spec(load_text(RECOVERY_SPEC.replace("POLICY", "repartition"))).hosts == 2
    with pytest.raises(RunError):  # restart needs checkpoints
        TrainOptions().with_spec(load_text(RECOVERY_SPEC.replace("POLICY", "restart")))
