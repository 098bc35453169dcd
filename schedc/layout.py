"""A layout of the job and what it costs: the data `schedc.repartition` chooses among.

A `Layout` is `D'` pipelines of `P'` stages, each stage a contiguous slice of
`Units` (layers of a `model` block, or whole stages of a `stages` block),
each (pipeline, stage) run by a physical GPU of the job's own layout (or a
hole, whose work the stage's other GPUs share). This module says what a slice
costs (`Units.slice_costs`: the cost model's for layers, sums for stages),
whether it fits a GPU (`fits`), what state each GPU must receive to take up a
layout (`received_bytes`), the one objective every partitioner is compared on
(`layout_objective`), and the ordinary spec a layout is planned as
(`layout_spec`). Choosing a layout is `schedc.repartition`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Iterable, Mapping

from schedc.spec import Spec, StageCosts, scaled_duration

#: Iterations a layout is priced over (`layout_objective`) when a partitioner weighs the state it
#: moves against the speed it gains: about how long a layout lasts before the next change.
HORIZON_ITERATIONS = 100


@dataclass(frozen=True)
class Layout:
    """`dp` pipelines of `pp` stages; stage `s` holds units ``slices[s]`` = [a, b); GPU
    ``ranks[d][s]`` (a rank of the job's own dp x pp layout) runs stage `s` of pipeline `d`,
    with `microbatches` microbatches per pipeline. A `None` rank is a hole: no GPU runs that
    slot, and its stage's other GPUs take its work (re-routing, as after a failure): a layout
    with holes uses GPU counts that no product of equal pipelines reaches."""

    dp: int
    pp: int
    microbatches: int
    slices: tuple[tuple[int, int], ...]
    ranks: tuple[tuple[int | None, ...], ...]

    def slots(self) -> list[tuple[int, int, int]]:
        """(pipeline, stage, physical GPU) of every slot a GPU runs (holes left out)."""
        return [(d, s, r) for d, row in enumerate(self.ranks) for s, r in enumerate(row) if r is not None]

    @property
    def gpus(self) -> frozenset[int]:
        return frozenset(r for _, _, r in self.slots())

    @property
    def holes(self) -> int:
        return sum(r is None for row in self.ranks for r in row)

    def held(self) -> dict[int, frozenset[int]]:
        """Physical GPU -> the units it holds under this layout."""
        return {r: frozenset(range(*self.slices[s])) for _, s, r in self.slots()}

    def describe(self, unit: str = "layer") -> str:
        cuts = " | ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in self.slices)
        holes = f", {self.holes} slot(s) re-routed" if self.holes else ""
        return f"{self.dp} x {self.pp}{holes} ({self.microbatches} microbatches each; {unit}s {cuts})"


@dataclass(frozen=True)
class Units:
    """The pieces of the model a stage is made of, and what a slice of them costs."""

    spec: Spec
    kind: str  # "layer" or "stage"
    count: int
    _table: dict = field(default_factory=dict, compare=False, repr=False)

    def table(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """(a, b) -> (work, static, activation) of every slice, computed once."""
        if (0, 1) not in self._table:
            for a in range(self.count):
                for b in range(a + 1, self.count + 1):
                    c = self.shape_free(a, b)
                    self._table[a, b] = (work(c), c.static, c.activation)
        return self._table

    def unit_bytes(self) -> list[int]:
        """`state_bytes` of each unit alone, computed once."""
        if "bytes" not in self._table:
            self._table["bytes"] = [self.state_bytes(u, u + 1) for u in range(self.count)]
        return self._table["bytes"]

    def slice_costs(self, a: int, b: int, dp: int, pp: int, s: int) -> StageCosts:
        """Costs of stage `s` holding units [a, b) in a layout of `dp` pipelines of `pp` stages."""
        key = ("costs", a, b, dp)
        if key not in self._table:
            self._table[key] = _slice_costs(self.spec, self.kind, a, b, dp)
        return replace(self._table[key], pp=s)

    def shape_free(self, a: int, b: int) -> StageCosts:
        """Costs of units [a, b) whatever the shape: times, memory and sends do not depend on it
        (only the optimizer step's all-reduce does, through the number of pipelines)."""
        return self.slice_costs(a, b, 1, 1, 0)

    def shadow_parts(self, a: int, b: int) -> tuple[int, int, int]:
        """(optimizer step us, gradient bytes, checkpoint bytes) of units [a, b), for a shadow
        copy of them (`shadow_overhead_us`) and a checkpoint of them: the cost model's memory-bound
        step without its all-reduce (`costmodel.optimizer_step_time`), the gradient as the all-reduce
        moves it (`costmodel.gradient_bytes`: parameters x bytes of the precision), and the weights
        and optimizer state (the static state less the gradient buffer). For a `stages` block the
        parameters are inferred from `static` by the same per-parameter accounting (the spec's
        precision, bf16 without a `model` block; its optimizer)."""
        key = ("shadow", a, b)
        if key not in self._table:
            from schedc import costmodel
            from schedc.spec import ModelSpec

            static = self.shape_free(a, b).static
            grad = costmodel.gradient_bytes(static, self.spec.model or ModelSpec(), self.spec.train.optimizer)
            self._table[key] = (costmodel.optimizer_step_time(static), grad, static - grad)
        return self._table[key]

    def state_bytes(self, a: int, b: int) -> int:
        """Bytes that move when units [a, b) go to another GPU: their persistent state (weights,
        optimizer state, the gradient buffer: a stage's `static` memory), which the receiver also
        keeps as its rollback copy."""
        return self.shape_free(a, b).static


#: The `Units` of the last few specs, by identity (hashing a spec of 16,384 GPUs costs milliseconds):
#: their slice tables and candidate shapes are computed once per spec.
_UNITS: dict[int, tuple[Spec, "Units"]] = {}


def units_of(spec: Spec) -> Units:
    cached = _UNITS.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    if spec.costs == "derived" and spec.model is not None and spec.model.layers:
        units = Units(spec, "layer", spec.model.layers)
    else:
        units = Units(spec, "stage", spec.pp)
    if len(_UNITS) >= 8:
        _UNITS.pop(next(iter(_UNITS)))
    _UNITS[id(spec)] = (spec, units)
    return units


def held_units(spec: Spec) -> dict[int, frozenset[int]]:
    """Physical GPU -> the units it holds in the job's own layout (its stage's layers, or its stage)."""
    units = units_of(spec)
    out = {}
    for g in spec.gpus:
        if units.kind == "layer":
            a, b = spec.partition[g.pp]  # type: ignore[index]
            out[g.rank] = frozenset(range(a, b))
        else:
            out[g.rank] = frozenset({g.pp})
    return out


def _slice_costs(spec: Spec, kind: str, a: int, b: int, dp: int) -> StageCosts:
    if kind == "layer":
        from schedc import costmodel

        cluster = replace(spec.cluster, dp=dp)
        return costmodel.stage_costs(spec.model, cluster, spec.train.optimizer, 0, (a, b))  # type: ignore[arg-type]
    parts = spec.stages[a:b]
    return StageCosts(
        pp=0, forward=sum(p.forward for p in parts), backward_input=sum(p.backward_input for p in parts),
        backward_weight=sum(p.backward_weight for p in parts), optimizer=sum(p.optimizer for p in parts),
        activation=sum(p.activation for p in parts), stash=sum(p.stash for p in parts),
        static=sum(p.static for p in parts), send=parts[-1].send)


def in_flight(s: int, pp: int, microbatches: int) -> int:
    """Microbatches whose activations stage `s` holds at once under 1F1B-like schedules."""
    return min(pp - s, microbatches)


def fits(c: StageCosts, s: int, pp: int, microbatches: int, memory: int) -> bool:
    return c.static + in_flight(s, pp, microbatches) * c.activation <= memory


def work(c: StageCosts) -> int:
    return c.forward + c.backward_input + c.backward_weight


def hole_load(s: int, dp: int, holes: int) -> Fraction:
    """How much of its stage's work each GPU of stage `s` runs, relative to a stage with no hole:
    ``dp / (dp - 1)`` for the first `holes` stages (one slot each re-routed), else 1."""
    return Fraction(dp, dp - 1) if s < holes else Fraction(1)


def bytes_of(units: Units, ids: Iterable[int]) -> int:
    """State bytes of the units `ids`."""
    each = units.unit_bytes()
    return sum(each[u] for u in ids)


def received_bytes(units: Units, layout: Layout, held: Mapping[int, frozenset[int]]) -> dict[int, int]:
    """Physical GPU -> bytes of state it must receive to run its stage of `layout`."""
    out = {}
    for _, s, r in layout.slots():
        need = frozenset(range(*layout.slices[s])) - held.get(r, frozenset())
        out[r] = bytes_of(units, need)
    return out


def layout_bottleneck(units: Units, layout: Layout, speed: Mapping[int, float] | None = None) -> int:
    """Microseconds of the slowest slot of `layout`: the largest F + B + W of a stage's slice on
    the GPU that runs it, ``ceil(work / speed)`` (`scaled_duration`)."""
    speed = speed or {}
    return max(scaled_duration(work(units.slice_costs(*layout.slices[s], layout.dp, layout.pp, s)), speed.get(r, 1.0))
               for _, s, r in layout.slots())


def transition_us(units: Units, layout: Layout, held: Mapping[int, frozenset[int]], bandwidth: int) -> int:
    """Microseconds to move into `layout`: the GPU that receives the most state receives it at
    `bandwidth` bytes/s, the others at the same time beside it, ``ceil(bytes * 1e6 / bandwidth)``."""
    most = max(received_bytes(units, layout, held).values(), default=0)
    return -(-most * 1_000_000 // bandwidth)


def layout_optimizer(units: Units, layout: Layout, speed: Mapping[int, float] | None = None) -> int:
    """Microseconds of the slowest optimizer step of `layout` (its all-reduce included), on the GPU
    that runs it: ``ceil(optimizer / speed)``, as every op of a slow GPU (`Instance.duration`)."""
    speed = speed or {}
    return max(scaled_duration(units.slice_costs(*layout.slices[s], layout.dp, layout.pp, s).optimizer,
                               speed.get(r, 1.0))
               for _, s, r in layout.slots())


def layout_objective(units: Units, layout: Layout, held: Mapping[int, frozenset[int]],
                     speed: Mapping[int, float] | None = None, *, horizon_iterations: int, bandwidth: int) -> int:
    """What `layout` costs over the next `horizon_iterations` iterations, in microseconds:
    ``horizon_iterations x ((M + P - 1) x layout_bottleneck + layout_optimizer) + transition_us``:
    `estimate_iteration`'s 1F1B critical path (M microbatches through P stages at the slowest
    slot, then the slowest optimizer step) in integers with each GPU's own speed, and the one-off
    move of state. The price every partitioner is compared on (`place`,
    `bench/repartition_gap.py`); memory is not checked here (`fits`). E.g. 16 microbatches through
    7 stages at a 6 ms slot and an 8.8 ms optimizer step, for 100 iterations, with 0.8 GB to move
    at 25 GB/s: ``100 * (22 * 6000 + 8800) + 32000`` us.
    """
    slots = layout.microbatches + layout.pp - 1
    iteration = slots * layout_bottleneck(units, layout, speed) + layout_optimizer(units, layout, speed)
    return horizon_iterations * iteration + transition_us(units, layout, held, bandwidth)


def shadow_stage(s: int, pp: int) -> int | None:
    """The stage whose shadow the GPUs of stage `s` hold under `schedc train --shadow`: the
    previous one, ``(s - 1) mod pp`` (stage 0 holds the last stage's); None with one stage."""
    return None if pp <= 1 else (s - 1) % pp


def shadows_of(layout: Layout) -> dict[int, frozenset[int]]:
    """Physical GPU -> the units of the shadow it holds under `layout` (none with one stage)."""
    out = {}
    for _, s, r in layout.slots():
        prev = shadow_stage(s, layout.pp)
        out[r] = frozenset() if prev is None else frozenset(range(*layout.slices[prev]))
    return out


def _stage_gpus(layout: Layout) -> list[list[int]]:
    return [[r for row in layout.ranks if (r := row[s]) is not None] for s in range(layout.pp)]


def shadow_fits(units: Units, layout: Layout, memory: int) -> bool:
    """Whether every GPU of `layout` holds its stage and the previous stage's shadow (weights,
    gradient buffer, optimizer state: the previous slice's `static`) within `memory`: ``static(s)
    + static(s - 1) + ceil(in_flight x dp / k) x activation(s) <= memory``, with `k` the stage's
    GPUs (fewer than `dp` with holes or re-routed GPUs: they share its microbatches in flight),
    the partitioner's memory model (`partition_units`). True with one stage (no shadows)."""
    if layout.pp <= 1:
        return True
    gpus = _stage_gpus(layout)
    for s, (a, b) in enumerate(layout.slices):
        if not gpus[s]:
            continue
        own = units.shape_free(a, b)
        shadow = units.shape_free(*layout.slices[shadow_stage(s, layout.pp)]).static  # type: ignore[misc]
        flight = -(-in_flight(s, layout.pp, layout.microbatches) * layout.dp // len(gpus[s]))
        if own.static + shadow + flight * own.activation > memory:
            return False
    return True


def shadow_overhead_us(units: Units, layout: Layout, link, speed: Mapping[int, float] | None = None, *,
                       iteration_us: int = 0) -> int:
    """Microseconds `schedc train --shadow` adds to an iteration of `layout` (of `iteration_us`
    without shadows), on the slowest holder: the holders' optimizer step on the shadow
    (`Units.shadow_parts`; its all-reduce is not repeated), ``step(s) / speed``, plus the part of
    the gradient stream that an iteration does not hide. A shadow lags its holder by a step: the
    gradient of step k is received while the holder computes iteration k + 1 and applied at its
    step, so the stream only delays the iteration by what it takes beyond one: ``max(0, ceil(h /
    k) x link.transfer_time(gradient(s)) - iteration_us)`` for stage `s` with `k` live GPUs
    sending its summed gradient to the `h` GPUs of stage s + 1 (the sends spread over the senders,
    each to ``ceil(h / k)`` holders in turn, at the link's bandwidth; the link it shares with the
    pipeline's activations is taken as free for it). 0 with one stage."""
    if layout.pp <= 1:
        return 0
    speed = speed or {}
    gpus = _stage_gpus(layout)
    worst = 0
    for t in range(layout.pp):
        s = shadow_stage(t, layout.pp)
        holders, senders = gpus[t], gpus[s]  # type: ignore[index]
        if not holders or not senders:
            continue
        step, grad, _ = units.shadow_parts(*layout.slices[s])  # type: ignore[index]
        sends = -(-len(holders) // len(senders)) * link.transfer_time(grad)
        worst = max(worst, max(0, sends - iteration_us) + max(scaled_duration(step, speed.get(r, 1.0))
                                                               for r in holders))
    return worst


def checkpoint_bytes(units: Units) -> int:
    """Bytes of the whole model's weights and optimizer state (`Units.shadow_parts`): what a
    checkpoint of it writes."""
    return units.shadow_parts(0, units.count)[2]


def layout_spec(spec: Spec, layout: Layout) -> Spec:
    """The fault-free spec of `layout`: `dp` x `pp` GPUs (rank ``d * pp + s`` is physical GPU
    ``layout.ranks[d][s]``; a slow physical GPU stays slow), the re-cut stages, `microbatches`
    each. Built as text and loaded back, so it is validated like any spec."""
    from schedc.load import load_text
    from schedc.printer import print_spec
    from schedc.spec import Failure

    units = units_of(spec)
    cluster = replace(spec.cluster, dp=layout.dp, pp=layout.pp, placement="pipeline_major")
    slow = []
    for d, row in enumerate(layout.ranks):
        for s, r in enumerate(row):
            if r is None:  # a hole: its stage's other GPUs take its work
                slow.append(Failure("fail_gpu", dp=d, pp=s))
            elif spec.gpus[r].speed < 1.0:
                slow.append(Failure("slow_gpu", dp=d, pp=s, speed=spec.gpus[r].speed))
    new = replace(spec, cluster=cluster, train=replace(spec.train, microbatches=layout.microbatches),
                  failures=tuple(slow), gpus=())
    if units.kind == "layer":
        new = replace(new, partition=layout.slices)
    else:
        new = replace(new, stages=tuple(units.slice_costs(a, b, layout.dp, layout.pp, s)
                                         for s, (a, b) in enumerate(layout.slices)))
    header = (f"{spec.source_name} re-partitioned by schedc: {layout.describe(units.kind)}; "
              f"pipeline d stage s runs on GPU rank {', '.join('-' if r is None else str(r) for row in layout.ranks for r in row)} "
              "(in order d, s; - a hole)")
    return load_text(print_spec(new, header=header), name=f"{spec.source_name} (re-partitioned)")
