"""Symmetric schedules: pipelines that run the same programs are stored, checked and simulated once.

At 16,384 GPUs a plan with a few failed GPUs has 2,000 pipelines that no
failure touches, each running the same program up to its index, and a few
small groups of pipelines around each failure (the failed pipeline and the
peers that took its microbatches), which repeat too: two GPUs failed at the
same stage leave two groups with the same programs. A `Layout` names these
*classes*: each class is a group of `size` pipelines and the *copies* of it
in the cluster (tuples of full pipeline indices, copy 0 the representative).

A `SymmetricSchedule` holds one `Schedule` per class, its *part*: the class
planned alone, on an instance of its own pipelines (numbered 0.., ranks
pipeline-major), plus the layout. Its meaning is the *expanded* schedule:
every copy of a class runs the part's ops with its own pipelines and GPUs,
each optimizer step O starting once its GPU's other ops have ended and its
barrier is reached (the latest W of its stage, or of every stage, in any
part: the optimizer's barrier is the one thing copies and classes share).
The O times a part stores are not part of the meaning; the verifier checks
each part with its O ops at its own barriers, which holds for the later
shared ones too (an O is its GPU's last op and holds no memory). `reduced` is
that schedule for one copy of every class, side by side (the *reduced
instance*); the exports, the schedule file and the programs are written
from it. The verifier (`schedc.verify`) checks every part on its own and
that every copy's GPUs are in the same state and speed as its part's; the
simulator (`schedc.simulate`) times the parts together through their
barriers (`schedc.simulate_engine.combine_summaries`). Both give the verdict and the
times of the expanded schedule op by op (tests/test_symmetry.py checks both
ways), at a cost per class, not per pipeline; a part reused as it is (the
same object) is not checked or summarised again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterator, Mapping

from schedc.instance import Instance
from schedc.opgraph import optimizer_waits_for
from schedc.schedule import OpId, Schedule, ScheduledOp, SolverInfo
from schedc.spec import Gpu


@dataclass(frozen=True)
class PipelineClass:
    """`copies[j][i]`: the full pipeline that is local pipeline i of copy j; copy 0 is the representative."""

    copies: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.copies[0])

    @property
    def count(self) -> int:
        return len(self.copies)


@dataclass(frozen=True)
class Layout:
    """The classes of pipelines of a symmetric schedule, in reduced order."""

    classes: tuple[PipelineClass, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Reduced index of each class's first pipeline."""
        out, at = [], 0
        for c in self.classes:
            out.append(at)
            at += c.size
        return tuple(out)

    @property
    def reduced_dp(self) -> int:
        return sum(c.size for c in self.classes)

    @property
    def full_dp(self) -> int:
        return sum(c.size * c.count for c in self.classes)

    @cached_property
    def class_of_reduced(self) -> tuple[int, ...]:
        """Class index of every reduced pipeline."""
        return tuple(c for c, cls in enumerate(self.classes) for _ in range(cls.size))

    @cached_property
    def of_full(self) -> dict[int, tuple[int, int]]:
        """Full pipeline -> (reduced pipeline, copy)."""
        out = {}
        for c, cls in enumerate(self.classes):
            off = self.offsets[c]
            for j, copy in enumerate(cls.copies):
                for i, d in enumerate(copy):
                    out[d] = (off + i, j)
        return out

    def full_pipeline(self, reduced: int, copy: int) -> int:
        c = self.class_of_reduced[reduced]
        return self.classes[c].copies[copy][reduced - self.offsets[c]]

    def stands_for(self, reduced: int) -> tuple[int, ...]:
        """Every full pipeline that reduced pipeline `reduced` stands for (copy 0 first)."""
        c = self.class_of_reduced[reduced]
        i = reduced - self.offsets[c]
        return tuple(copy[i] for copy in self.classes[c].copies)

    def to_json(self) -> list[dict]:
        return [{"pipelines": c.size, "copies": [list(copy) for copy in c.copies]} for c in self.classes]


