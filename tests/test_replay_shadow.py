"""`schedc replay --shadow`: the model of `schedc train --shadow` (stage s's state also on the
GPUs of stage s + 1): what it adds to an iteration, when it fits, and what a burst costs with it."""

from __future__ import annotations

import json

import pytest

import schedc
import schedc.cli as cli
from schedc.layout import Layout, shadow_fits, shadow_stage, shadows_of, units_of
from schedc.recovery_cost import Costs, LossRate, restore_risk_s
from schedc.replay import Planner, replay
from schedc.trace import availability, parse_trace

GIB = 2**30
# 2 pipelines of 3 stages whose GPUs have room for a shadow: 1 GiB of static state a stage, 8 GiB a GPU.
SPEC_TEXT = """
cluster { dp = 2  pp = 3  gpus_per_node = 2
          gpu { memory = 8GiB }  link { latency = 10us  bandwidth = 100GB/s } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 0.5ms  optimizer = 0.2ms
               activation = 256MiB  stash = 64MiB  static = 1GiB  send = 8MiB } }
train { microbatches = 4 }
"""
# The same job on GPUs whose 8 GiB cannot hold a 5 GiB stage and its 5 GiB shadow.
TIGHT_TEXT = SPEC_TEXT.replace("static = 1GiB", "static = 5GiB")

