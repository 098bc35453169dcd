"""Symmetric schedules: pipelines that run the same programs are stored, checked and simulated once.

At 16,384 GPUs a plan with a few failed GPUs has 2,000 pipelines that no
failure touches, each running the same program up to its index, and a few
small groups of pipelines around each failure (the failed pipeline and the
peers that took its microbatches), which repeat too: two GPUs failed at the
same stage leave two groups with the same programs. A `Layout` names these
*classes*: each class is a group of `size` pipelines and the *copies* of it
in the cluster (tuples of full pipeline indices, copy 0 the representative).

A `SymmetricSchedule` is a `Schedule` of the *reduced instance* (one copy
of every class, its pipelines numbered 0.. in class order, ranks
pipeline-major) plus the layout. Its meaning is the *expanded* schedule:
every copy of a class runs the reduced ops of that class with its own
pipelines and GPUs. The verifier (`schedc.verify`) and the simulator
(`schedc.simulate`) check and time the reduced schedule, after checking that
the expansion is sound (every copy's GPUs are in the same state and speed as
the representative's, and no op of a class runs outside its class); they give
the same verdict and the same times as the expanded schedule op by op,
because copies share nothing but the optimizer's barrier, whose latest
W is the same in every copy (tests/test_symmetry.py checks both ways).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterator, Mapping

from schedc.instance import Instance
from schedc.schedule import OpId, Schedule, ScheduledOp, SolverInfo, _program_order
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


def reduced_gpus(full: Instance, layout: Layout) -> tuple[Gpu, ...]:
    """The reduced instance's GPUs: reduced (r, s) is copy 0's GPU, ranked r * pp + s."""
    out = []
    for r in range(layout.reduced_dp):
        d = layout.full_pipeline(r, 0)
        for s in range(full.pp):
            g = full.gpu(d, s)
            out.append(Gpu(rank=r * full.pp + s, dp=r, pp=s, node=g.node, state=g.state, speed=g.speed))
    return tuple(out)


def reduced_instance(full: Instance, layout: Layout) -> Instance:
    """The instance of one copy of every class (its pipelines in class order)."""
    return replace(full, dp=layout.reduced_dp, gpus=reduced_gpus(full, layout))


def layout_problems(full: Instance, layout: Layout, reduced: Instance) -> list[str]:
    """Why expanding a schedule of `reduced` over `layout` would not be a schedule of `full`
    (empty: it would). Checks every GPU of every copy against its class's representative."""
    problems: list[str] = []
    if not layout.classes:
        return ["the layout has no classes"]
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
    if (reduced.dp, reduced.pp) != (layout.reduced_dp, full.pp) or any(
            getattr(reduced, k) != getattr(full, k) for k in (
                "microbatches", "decouple_backward", "stagger_optimizer", "gpu_memory", "link", "stages")):
        return ["the reduced instance differs from the cluster in shape, options or costs"]
    for c, cls in enumerate(layout.classes):
        off = layout.offsets[c]
        for i in range(cls.size):
            for s in range(full.pp):
                rep = reduced.gpu(off + i, s)
                for j, copy in enumerate(cls.copies):
                    g = full.gpu(copy[i], s)
                    if (g.state, g.speed) != (rep.state, rep.speed):
                        problems.append(
                            f"GPU (dp={g.dp}, pp={s}) is {_condition(g)} but the pipeline it repeats "
                            f"(reduced pipeline {off + i}) has {_condition(rep)} there")
                        if len(problems) >= 10:
                            return problems
    return problems


def _condition(g: Gpu) -> str:
    if not g.live:
        return "failed"
    return f"slow ({g.speed:g})" if g.speed < 1.0 else "live at full speed"