def part_instance(full: Instance, copy: tuple[int, ...]) -> Instance:
    """A class on its own: the pipelines of `copy` renumbered 0.., ranks pipeline-major."""
    pp = full.pp
    gpus = []
    for i, d in enumerate(copy):
        for s in range(pp):
            g = full.gpu(d, s)
            gpus.append(Gpu(rank=i * pp + s, dp=i, pp=s, node=g.node, state=g.state, speed=g.speed))
    return replace(full, dp=len(copy), gpus=tuple(gpus))


def reduced_instance(full: Instance, layout: Layout) -> Instance:
    """The instance of one copy (copy 0) of every class, side by side in class order."""
    return part_instance(full, tuple(d for cls in layout.classes for d in cls.copies[0]))


def layout_problems(full: Instance, layout: Layout, parts: tuple[Instance, ...]) -> list[str]:
    """Why expanding parts on these instances over `layout` would not be a schedule of `full`
    (empty: it would). Checks every GPU of every copy against its part's."""
    problems: list[str] = []
    if not layout.classes or len(parts) != len(layout.classes):
        return [f"{len(parts)} parts for {len(layout.classes)} classes"]
    seen: set[int] = set()
    for c, cls in enumerate(layout.classes):
        if cls.size == 0 or any(len(copy) != cls.size for copy in cls.copies):
            problems.append(f"class {c}: its copies have different numbers of pipelines")
            continue
        for copy in cls.copies:
            for d in copy:
                if not (isinstance(d, int) and 0 <= d < full.dp):
                    problems.append(f"class {c}: pipeline {d} is outside 0..{full.dp - 1}")
                elif d in seen:
                    problems.append(f"pipeline {d} is in two copies")
                seen.add(d)
    if problems:
        return problems[:10]
    if len(seen) != full.dp:
        missing = sorted(set(range(full.dp)) - seen)
        return [f"pipelines {', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''} "
                "are in no class"]
    for c, (cls, part) in enumerate(zip(layout.classes, parts)):
        if part.dp != cls.size or not part.same_costs(full) or any(
                (g.rank, g.dp, g.pp) != (i * full.pp + s, i, s)
                for i in range(cls.size) for s in range(full.pp) for g in (part.gpus[i * full.pp + s],)):
            return [f"class {c}'s schedule is for another shape, options, costs or GPU numbering"]
        grid, gpus = full.rank_grid, full.gpus
        for i in range(cls.size):
            for s in range(full.pp):
                rep = part.gpus[i * full.pp + s]
                want = (rep.state, rep.speed)
                for copy in cls.copies:
                    g = gpus[grid[copy[i]][s]]
                    if (g.state, g.speed) != want:
                        problems.append(
                            f"GPU (dp={g.dp}, pp={s}) is {_condition(g)} but the pipeline it repeats "
                            f"(pipeline {i} of class {c}) has {_condition(rep)} there")
                        if len(problems) >= 10:
                            return problems
    return problems


def _condition(g: Gpu) -> str:
    if not g.live:
        return "failed"
    return f"slow ({g.speed:g})" if g.speed < 1.0 else "live at full speed"


def barrier_times(instance: Instance, parts) -> dict[tuple[int, ...], int]:
    """Each optimizer barrier's time in the first iteration: the latest end of a W (B without
    decoupling) of its stages in any part."""
    last = "W" if instance.decouple_backward else "B"
    by_stage: dict[int, int] = {}
    for part in parts:
        for op in part.ops:
            if op.kind == last and op.end > by_stage.get(op.pp, -1):
                by_stage[op.pp] = op.end
    groups = {optimizer_waits_for(instance, s) for s in range(instance.pp)}
    return {grp: max((by_stage.get(s, 0) for s in grp), default=0) for grp in groups}


