"""The CP-SAT layout (`schedc.solvers.partition_cpsat`): the optimum that brute force finds on
small instances, valid layouts, deterministic, never worse than greedy, and strictly better where
a slow GPU must be used. Checked by functions written from the definitions, not the model."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.load import load_text
from schedc.layout import (
    Layout,
    fits,
    held_units,
    in_flight,
    layout_bottleneck,
    layout_objective,
    layout_optimizer,
    transition_us,
    units_of,
    work,
)
from schedc.repartition import Shape, candidate_shapes, greedy_layout, place
from schedc.solvers.partition_cpsat import solve_layout

GPT_350M = """
model "gpt-350m" { layers = 24 hidden = 1024 heads = 16 seq_len = 2048 vocab = 50304
                   microbatch_size = 1 precision = bf16 }
cluster { dp = 2 pp = 8 gpus_per_node = 1
          gpu { memory = 40GiB flops = 312TFLOPS efficiency = 0.45 }
          link { latency = 20us bandwidth = 25GB/s } }
train { microbatches = 16 }
"""


def _stage_spec(draw, dp: int, n: int) -> str:
    """A spec with explicit costs: its `n` stages are the units."""
    lines = ["cluster {", f"  dp = {dp}  pp = {n}  gpus_per_node = 8", "  gpu { memory = 80GiB }",
             "  link { latency = 10us  bandwidth = 1GB/s }", "}", "stages {"]
    for s in range(n):
        f, b, w = (draw(st.integers(1, 40)) * 100 for _ in range(3))
        act, static = draw(st.integers(1, 8)), draw(st.integers(0, 8))
        lines.append(f"  stage {s} {{ forward = {f}us  backward_input = {b}us  backward_weight = {w}us  "
                     f"optimizer = 100us  activation = {act}MiB  stash = 0MiB  static = {static}MiB  send = 1KiB }}")
    return "\n".join(lines + ["}", "train { microbatches = 2 }"])


def _layer_spec(draw, dp: int, n: int) -> str:
    """A tiny GPT with `n` layers (derived costs: embedding and head on the ends, rounding)."""
    pp = draw(st.integers(1, n))
    return (f'model "tiny" {{ layers = {n} hidden = 64 heads = 4 seq_len = 128 vocab = 512 }}\n'
            f"cluster {{ dp = {dp} pp = {pp} gpus_per_node = 8 "
            "gpu { memory = 80GiB flops = 1TFLOPS efficiency = 0.5 } "
            "link { latency = 10us bandwidth = 1GB/s } }\n"
            "train { microbatches = 2 }")


@st.composite
def layout_problems(draw):
    """(units, dp, pp, microbatches, memory, gpus, held, speed, horizon, bandwidth): at most 6 live
    GPUs and 5 units, so that brute force is quick."""
    kind = draw(st.sampled_from(["stage", "layer"]))
    n = draw(st.integers(2, 5))
    job_dp = draw(st.integers(1, 2))
    spec = load_text(_stage_spec(draw, job_dp, n) if kind == "stage" else _layer_spec(draw, job_dp, n))
    units = units_of(spec)
    ranks = [g.rank for g in spec.gpus]
    gpus = sorted(draw(st.lists(st.sampled_from(ranks), min_size=1, max_size=6, unique=True)))
    dp = draw(st.integers(1, min(2, len(gpus))))
    pp = draw(st.integers(1, min(n, len(gpus) // dp)))
    microbatches = draw(st.integers(1, 4))
    if draw(st.booleans()):
        held = held_units(spec)
    else:
        held = {r: frozenset(draw(st.sets(st.integers(0, n - 1), max_size=n))) for r in ranks}
    speed = {r: draw(st.sampled_from([1.0, 1.0, 0.75, 0.5])) for r in gpus}
    # Memory around the least that some split fits in: binding, ample, or just too little.
    memory = int(_least_memory(units, dp, pp, microbatches) * draw(st.sampled_from([1.0, 1.2, 3.0, 0.99])))
    horizon = draw(st.sampled_from([1, 3, 100]))
    bandwidth = draw(st.sampled_from([10**9, 25 * 10**9, 123456789]))
    return units, dp, pp, microbatches, memory, gpus, held, speed, horizon, bandwidth


def _need(c, s: int, pp: int, microbatches: int) -> int:
    return c.static + in_flight(s, pp, microbatches) * c.activation  # `fits`' left-hand side


def _least_memory(units, dp: int, pp: int, microbatches: int) -> int:
    n = units.count
    return min(max(_need(units.slice_costs(a, b, dp, pp, s), s, pp, microbatches)
                   for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))))
               for cuts in combinations(range(1, n), pp - 1))


def check_layout(layout: Layout, units, dp: int, pp: int, microbatches: int, memory: int, gpus) -> None:
    """A valid layout, from the definitions: contiguous non-empty slices covering every unit, each
    within memory, `dp` x `pp` slots, each run by a distinct one of `gpus`."""
    assert (layout.dp, layout.pp, layout.microbatches) == (dp, pp, microbatches)
    assert len(layout.slices) == pp and layout.slices[0][0] == 0 and layout.slices[-1][1] == units.count
    for (a, b), (c, _) in zip(layout.slices, layout.slices[1:]):
        assert b == c
    for s, (a, b) in enumerate(layout.slices):
        assert a < b
        assert fits(units.slice_costs(a, b, dp, pp, s), s, pp, microbatches, memory)
    used = [r for row in layout.ranks for r in row]
    assert len(layout.ranks) == dp and all(len(row) == pp for row in layout.ranks)
    assert len(set(used)) == len(used) and set(used) <= set(gpus)


def brute_force(units, dp, pp, microbatches, memory, gpus, held, speed, horizon, bandwidth) -> int | None:
    """The least `layout_objective` over every split and every choice of GPUs per stage."""
    n, best = units.count, None
    for cuts in combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        slices = tuple(zip(bounds, bounds[1:]))
        if not all(fits(units.slice_costs(a, b, dp, pp, s), s, pp, microbatches, memory)
                   for s, (a, b) in enumerate(slices)):
            continue
        for stages in _deal(list(gpus), dp, pp):
            ranks = tuple(tuple(stages[s][d] for s in range(pp)) for d in range(dp))
            v = layout_objective(units, Layout(dp, pp, microbatches, slices, ranks), held, speed,
                                 horizon_iterations=horizon, bandwidth=bandwidth)
            best = v if best is None else min(best, v)
    return best


def _deal(gpus: list[int], dp: int, stages: int):
    """Every way to give each of `stages` stages a set of `dp` distinct GPUs."""
    if stages == 0:
        yield []
        return
    for chosen in combinations(gpus, dp):
        rest = [g for g in gpus if g not in chosen]
        for more in _deal(rest, dp, stages - 1):
            yield [chosen, *more]


@settings(max_examples=25, deadline=None)
@given(layout_problems())
def test_cpsat_layout_is_the_brute_force_optimum_valid_deterministic_and_no_worse_than_greedy(problem):
    units, dp, pp, mb, memory, gpus, held, speed, horizon, bandwidth = problem
    kw = dict(horizon_iterations=horizon, bandwidth=bandwidth, time_limit=5.0, seed=0)
    found = solve_layout(units, dp, pp, mb, memory, gpus, held, speed, **kw)
    best = brute_force(units, dp, pp, mb, memory, gpus, held, speed, horizon, bandwidth)
    if best is None:
        assert found.status == "infeasible" and found.layout is None
        return
    assert found.status == "optimal"
    assert found.objective == best == found.bound
    check_layout(found.layout, units, dp, pp, mb, memory, gpus)
    assert layout_objective(units, found.layout, held, speed, horizon_iterations=horizon,
                            bandwidth=bandwidth) == found.objective
    greedy = greedy_layout(units, dp, pp, mb, memory, gpus, held, speed)
    assert found.objective <= layout_objective(units, greedy, held, speed, horizon_iterations=horizon,
                                               bandwidth=bandwidth)
    assert solve_layout(units, dp, pp, mb, memory, gpus, held, speed, **kw) == found


def test_layout_objective_by_hand():
    """Two explicit stages as units, one pipeline of two stages on GPUs 0 (speed 0.5) and 1: the
    slow GPU's slot is 2 x (1 + 2 + 3) ms and its optimizer step 2 x 1 ms; GPU 1 takes stage 0's
    8 MiB that it does not hold."""
    spec = load_text("""
