"""A schedule: which GPU runs each op, and when (docs/architecture.md, docs/schedule-format.md).

`ScheduledOp` names the microbatch an op belongs to (`dp`, `pp`, `mb`) and
its executor (`rank`). For an optimizer op `O`, `dp`/`pp` are the executing
GPU's own and `mb` is None. A rank's program is its ops sorted by `start`.

Ops are printed in torch.distributed.pipelining's notation, prefixed by the
owning pipeline: ``d1:2F5`` is the forward of microbatch 5 of pipeline 1 at
stage 2; ``d1:2O`` is the optimizer of GPU (1, 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from schedc.instance import Instance, OpKind

SolverStatus = Literal["optimal", "feasible", "fallback"]


@dataclass(frozen=True, order=True)
class OpId:
    """Identity of an op, independent of where and when it runs."""

    kind: OpKind
    dp: int
    pp: int
    mb: int | None = None

    def __str__(self) -> str:
        if self.kind == "O":
            return f"d{self.dp}:{self.pp}O"
        return f"d{self.dp}:{self.pp}{self.kind}{self.mb}"


@dataclass(frozen=True)
class ScheduledOp:
    rank: int
    kind: OpKind
    dp: int
    pp: int
    mb: int | None
    start: int
    end: int

    @property
    def id(self) -> OpId:
        return OpId(self.kind, self.dp, self.pp, self.mb)

    @property
    def duration(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return str(self.id)


_new = object.__new__


def scheduled_op(rank: int, kind: OpKind, dp: int, pp: int, mb: int | None, start: int, end: int) -> ScheduledOp:
    """`ScheduledOp(rank, kind, dp, pp, mb, start, end)`, the same frozen object (equal, same
    hash), made without the frozen dataclass's guarded assignment of each field: under half the
    cost, for the engine, which makes one per op of every plan (6,144 ops at 64 GPUs: 12 ms of
    a replan's floor, 5 ms this way; re-measure with `python -m timeit`)."""
    op = _new(ScheduledOp)
    op.__dict__.update(rank=rank, kind=kind, dp=dp, pp=pp, mb=mb, start=start, end=end)
    return op


def _program_order(op: ScheduledOp) -> tuple:
    """(start, end, then the op's identity as `OpId` orders it), without building an OpId."""
    return (op.start, op.end, op.kind, op.dp, op.pp, -1 if op.mb is None else op.mb)


#: The plans the solvers search, and so the plans their `optimal` and proven bound are about:
#: the spec's layout kept, a failed GPU's work (and part of a slow GPU's) moved to its
#: data-parallel peers. A plan of another kind can be faster than an `optimal` one, e.g. the
#: `redundant` baseline (Bamboo: the previous GPU of the pipeline runs a failed stage from its copy).
PLAN_SPACE = "re-routing plans"


def status_text(status: str) -> str:
    """A solver status as printed: `optimal` says which plans it is optimal among."""
    return f"optimal among {PLAN_SPACE}" if status == "optimal" else status


@dataclass(frozen=True)
class SolverInfo:
    name: str
    status: SolverStatus = "feasible"
    objective: float | None = None  # the solver's own predicted time, if it has one
    bound: float | None = None  # the solver's proven lower bound, if it has one
    wall_s: float = 0.0
    detail: str = ""  # free text: why a fallback happened, which variant won, ...
    # "work": every search ended on its work budget (counted candidates, CP-SAT's deterministic
    # time) or on a proven bound, so the same input gives the same plan on any machine under any
    # load. "deadline": a wall-clock deadline (`replan`) cut a search short, so the plan may
    # differ from one run or host to another.
    stopped_by: Literal["work", "deadline"] = "work"

    def to_json(self) -> dict:
        """The `solver` object of schedule.json (docs/schedule-format.md)."""
        return {"name": self.name, "status": self.status, "objective": self.objective,
                "bound": self.bound, "wall_s": self.wall_s, "detail": self.detail,
                "stopped_by": self.stopped_by}


def is_rerouted(instance: Instance, op: ScheduledOp) -> bool:
    """Whether `op` runs on another GPU than its own pipeline's at its stage (an O never does)."""
    return op.kind != "O" and op.rank != instance.gpu(op.dp, op.pp).rank


@dataclass(frozen=True)
class Schedule:
    instance: Instance
    ops: tuple[ScheduledOp, ...]
    solver: SolverInfo = field(default_factory=lambda: SolverInfo(name="unknown"))

    @cached_property
    def programs(self) -> dict[int, tuple[ScheduledOp, ...]]:
        """Each live rank's ops in program order (by start, ties by end then op id)."""
        progs: dict[int, list[ScheduledOp]] = {g.rank: [] for g in self.instance.gpus if g.live}
        for op in self.ops:
            progs.setdefault(op.rank, []).append(op)
        return {r: tuple(sorted(ops, key=_program_order)) for r, ops in progs.items()}

    def program(self, rank: int) -> tuple[ScheduledOp, ...]:
        return self.programs.get(rank, ())

    @cached_property
    def makespan(self) -> int:
        return max((op.end for op in self.ops), default=0)

    @cached_property
    def rerouted(self) -> frozenset[OpId]:
        """Ops whose executor is not the GPU of their own pipeline and stage."""
        return frozenset(op.id for op in self.ops if is_rerouted(self.instance, op))