def with_optimizer_at_barrier(instance: Instance, ops, bars: dict[tuple[int, ...], int]) -> list[ScheduledOp]:
    """`ops` with every O starting as soon as its GPU's other ops have ended and its barrier
    (`bars`, by group of stages) is reached; its length is kept. In a symmetric schedule that is
    when an O runs: the times its part gives it are not part of the schedule's meaning."""
    last_end: dict[int, int] = {}
    for op in ops:
        if op.kind != "O" and op.end > last_end.get(op.rank, 0):
            last_end[op.rank] = op.end
    out = []
    for op in ops:
        if op.kind == "O":
            start = max(last_end.get(op.rank, 0), bars.get(optimizer_waits_for(instance, op.pp), 0))
            op = replace(op, start=start, end=start + op.duration)
        out.append(op)
    return out


def normalized_part(part: Schedule) -> Schedule:
    """A part with its O ops at the barriers of the part alone (what the verifier checks)."""
    inst = part.instance
    return replace(part, ops=tuple(with_optimizer_at_barrier(inst, part.ops, barrier_times(inst, [part]))))


@dataclass(frozen=True)
class SymmetricSchedule:
    """A schedule of `instance` stored as one `part` per class of alike pipelines (a `Schedule`
    of that class alone) and the `layout` that repeats them. Reads like a `Schedule`: `ops`,
    `programs` and `rerouted` expand on first use (op by op; at scale use `parts`, `reduced`
    and `layout` instead)."""

    instance: Instance
    layout: Layout
    parts: tuple[Schedule, ...]
    solver: SolverInfo

    # -- one copy of every class side by side ---------------------------------------------

    @cached_property
    def reduced(self) -> Schedule:
        """One copy of every class as one schedule of the reduced instance, each O at its barrier."""
        inst, lay, pp = self.instance, self.layout, self.instance.pp
        bars = barrier_times(inst, self.parts)
        ops = []
        for off, part in zip(lay.offsets, self.parts):
            for op in with_optimizer_at_barrier(inst, part.ops, bars):
                ops.append(ScheduledOp(rank=op.rank + off * pp, kind=op.kind, dp=op.dp + off, pp=op.pp,
                                       mb=op.mb, start=op.start, end=op.end))
        return Schedule(instance=reduced_instance(inst, lay), ops=tuple(ops), solver=self.solver)

    # -- the map between reduced and full ranks -----------------------------------------

    @cached_property
    def full_ranks(self) -> tuple[tuple[int, ...], ...]:
        """full_ranks[reduced rank][copy] = the full rank that runs that copy of its program."""
        lay, pp, grid = self.layout, self.instance.pp, self.instance.rank_grid
        out = []
        for r in range(lay.reduced_dp):
            rows = [grid[d] for d in lay.stands_for(r)]
            for s in range(pp):
                out.append(tuple(row[s] for row in rows))
        return tuple(out)

    @cached_property
    def reduced_rank(self) -> dict[int, tuple[int, int]]:
        """Full rank -> (reduced rank, copy)."""
        return {full: (r, j) for r, fulls in enumerate(self.full_ranks) for j, full in enumerate(fulls)}

    # -- expansion -------------------------------------------------------------------

    def expanded_ops(self, copies: Mapping[int, set[int]] | None = None) -> Iterator[ScheduledOp]:
        """The full schedule's ops (of the given {class: copies} only, if `copies` is given)."""
        lay = self.layout
        by_class: dict[int, list[ScheduledOp]] = {}
        for op in self.reduced.ops:
            by_class.setdefault(lay.class_of_reduced[op.dp], []).append(op)
        for c, cls in enumerate(lay.classes):
            js = range(cls.count) if copies is None else sorted(copies.get(c, ()))
            for j in js:
                for op in by_class.get(c, ()):
                    yield ScheduledOp(rank=self.full_ranks[op.rank][j], kind=op.kind,
                                      dp=lay.full_pipeline(op.dp, j), pp=op.pp, mb=op.mb,
                                      start=op.start, end=op.end)

    @cached_property
    def first_copy_ops(self) -> tuple[ScheduledOp, ...]:
        """The ops of copy 0 of every class, in the cluster's numbering (what exports draw)."""
        return tuple(self.expanded_ops({c: {0} for c in range(len(self.layout.classes))}))

    def copy_holding(self, rank: int) -> Schedule:
        """The ops of the one copy that full rank `rank` belongs to (every peer it sends to or
        receives from is in it), as a `Schedule` of the whole instance; empty for a rank in none."""
        hit = self.reduced_rank.get(rank)
        ops: tuple[ScheduledOp, ...] = ()
        if hit is not None:
            c = self.layout.class_of_reduced[hit[0] // self.instance.pp]
            ops = tuple(self.expanded_ops({c: {hit[1]}}))
        return Schedule(instance=self.instance, ops=ops, solver=self.solver)

    @cached_property
    def expanded(self) -> Schedule:
        """The same schedule, op by op (what this stands for), built on first use."""
        return Schedule(instance=self.instance, ops=tuple(self.expanded_ops()), solver=self.solver)

    def expand(self) -> Schedule:
        return self.expanded

    @property
    def ops(self) -> tuple[ScheduledOp, ...]:
        return self.expanded.ops

    @property
    def programs(self) -> dict[int, tuple[ScheduledOp, ...]]:
        return self.expanded.programs

    def program(self, rank: int) -> tuple[ScheduledOp, ...]:
        return self.expanded.program(rank)

    @property
    def makespan(self) -> int:
        return self.reduced.makespan

    @property
    def rerouted(self) -> frozenset[OpId]:
        return self.expanded.rerouted

    @cached_property
    def untouched(self) -> int | None:
        """The class of the untouched pipelines (one healthy pipeline per copy), or None."""
        for c, (cls, part) in enumerate(zip(self.layout.classes, self.parts)):
            if cls.size == 1 and all(g.live and g.speed >= 1.0 for g in part.instance.gpus):
                return c
        return None

    @property
    def n_ops(self) -> int:
        """Ops of the expanded schedule, without expanding it."""
        return sum(len(part.ops) * cls.count for part, cls in zip(self.parts, self.layout.classes))


def first_copy_view(schedule, helpers_shown: int | None = None, classes_shown: int | None = None
                    ) -> tuple[list[Gpu], list[ScheduledOp], dict[int, str], str]:
    """What the exports draw: (GPUs, ops, a note per rank, a heading note). A schedule op by op
    is drawn whole; a symmetric one as the first copy of every class, each GPU noting how many
    copies it stands for; with `helpers_shown`, only that many of a component's helper
    pipelines (the others are alike); with `classes_shown`, only that many classes: the
    untouched one and the components repeated most often."""
    inst = schedule.instance
    if not isinstance(schedule, SymmetricSchedule):
        return list(inst.gpus), list(schedule.ops), {}, ""
    lay = schedule.layout
    order = sorted(range(len(lay.classes)), key=lambda c: (c != schedule.untouched, -lay.classes[c].count, c))
    drawn = set(order if classes_shown is None else order[:classes_shown])
    shown: set[int] = set()
    notes: dict[int, str] = {}
    hidden = 0
    for c, cls in enumerate(lay.classes):
        if c not in drawn:
            continue
        keep = cls.size if helpers_shown is None else min(cls.size, 1 + helpers_shown)
        hidden += cls.size - keep
        for d in cls.copies[0][:keep]:
            shown.add(d)
            for s in range(inst.pp):
                if cls.count > 1:
                    notes[inst.rank_grid[d][s]] = f"x{cls.count:,}"
    gpus = [g for g in inst.gpus if g.dp in shown]
    ops = [op for op in schedule.first_copy_ops if inst.gpus[op.rank].dp in shown]
    untouched = 0 if schedule.untouched is None else lay.classes[schedule.untouched].count
    left_out = len(lay.classes) - len(drawn)
    heading = (f"the first copy of {len(drawn)} of {len(lay.classes)} classes of alike pipelines"
               + (f" ({left_out} more in trace.json)" if left_out else "")
               + (f", {hidden:,} more alike helper pipelines not drawn" if hidden else "")
               + (f"; the untouched pipeline stands for {untouched:,}" if untouched else ""))
    return gpus, ops, notes, heading