cluster { dp = 1 pp = 2 gpus_per_node = 2 gpu { memory = 1GiB } link { latency = 0us bandwidth = 1GB/s } }
stages { all { forward = 1ms backward_input = 2ms backward_weight = 3ms optimizer = 1ms
               activation = 1MiB stash = 0MiB static = 8MiB send = 1KiB } }
train { microbatches = 4 }
""")
    units = units_of(spec)
    layout = Layout(1, 2, 4, ((0, 1), (1, 2)), ((1, 0),))
    held = {0: frozenset({0}), 1: frozenset({1})}
    speed = {0: 0.5, 1: 1.0}
    assert layout_bottleneck(units, layout, speed) == 12_000
    assert layout_optimizer(units, layout, speed) == 2_000
    assert transition_us(units, layout, held, 10**9) == -(-(8 << 20) * 10**6 // 10**9) == 8389
    assert layout_objective(units, layout, held, speed, horizon_iterations=10,
                            bandwidth=10**9) == 10 * ((4 + 2 - 1) * 12_000 + 2_000) + 8389


def test_cpsat_shrinks_a_slow_gpus_slice_where_greedy_cannot():
    """GPT-350M, 2 x 8 with GPUs 3 and 12 lost and GPU 5 at half speed: 2 x 7 must use the slow
    GPU. Greedy splits at full speed (4 layers on it: 11.8 ms a slot); CP-SAT gives it fewer."""
    spec = load_text(GPT_350M)
    units, held = units_of(spec), held_units(spec)
    live = [r for r in range(16) if r not in (3, 12)]
    speed = {r: 0.5 if r == 5 else 1.0 for r in live}
    kw = dict(horizon_iterations=100, bandwidth=spec.cluster.link.bandwidth)
    memory = spec.cluster.gpu.memory
    greedy = greedy_layout(units, 2, 7, 16, memory, live, held, speed)
    found = solve_layout(units, 2, 7, 16, memory, live, held, speed, time_limit=2.0, **kw)
    check_layout(found.layout, units, 2, 7, 16, memory, live)
    assert found.status == "optimal"
    assert found.objective < 0.7 * layout_objective(units, greedy, held, speed, **kw)
    slow_stage = next(s for row in found.layout.ranks for s, r in enumerate(row) if r == 5)
    a, b = found.layout.slices[slow_stage]
    assert work(units.slice_costs(a, b, 2, 7, slow_stage)) * 2 <= layout_bottleneck(units, found.layout, speed)


def test_place_takes_the_partitioner_and_keeps_greedy_as_the_default():
    spec = load_text(GPT_350M)
    live = [r for r in range(16) if r != 3]
    shape = next(sh for sh in candidate_shapes(spec, len(live)) if (sh.dp, sh.pp) == (2, 7))
    held = held_units(spec)
    greedy = place(spec, shape, live, held)
    assert greedy == greedy_layout(units_of(spec), 2, 7, 16, spec.cluster.gpu.memory, live, held,
                                   {g.rank: g.speed for g in spec.gpus})
    cpsat = place(spec, shape, live, held, partitioner="cpsat")
    kw = dict(horizon_iterations=100, bandwidth=spec.cluster.link.bandwidth)
    units = units_of(spec)
    assert layout_objective(units, cpsat, held, **kw) <= layout_objective(units, greedy, held, **kw)
    with pytest.raises(ValueError, match="partitioner"):
        place(spec, Shape(2, 7, 16, shape.slices, 0), live, held, partitioner="dp")
