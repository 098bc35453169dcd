"""Re-partitioning: a new layout of the job on the GPUs that are live.

Re-routing needs a live GPU in every stage. When a burst takes every GPU of
a stage, or when so many are gone that re-routed work piles up, the job can
instead be laid out anew on the survivors (Oobleck's pipeline templates,
Odyssey's re-partitioning): `D'` equal pipelines of `P'` stages, each stage
a contiguous slice of the model, each (pipeline, stage) run by one live GPU.

The global batch is kept: the job trains `G = D x M` microbatches per
iteration, so a layout of `D'` pipelines runs `G / D'` each (`D'` divides
`G`), and every iteration is the same math as fault-free training.

What a stage is made of (`Units`):

* a spec with a `model` block (derived costs) re-partitions by **layers**;
  a slice's costs are the cost model's for those layers on `D'` replicas
  (`costmodel.stage_costs`), embedding and head included on the ends;
* a spec with a `stages` block re-partitions by **whole stages**: a slice
  merges contiguous stages (times, activation, stash and static memory add
  up; the slice sends what its last stage sends).

`repartition(spec, live)` ranks the candidate shapes by an estimate, plans
the best few with a solver (`schedc.compile` of the layout's own spec, so
the verifier, simulator and code generator see an ordinary fault-free job)
and returns the fastest as a `Repartition`: the `Layout` (which physical GPU
runs which stage), the compiled `Plan`, and the bytes each GPU must receive
(the state of the layers it did not hold). The partition of each shape comes
from `partition_units` (exact, by dynamic programming: the slice boundaries
that minimise the slowest stage's work under each stage's memory), and GPUs
are dealt to stages by `assign_gpus` (most state already held first):
`greedy_layout`, the default. With ``partitioner="cpsat"`` a shape's split and
its GPUs are chosen together (`schedc.solvers.partition_cpsat`), at the least
`layout_objective`: it sees GPU speeds and the state each GPU holds while it
cuts (docs/planner.md, "Re-partitioning with CP-SAT").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from schedc.diagnostics import InfeasibleError, SchedcError, error
from schedc.layout import (HORIZON_ITERATIONS, Layout, Units, bytes_of, held_units, hole_load, in_flight, layout_spec,
                           received_bytes, units_of, work)
from schedc.spec import Spec

#: Work budget (calibrated seconds, as `SolveOptions.time_limit`) of one shape's layout when a
#: solver lays it out (`place(partitioner="cpsat")`): the GPT-350M states of
#: bench/repartition_gap.py are proven optimal within it (docs/planner.md).
LAYOUT_TIME_LIMIT = 1.0
#: Shapes planned with a solver after ranking by `estimate_iteration`: the estimate orders shapes
#: well but ignores bubbles the solver fills, so the best few are compiled and compared.
PLANNED_SHAPES = 3


def shapes(global_microbatches: int, units: int, gpus: int) -> list[tuple[int, int]]:
    """(pipelines, stages) candidates that keep the global batch on at most `gpus` GPUs: for
    each number of stages 1 <= P <= units, the most pipelines D that divide the global batch
    with D x P <= gpus. (For a given P, more pipelines never hurt: the slowest stage's work is
    the same, each pipeline runs fewer microbatches, and each stage holds fewer in flight.)"""
    out = []
    for p in range(1, min(units, gpus) + 1):
        d = max((d for d in range(1, gpus // p + 1) if global_microbatches % d == 0), default=0)
        if d:
            out.append((d, p))
    return out


def partition_units(units: Units, dp: int, pp: int, microbatches: int, memory: int,
                    holes: int = 0) -> tuple[tuple[int, int], ...] | None:
    """The contiguous split of the units into `pp` non-empty slices that minimises the largest
    stage's work (F + B + W) per GPU with every stage within `memory` (`fits`); None when no split
    fits. With `holes`, each of the first `holes` stages has one GPU fewer (`hole_load`: its GPUs
    share its work and its activations in flight). Exact (dynamic programming over slice ends);
    among equal splits the earliest cut wins."""
    n = units.count
    if not 1 <= pp <= n or holes and (dp < 2 or holes > pp):
        return None
    inf = float("inf")
    table = units.table()
    cap = [memory] * pp  # what stage s may hold: static + in_flight(s) x activation
    load = [hole_load(s, dp, holes) for s in range(pp)]
    flight = [math.ceil(in_flight(s, pp, microbatches) * load[s]) for s in range(pp)]
    # Work compared in integers: `load` scaled by its common denominator (dp - 1 with holes).
    scale = [int(x * (dp - 1)) for x in load] if holes else [1] * pp
    # best[s][b]: the smallest bottleneck of stages 0..s covering units [0, b); cut[s][b]: where stage s starts.
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[-1] * (n + 1) for _ in range(pp)]
    for b in range(1, n - pp + 2):
        w, st, act = table[0, b]
        if st + flight[0] * act <= cap[0]:
            best[0][b] = w * scale[0]
            cut[0][b] = 0
    for s in range(1, pp):
        prev, here, cuts, f, k = best[s - 1], best[s], cut[s], flight[s], scale[s]
        for b in range(s + 1, n - pp + s + 2):
            # Widening the slice leftwards only adds work and memory: stop once either is too much.
            for a in range(b - 1, s - 1, -1):
                w, st, act = table[a, b]
                w = w * k
                if w > here[b] or st + f * act > memory:
                    break
                if prev[a] == inf:
                    continue
                v = max(prev[a], w)
                if v < here[b] or (v == here[b] and a < cuts[b]):
                    here[b], cuts[b] = v, a
    if best[pp - 1][n] == inf:
        return None
    out, b = [], n
    for s in range(pp - 1, -1, -1):
        a = cut[s][b]
        out.append((a, b))
        b = a
    return tuple(reversed(out))


def estimate_iteration(units: Units, dp: int, pp: int, microbatches: int,
                       slices: Sequence[tuple[int, int]], speeds: Sequence[float] | None = None,
                       holes: int = 0) -> int:
    """Microseconds of an iteration, estimated: ``(M + P - 1)`` microbatch slots of the slowest
    stage (its work per GPU, `hole_load`), plus the slowest optimizer step (1F1B's critical path;
    the solver's plan is usually shorter, as it fills the bubbles with W). `speeds[s]`: the
    slowest GPU of stage `s`."""
    costs = [units.slice_costs(a, b, dp, pp, s) for s, (a, b) in enumerate(slices)]
    speeds = speeds or [1.0] * pp
    slot = max(work(c) * hole_load(s, dp, holes) / speeds[s] for s, c in enumerate(costs))
    return int((microbatches + pp - 1) * slot + max(c.optimizer for c in costs))


def assign_gpus(units: Units, slices: Sequence[tuple[int, int]], dp: int, gpus: Sequence[int],
                held: Mapping[int, frozenset[int]], speed: Mapping[int, float] | None = None,
                holes: int = 0) -> tuple[tuple[int | None, ...], ...]:
    """`ranks[d][s]`: which of `gpus` runs stage `s` of pipeline `d`. The fastest GPUs are used
    (ties: lower rank); then (GPU, stage) pairs are taken in order of the state the GPU already
    holds of that stage, most first, so that the fewest bytes move (ties: lower stage, rank)."""
    speed = speed or {}
    pp = len(slices)
    need = dp * pp - holes
    chosen = sorted(gpus, key=lambda r: (-speed.get(r, 1.0), r))[:need]
    if len(chosen) < need:
        raise ValueError(f"{dp} x {pp} with {holes} hole(s) needs {need} GPUs, {len(chosen)} given")
    room = [dp - (1 if s < holes else 0) for s in range(pp)]
    # GPUs holding the same units are alike here: price each group once (a stage's replicas
    # form one group), so the cost grows with the stages, not the GPUs.
    groups: dict[frozenset[int], list[int]] = {}
    for r in chosen:
        groups.setdefault(held.get(r, frozenset()), []).append(r)
    kept = {(h, s): bytes_of(units, h & frozenset(range(*slices[s]))) for h in groups for s in range(pp)}
    slots: dict[int, list[int]] = {s: [] for s in range(pp)}
    free = {h: list(rs) for h, rs in groups.items()}  # rank order within a group
    for (h, s) in sorted(kept, key=lambda k: (-kept[k], k[1], groups[k[0]][0])):
        take = min(room[s] - len(slots[s]), len(free[h]))
        if take > 0:
            slots[s].extend(free[h][:take])
            del free[h][:take]
    return tuple(tuple(slots[s][d] if d < len(slots[s]) else None for s in range(pp)) for d in range(dp))


def greedy_layout(units: Units, dp: int, pp: int, microbatches: int, memory: int, gpus: Sequence[int],
                  held: Mapping[int, frozenset[int]], speed: Mapping[int, float] | None = None) -> Layout | None:
    """The greedy layout of one shape: `partition_units` (the smallest full-speed bottleneck under
    memory), then `assign_gpus` (fastest GPUs, most state held first). None when no split fits
    `memory` or there are fewer than ``dp * pp`` GPUs."""
    if len(gpus) < dp * pp:
        return None
    slices = partition_units(units, dp, pp, microbatches, memory)
    if slices is None:
        return None
    return Layout(dp, pp, microbatches, slices, assign_gpus(units, slices, dp, gpus, held, speed))


@dataclass(frozen=True)
class Repartition:
    """A re-partitioned plan: its layout, the compiled plan of the layout's spec, and the bytes each
    physical GPU receives to take up its new stage."""

    layout: Layout
    plan: object  # schedc.plan.Plan
    unit: str
    received: Mapping[int, int] = field(default_factory=dict)
    candidates: tuple[tuple[tuple[int, int], int], ...] = ()  # ((dp, pp), estimated us) considered

    @property
    def iteration_time(self) -> int:
        return self.plan.metrics.iteration_time  # type: ignore[attr-defined]

    @property
    def max_received(self) -> int:
        return max(self.received.values(), default=0)

    @property
    def total_received(self) -> int:
        return sum(self.received.values())


@dataclass(frozen=True)
class Shape:
    """A candidate shape with its partition and estimated iteration time (all GPUs at full speed)."""

    dp: int
    pp: int
    microbatches: int
    slices: tuple[tuple[int, int], ...]
    estimate_us: int
    holes: int = 0  # the first `holes` stages have one GPU fewer (re-routed)

    @property
    def gpus(self) -> int:
        return self.dp * self.pp - self.holes


def candidate_shapes(spec: Spec, gpus: int) -> tuple[Shape, ...]:
    """Every shape that fits `gpus` GPUs and the memory, partitioned, best estimate first (ties:
    fewer GPUs, fewer pipelines). Depends only on the count of GPUs, so it is cached by it."""
    units = units_of(spec)
    key = ("shapes", gpus)
    if key not in units._table:
        units._table[key] = _shapes_of(spec, units, gpus)
    return units._table[key]


def _shapes_of(spec: Spec, units: "Units", gpus: int) -> tuple[Shape, ...]:
    global_mb = spec.dp * spec.microbatches
    memory = spec.cluster.gpu.memory
    out = []
    for d, p, h in shapes_with_holes(global_mb, units.count, gpus):
        m = global_mb // d
        slices = partition_units(units, d, p, m, memory, holes=h)
        if slices is not None:
            out.append(Shape(d, p, m, slices, estimate_iteration(units, d, p, m, slices, holes=h), h))
    out.sort(key=lambda sh: (sh.estimate_us, sh.gpus, sh.holes, sh.dp))
    return tuple(out)


def shapes_with_holes(global_microbatches: int, units: int, gpus: int) -> list[tuple[int, int, int]]:
    """(pipelines, stages, holes): the `shapes`, and for each number of stages P the next number
    of pipelines D' (dividing the global batch) that needs more than `gpus` GPUs, when the
    ``D' x P - gpus`` missing slots fit one per stage (and D' >= 2): holes in the first stages,
    whose GPUs share their stage's work. E.g. 11 GPUs, 32 microbatches, 24 layers: 2 x 6 with one
    hole beats 2 x 5 (no 2 x 5.5 exists)."""
    out = [(d, p, 0) for d, p in shapes(global_microbatches, units, gpus)]
    for p in range(1, min(units, gpus) + 1):
        d = min((d for d in range(2, gpus + 1) if global_microbatches % d == 0 and d * p > gpus), default=0)
        if d and d * p - gpus <= p:
            out.append((d, p, d * p - gpus))
    return out


def place(spec: Spec, shape: Shape, live: Sequence[int], held: Mapping[int, frozenset[int]], *,
          partitioner: str = "greedy", horizon_iterations: int = HORIZON_ITERATIONS,
          time_limit: float = LAYOUT_TIME_LIMIT, seed: int = 0) -> Layout:
    """`shape` on the `live` GPUs. ``partitioner="greedy"``: the shape's full-speed split, GPUs
    dealt by `assign_gpus`. ``"cpsat"``: the split re-cut and the GPUs chosen together at the
    least `layout_objective` over `horizon_iterations` (`schedc.solvers.partition_cpsat`, on a work
    budget of `time_limit`; never worse than greedy's on that objective; deterministic)."""
    speed = {g.rank: g.speed for g in spec.gpus}
    units = units_of(spec)
    if partitioner == "greedy" or shape.holes:  # (the CP-SAT layout has no holes)
        ranks = assign_gpus(units, shape.slices, shape.dp, live, held, speed, holes=shape.holes)
        return Layout(shape.dp, shape.pp, shape.microbatches, shape.slices, ranks)
    if partitioner != "cpsat":
        raise ValueError(f"unknown partitioner {partitioner!r} (greedy or cpsat)")
    from schedc.solvers import get_layout_solver

    found = get_layout_solver(partitioner)(
        units, shape.dp, shape.pp, shape.microbatches, spec.cluster.gpu.memory, live, held, speed,
        horizon_iterations=horizon_iterations, bandwidth=spec.cluster.link.bandwidth, time_limit=time_limit,
        seed=seed)
    assert found.layout is not None, "a candidate shape fits the memory and the live GPUs"
    return found.layout


#: Solvers that plan a shape, best first: greedy fills the bubbles better (and beats zb-h1 on most
#: shapes); zb-h1's fixed template is planned in a quarter of the time, the fallback.
SOLVERS = ("greedy", "zb-h1")
#: Predicted seconds per op (F, B, W of every microbatch on every pipeline planned op by op) of
#: planning, verifying and simulating a layout with each solver: what they took on GPT-350M
#: layouts of 9-15 GPUs when this was set (zb-h1 28-40 us; greedy 28-230 us, its candidates and
#: local search vary; its deadline cuts the rest). The prediction, not the clock, says
#: which (solver, shape) pairs fit a deadline, so the choice is the same on every run; the clock
#: only cuts it short on an overloaded machine. Re-measure: `python bench/repartition_latency.py`.
_S_PER_OP = {"zb-h1": 40e-6, "greedy": 150e-6}
#: Share of the deadline the predicted planning work may use.
_PLANNING_SHARE = 0.6


def _solvers(shape: Shape) -> tuple[str, ...]:
    """The solvers tried on `shape`: from `decompose.MIN_GPUS` GPUs only greedy, which plans one
    pipeline for all (a fault-free layout's pipelines are alike); zb-h1 plans every pipeline."""
    from schedc.decompose import MIN_GPUS

    if shape.holes:  # zb-h1 is a fault-free template: it cannot re-route a hole's work
        return ("greedy",)
    return ("greedy",) if shape.dp * shape.pp >= MIN_GPUS else SOLVERS


def _planned_ops(shape: Shape, solver: str) -> int:
    """Ops `solver` plans op by op for `shape` (greedy: by classes, so one pipeline's from
    `decompose.MIN_GPUS` GPUs on), plus a per-GPU term for checking the whole layout."""
    from schedc.decompose import MIN_GPUS

    per_pipeline = shape.pp * shape.microbatches * 3
    pipelines = 1 if solver == "greedy" and shape.dp * shape.pp >= MIN_GPUS else shape.dp
    return per_pipeline * pipelines + shape.dp * shape.pp


def plan_layout(spec: Spec, layout: Layout, solver: str = "greedy", *, time_limit: float = 0.05, seed: int = 0,
                deadline: float | None = None):
    """The verified, simulated `Plan` of `layout` (its spec from `layout_spec`), planned by classes of
    alike pipelines (all of a fault-free layout's are alike)."""
    from schedc.instance import from_spec
    from schedc.plan import Plan, _by_classes
    from schedc.simulate import metrics_of, simulate
    from schedc.solvers import SolveOptions, get_solver
    from schedc.verify import verify_schedule

    new = layout_spec(spec, layout)
    instance = from_spec(new)
    options = SolveOptions(time_limit=time_limit, seed=seed, deadline=deadline)
    schedule = _by_classes(get_solver(solver), solver, True)(instance, options)
    verify_schedule(schedule)
    return Plan(spec=new, schedule=schedule, metrics=metrics_of(schedule, simulate(schedule)))


def repartition(spec: Spec, live: Iterable[int] | None = None, *, held: Mapping[int, frozenset[int]] | None = None,
                deadline: float = 1.0, seed: int = 0, planned: int = PLANNED_SHAPES, partitioner: str = "greedy",
                horizon_iterations: int = HORIZON_ITERATIONS, layout_time_limit: float = LAYOUT_TIME_LIMIT) -> Repartition:
    """The fastest re-partitioned plan on the `live` GPUs (ranks of `spec`'s own layout; default:
    its live GPUs) found within `deadline` seconds. `held`: which units each GPU holds now
    (default: the job's own layout).

    The best shapes by estimate (at most `planned`) are laid out on the live GPUs by `partitioner`
    (`place`; "cpsat" costs 0.1-1.6 s per shape, so it is for offline use, not a 0.1 s replan)
    and planned, best estimate first, by greedy where its predicted planning time (`_S_PER_OP`)
    fits what is left of the deadline's share, else by zb-h1 where that fits (a layout with holes
    needs greedy, which re-routes); when nothing fits, the best hole-free shape by zb-h1. The
    fastest plan wins (ties: fewer bytes to move, then fewer GPUs). Raises `InfeasibleError`
    (E330) when no shape fits the live GPUs' memory. Which plans run is decided by predicted
    cost, so it is the same on every run; greedy's search is cut by the deadline, as in
    `schedc.replan`, so on a loaded machine it may stop earlier."""
    import time

    started = time.monotonic()
    live = sorted(g.rank for g in spec.gpus if g.live) if live is None else sorted(set(live))
    held = held_units(spec) if held is None else held
    units = units_of(spec)
    ranked = candidate_shapes(spec, len(live))[:planned]
    budget = deadline * _PLANNING_SHARE - (time.monotonic() - started)
    # What to plan, decided by predicted cost (not the clock): per shape, best estimate first,
    # greedy where it fits what is left of the budget, else zb-h1 where that fits.
    chosen: list[tuple[Shape, str]] = []
    spent = 0.0
    for shape in ranked:
        for solver in _solvers(shape):
            cost = _S_PER_OP[solver] * _planned_ops(shape, solver)
            if spent + cost <= budget:
                chosen.append((shape, solver))
                spent += cost
                break
    if not chosen and ranked:  # nothing fits: the cheapest plan of the best shape that has one
        chosen = [next(((sh, _solvers(sh)[-1]) for sh in ranked if not sh.holes), (ranked[0], "greedy"))]
    best = None
    problems: list[SchedcError] = []
    for shape, solver in chosen:
        if best is not None and time.monotonic() - started > deadline * _PLANNING_SHARE:
            break  # an overloaded machine: keep what was planned
        layout = place(spec, shape, live, held, partitioner=partitioner, horizon_iterations=horizon_iterations,
                       time_limit=layout_time_limit, seed=seed)
        try:
            plan = plan_layout(spec, layout, solver, time_limit=0.01, seed=seed,
                               deadline=started + deadline * _PLANNING_SHARE)
        except SchedcError as exc:  # the estimate's memory model passed, the solver's did not
            problems.append(exc)
            continue
        received = received_bytes(units, layout, held)
        key = (plan.metrics.iteration_time, max(received.values(), default=0), layout.dp * layout.pp)
        if best is None or key < best[0]:
            best = (key, Repartition(layout, plan, units.kind, received,
                                     tuple(((sh.dp, sh.pp), sh.estimate_us) for sh in ranked)))
    if best is None:
        why = ([d for exc in problems for d in exc.diagnostics][:3])
        raise InfeasibleError([error(
            "E330", f"no re-partitioned layout of the model fits the {len(live)} live GPU(s)",
            hint="the model's state and one microbatch's activations must fit the live GPUs' memory; "
                 "wait for GPUs to return, or restart from a checkpoint")] + why)
    return best[1]