STATIC = GIB
GRADIENT = STATIC * 2 // 16  # bf16 Adam: 16 bytes a parameter, 2 of them the gradient
STEP_US = -(-2 * STATIC * 10**6 // 2_000_000_000_000)  # the cost model's step: state read and written at 2 TB/s
TRANSFER_US = 10 + -(-GRADIENT * 10**6 // 100_000_000_000)  # latency + gradient / bandwidth


@pytest.fixture(scope="module")
def spec():
    return schedc.load(SPEC_TEXT, name="shadow.sched")


def burst(spec, lost_stages: set[int], live_after: int) -> tuple:
    """A trace with one loss at 600 s leaving `live_after` GPUs, and a seed whose pick takes every
    GPU of exactly the stages `lost_stages`."""
    trace = parse_trace(f"0,6\n600,{live_after}\n3600,{live_after}\n", "burst.csv")
    stage = {g.rank: g.pp for g in spec.gpus}
    everyone = frozenset(stage)
    for seed in range(200):
        lost = everyone - availability(trace, len(everyone), seed=seed)[1][1]
        if {stage[r] for r in lost} == lost_stages and len(lost) == 2 * len(lost_stages):
            return trace, seed
    raise AssertionError("no seed takes those stages")  # pragma: no cover


def test_shadow_of_each_stage_is_the_previous_one():
    assert [shadow_stage(s, 3) for s in range(3)] == [2, 0, 1]
    assert shadow_stage(0, 1) is None
    layout = Layout(2, 3, 4, ((0, 1), (1, 2), (2, 3)), ((0, 1, 2), (3, None, 5)))
    assert shadows_of(layout) == {0: {2}, 1: {0}, 2: {1}, 3: {2}, 5: {1}}
    assert shadows_of(Layout(1, 1, 8, ((0, 3),), ((0,),))) == {0: frozenset()}


def test_overhead_is_the_shadow_step_and_what_an_iteration_does_not_hide_of_the_stream(spec):
    p = Planner(spec, shadow=True)
    user = p.user_layout(p.all)
    # The stream overlaps the next iteration (a shadow lags its holder by a step): an iteration
    # at least as long hides it; the holders' step on the shadow is always paid.
    assert p.shadow_s(user, 1.0) == pytest.approx(STEP_US / 1e6)
    assert p.shadow_s(user, 0.0) == pytest.approx((TRANSFER_US + STEP_US) / 1e6)
    # Stage 1 one GPU short: its one GPU sends stage 1's gradient to both GPUs of stage 2, in turn;
    # an iteration as long as one transfer hides half of that.
    holed = p.user_layout(p.all - {next(g.rank for g in spec.gpus if g.pp == 1)})
    assert p.shadow_s(holed, TRANSFER_US / 1e6) == pytest.approx((TRANSFER_US + STEP_US) / 1e6)
    assert Planner(spec).shadow_s(user, 1.0) is None  # shadows off
    one_stage = Layout(1, 1, 8, ((0, 3),), ((0,),))
    assert p.shadow_s(one_stage, 1.0) is None


def test_memory_rule_counts_the_previous_stages_static_state(spec):
    units = units_of(spec)
    user = Planner(spec).user_layout(frozenset(range(6)))
    # Stage 0 holds its own 1 GiB, stage 2's 1 GiB shadow and 3 microbatches' activations.
    need = 2 * STATIC + 3 * 256 * 2**20
    assert shadow_fits(units, user, need)
    assert not shadow_fits(units, user, need - 1)
    # With one GPU of stage 0 left, it holds the two pipelines' 6 microbatches in flight.
    short = Layout(2, 3, 4, user.slices, ((None, 1, 2), (3, 4, 5)))
    assert shadow_fits(units, short, 2 * STATIC + 6 * 256 * 2**20)
    assert not shadow_fits(units, short, 2 * STATIC + 6 * 256 * 2**20 - 1)


def test_a_layout_without_room_runs_without_shadows():
    tight = schedc.load(TIGHT_TEXT, name="tight.sched")
    p = Planner(tight, shadow=True)
    assert p.shadow_s(p.user_layout(p.all), 1.0) is None
    trace = parse_trace("0,6\n600,4\n1800,6\n3600,6\n", "t.csv")
    on = replay(tight, trace, seed=1, shadow=True).to_json(decisions=True)
    off = replay(tight, trace, seed=1).to_json(decisions=True)
    assert on["shadow"] is True and on["shadow_overhead_s"] is None
    # Nothing is charged and nothing is protected: the same replay as without shadows.
    assert on["policies"] == off["policies"]


def test_a_stage_lost_with_its_holders_alive_loses_no_work(spec):
    trace, seed = burst(spec, {0}, 4)
    costs = Costs()
    on = replay(spec, trace, seed=seed, policies=["repartition", "auto", "restart"], shadow=True)
    off = replay(spec, trace, seed=seed, policies=["repartition", "auto"])
    before = on.fault_free_iteration_s + on.shadow_overhead_s
    assert on.checkpoint_bytes == 3 * (STATIC - GRADIENT)
    for name in ("repartition", "auto"):
        # Re-partitioned in place (`schedc train --shadow`): the lost stage's layers move from its
        # shadows over the link: reconfigure + the interrupted iteration + the largest share moved.
        d = on.policies[name].decisions[0]
        assert not d.chosen.restore and d.chosen.local and "moved in place" in d.chosen.detail
        assert d.chosen.moved_bytes > 0 and d.to_json()["restore"] == "in place"
        assert d.chosen.transition_s == pytest.approx(
            costs.reconfigure_s + before + d.chosen.moved_bytes / spec.cluster.link.bandwidth)
        assert on.policies[name].transition_s == pytest.approx(d.chosen.transition_s)
        p = on.policies[name]
        assert (p.local_restores, p.in_place_moves, p.checkpoint_restarts) == (0, 1, 0)
    # A restart restarts every process: the survivors' states go through local disk first:
    # reconfigure + the interrupted iteration + the restart + the whole state written and read.
    d = on.policies["restart"].decisions[0]
    assert d.chosen.restore and d.chosen.local and "shadows" in d.chosen.detail
    assert d.chosen.transition_s == pytest.approx(
        costs.reconfigure_s + before + costs.restart_s + 2 * on.checkpoint_bytes / costs.disk_bandwidth)
    assert (on.policies["restart"].local_restores, on.policies["restart"].checkpoint_restarts) == (1, 0)
    for name in ("repartition", "auto"):
        # Without shadows the same burst sends the job back to the checkpoint: the work since it is lost.
        d_off = off.policies[name].decisions[0]
        assert d_off.chosen.restore and not d_off.chosen.local and "checkpoint" in d_off.chosen.detail
        assert d_off.chosen.transition_s >= costs.restart_s + costs.lost_work_s
        assert off.policies[name].checkpoint_restarts == 1 and off.policies[name].local_restores == 0


def test_a_stage_lost_with_its_holders_comes_from_the_checkpoint(spec):
    # Stages 0 and 1 go: stage 0's shadow was on stage 1's GPUs, so no live GPU holds stage 0.
    trace, seed = burst(spec, {0, 1}, 2)
    costs = Costs()
    on = replay(spec, trace, seed=seed, policies=["repartition"], shadow=True)
    d = on.policies["repartition"].decisions[0]
    assert d.chosen.iteration_s is not None
    assert d.chosen.restore and not d.chosen.local and "checkpoint" in d.chosen.detail
    assert d.chosen.transition_s >= costs.restart_s + costs.lost_work_s
    assert (on.policies["repartition"].checkpoint_restarts, on.policies["repartition"].local_restores) == (1, 0)


def test_after_a_repartition_the_shadows_are_the_new_layouts(spec):
    # Stage 0 goes, then (in the re-partitioned layout) more GPUs: what is held follows the new layout.
    trace, seed = burst(spec, {0}, 4)
    on = replay(spec, trace, seed=seed, policies=["repartition"], shadow=True)
    chosen = on.policies["repartition"].decisions[0].chosen
    layout = chosen.plan
    assert isinstance(layout, Layout) and chosen.shadows == (layout.pp > 1)
    from schedc.replay import _Run

    run = _Run("repartition", Planner(spec, shadow=True, seed=seed), Costs(), LossRate())
    live = availability(trace, 6, seed=seed)[1][1]
    run.event(600.0, live, 900.0)
    assert run.layout is not None
    assert run.shadow == {r: shadows_of(run.layout).get(r, frozenset()) for r in live}


def test_risk_counts_the_holders():
    costs, loss = Costs(), LossRate(fraction=0.1, share=0.5)
    plain = restore_risk_s(costs, [2, 2], loss)
    assert plain == pytest.approx(0.5 * 2 * 0.01 * (costs.restart_s + costs.lost_work_s))
    state = 5 * 10**9
    shadowed = restore_risk_s(costs, [2, 2], loss, holders=[2, 2], local_bytes=state)
    expected = 0.5 * (2 * 1e-4 * (costs.restart_s + costs.lost_work_s)
                      + 2 * (0.01 - 1e-4) * costs.local_restore_s(state))
    assert shadowed == pytest.approx(expected)
    assert shadowed < plain


def test_all_gpus_up_pays_only_the_overhead(spec):
    trace = parse_trace("0,6\n3600,6\n", "up.csv")
    r = replay(spec, trace, policies=["auto"], shadow=True)
    p = r.policies["auto"]
    assert p.samples_fraction == pytest.approx(r.fault_free_iteration_s / (r.fault_free_iteration_s
                                                                          + r.shadow_overhead_s))
    assert (p.switches, p.transition_s) == (0, 0.0)


def test_cli_shadow_flag(tmp_path, capsys, spec):
    (tmp_path / "shadow.sched").write_text(SPEC_TEXT)
    trace, seed = burst(spec, {0}, 4)
    (tmp_path / "burst.csv").write_text("0,6\n600,4\n3600,4\n")
    args = ["replay", str(tmp_path / "shadow.sched"), str(tmp_path / "burst.csv"), "--seed", str(seed),
            "--policy", "repartition", "--json", "--decisions"]
    assert cli.main(args + ["--shadow"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shadow"] is True and out["costs"]["disk_bandwidth"] == Costs().disk_bandwidth
    assert out["shadow_overhead_s"] == pytest.approx(STEP_US / 1e6)  # (the iteration hides the stream)
    rep = out["policies"]["repartition"]
    assert rep["in_place_moves"] == 1 and rep["decisions"][0]["restore"] == "in place"
    assert cli.main(args) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["shadow"] is False and "disk_bandwidth" not in off["costs"]
    assert off["policies"]["repartition"]["decisions"][0]["restore"] == "checkpoint"
    assert cli.main(args[:-2] + ["--shadow"]) == 0
    text = capsys.readouterr().out
    assert "shadows" in text and "no work lost" in text