def ops_outside_class(layout: Layout, reduced: Schedule) -> list[ScheduledOp]:
    """Reduced ops run by a GPU of another class (their copies would run on GPUs of other copies)."""
    of = layout.class_of_reduced
    pp = reduced.instance.pp
    return [op for op in reduced.ops if op.dp >= len(of) or op.rank // pp >= len(of)
            or of[op.dp] != of[op.rank // pp]]


@dataclass(frozen=True)
class SymmetricSchedule:
    """A schedule of `instance` stored as `reduced` (a `Schedule` of the reduced instance) and
    the `layout` that repeats it. Reads like a `Schedule`: `ops`, `programs` and `rerouted` expand
    on first use (op by op; at scale use `reduced` and `layout` instead)."""

    instance: Instance
    layout: Layout
    reduced: Schedule
    solver: SolverInfo

    # -- the map between reduced and full ranks -----------------------------------------

    @cached_property
    def full_ranks(self) -> tuple[tuple[int, ...], ...]:
        """full_ranks[reduced rank][copy] = the full rank that runs that copy of its program."""
        inst, lay, pp = self.instance, self.layout, self.instance.pp
        out = []
        for r in range(lay.reduced_dp):
            for s in range(pp):
                out.append(tuple(inst.gpu(d, s).rank for d in lay.stands_for(r)))
        return tuple(out)

    @cached_property
    def reduced_rank(self) -> dict[int, tuple[int, int]]:
        """Full rank -> (reduced rank, copy)."""
        return {full: (r, j) for r, fulls in enumerate(self.full_ranks) for j, full in enumerate(fulls)}

    def full_rank(self, reduced_rank: int, copy: int) -> int:
        return self.full_ranks[reduced_rank][copy]

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

    def copy_holding(self, rank: int) -> Schedule:
        """The ops of the one copy that full rank `rank` belongs to (every peer it sends to or
        receives from is in it), as a `Schedule` of the whole instance; empty for a rank in none."""
        hit = self.reduced_rank.get(rank)
        ops: tuple[ScheduledOp, ...] = ()
        if hit is not None:
            c = self.layout.class_of_reduced[hit[0] // self.instance.pp]
            ops = tuple(self.expanded_ops({c: {hit[1]}}))
        return Schedule(instance=self.instance, ops=ops, solver=self.solver)

    def expand(self) -> Schedule:
        """The same schedule, op by op (what this stands for)."""
        return Schedule(instance=self.instance, ops=tuple(self.expanded_ops()), solver=self.solver)

    @cached_property
    def ops(self) -> tuple[ScheduledOp, ...]:
        return tuple(self.expanded_ops())

    @cached_property
    def programs(self) -> dict[int, tuple[ScheduledOp, ...]]:
        progs: dict[int, list[ScheduledOp]] = {g.rank: [] for g in self.instance.gpus if g.live}
        for op in self.ops:
            progs.setdefault(op.rank, []).append(op)
        return {r: tuple(sorted(ops, key=_program_order)) for r, ops in progs.items()}

    def program(self, rank: int) -> tuple[ScheduledOp, ...]:
        return self.programs.get(rank, ())

    @property
    def makespan(self) -> int:
        return self.reduced.makespan

    @cached_property
    def rerouted(self) -> frozenset[OpId]:
        inst = self.instance
        return frozenset(op.id for op in self.ops if op.kind != "O" and op.rank != inst.gpu(op.dp, op.pp).rank)

    @property
    def n_ops(self) -> int:
        """Ops of the expanded schedule, without expanding it."""
        per_class: dict[int, int] = {}
        for op in self.reduced.ops:
            c = self.layout.class_of_reduced[op.dp]
            per_class[c] = per_class.get(c, 0) + 1
        return sum(n * self.layout.classes[c].count for c, n in per_class.items())

    def describe(self) -> str:
        """One line: how many pipelines the reduced schedule stands for."""
        lay = self.layout
        biggest = max(lay.classes, key=lambda c: (c.count, -c.size))
        return (f"{lay.full_dp:,} pipelines planned as {lay.reduced_dp:,} in {len(lay.classes)} "
                f"classes; the largest repeats {biggest.count:,} times")


def first_copy_view(schedule, helpers_shown: int | None = None
                    ) -> tuple[list[Gpu], list[ScheduledOp], dict[int, str], str]:
    """What the exports draw: (GPUs, ops, a note per rank, a heading note). A schedule op by op
    is drawn whole; a symmetric one as the first copy of every class, each GPU noting how many
    copies it stands for, and (with `helpers_shown`) only that many of a component's helper
    pipelines, the others being alike."""
    inst = schedule.instance
    if not isinstance(schedule, SymmetricSchedule):
        return list(inst.gpus), list(schedule.ops), {}, ""
    lay = schedule.layout
    shown: set[int] = set()
    notes: dict[int, str] = {}
    hidden = 0
    for c, cls in enumerate(lay.classes):
        keep = cls.size if helpers_shown is None else min(cls.size, 1 + helpers_shown)
        hidden += cls.size - keep
        for i, d in enumerate(cls.copies[0][:keep]):
            shown.add(d)
            for s in range(inst.pp):
                rank = inst.gpu(d, s).rank
                if cls.count > 1:
                    notes[rank] = f"x{cls.count:,}"
    gpus = [g for g in inst.gpus if g.dp in shown]
    ops = [op for op in schedule.expanded_ops({c: {0} for c in range(len(lay.classes))})
           if inst.gpus[op.rank].dp in shown]
    untouched = next((cls.count for cls in lay.classes if cls.size == 1 and _healthy(inst, cls.copies[0][0])), 0)
    heading = (f"the first copy of each of {len(lay.classes)} classes of alike pipelines"
               + (f", {hidden:,} more alike helper pipelines not drawn" if hidden else "")
               + (f"; the untouched pipeline stands for {untouched:,}" if untouched else ""))
    return gpus, ops, notes, heading


def _healthy(inst: Instance, d: int) -> bool:
    return all(g.live and g.speed >= 1.0 for g in (inst.gpu(d, s) for s in range(inst.pp)))


def n_ops(schedule) -> int:
    """Ops of a schedule, compact or not, without expanding it."""
    return schedule.n_ops if isinstance(schedule, SymmetricSchedule) else len(schedule.ops)
