"""Run per-rank programs as early as their dependencies allow (docs/architecture.md).

This is the one place that turns *orders* into *times*. The simulator uses it
for K iterations back to back (steady-state metrics); solvers use it for one
iteration to time the order they chose (`schedule_from_programs`). It knows
the dependency rules through `schedc.opgraph` and nothing about any solver.

Programs that cannot all progress (a cycle between program order and
dependencies, or an op waiting for one that no rank runs) raise
`DeadlockError` (E420) naming, for each stuck rank, the op it is stuck at and
what that op waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from schedc.diagnostics import VerificationError, error
from schedc.instance import Instance
from schedc.opgraph import data_deps, last_backward_kind, optimizer_waits_for
from schedc.schedule import OpId, ScheduledOp, Schedule, SolverInfo


class DeadlockError(VerificationError):
    """The per-rank programs cannot all run to completion."""


@dataclass(frozen=True)
class ProgramRun:
    """Times of the last simulated iteration, and when each iteration ended."""

    start: Mapping[OpId, int]  # absolute times of the last iteration
    end: Mapping[OpId, int]
    executor: Mapping[OpId, int]
    iteration_end: tuple[int, ...]  # T_k: end of the last op of iteration k
    iteration_start: tuple[int, ...]  # start of the first op of iteration k

    @property
    def iterations(self) -> int:
        return len(self.iteration_end)


class _Compiled:
    """Programs flattened to arrays with a topological order, reusable for K iterations."""

    def __init__(self, instance: Instance, programs: Mapping[int, Sequence[OpId]]):
        self.instance = instance
        ops: list[OpId] = []
        rank_of: list[int] = []
        index: dict[OpId, int] = {}
        for rank in sorted(programs):
            for op in programs[rank]:
                if op in index:
                    other = rank_of[index[op]]
                    raise DeadlockError([error(
                        "E421", f"op {op} appears twice: in the programs of rank {other} and rank {rank}",
                        hint="every op must run exactly once; remove one of them")])
                index[op] = len(ops)
                ops.append(op)
                rank_of.append(rank)
        n_ops = len(ops)
        # Barrier nodes (no GPU, no duration): one per group of stages an O waits for.
        kind = last_backward_kind(instance)
        groups: dict[tuple[int, ...], int] = {}
        preds: list[list[tuple[int, int]]] = [[] for _ in range(n_ops)]
        missing: list[tuple[OpId, OpId]] = []
        for i, op in enumerate(ops):
            if op.kind == "O":
                group = optimizer_waits_for(instance, op.pp)
                if group not in groups:
                    groups[group] = len(preds)
                    bpreds = []
                    for s in group:
                        for d in range(instance.dp):
                            for m in range(instance.microbatches):
                                w = OpId(kind, d, s, m)
                                j = index.get(w)
                                if j is None:
                                    missing.append((op, w))
                                else:
                                    bpreds.append((j, 0))
                    preds.append(bpreds)
                preds[i].append((groups[group], 0))
            else:
                for dep in data_deps(instance, op):
                    j = index.get(dep.op)
                    if j is None:
                        missing.append((op, dep.op))
                    else:
                        preds[i].append((j, dep.delay))
        if missing:
            lines = [f"{op} on rank {rank_of[index[op]]} waits for {dep}, which no rank runs"
                     for op, dep in missing[:10]]
            more = f"\n... and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise DeadlockError([error(
                "E420", "the programs deadlock: some ops wait for ops that no rank runs",
                detail="\n".join(lines) + more,
                hint="every F, B and W of every microbatch must be in exactly one rank's program")])
        self.first_of_rank: dict[int, int] = {}
        for rank in sorted(programs):
            prog = programs[rank]
            for a, b in zip(prog, prog[1:]):
                preds[index[b]].append((index[a], 0))
            if prog:
                self.first_of_rank[rank] = index[prog[0]]
        self.ops = ops
        self.index = index
        self.rank_of = rank_of
        self.n_ops = n_ops
        self.preds = preds
        self.dur = [instance.duration(op.kind, op.pp, rank_of[i]) for i, op in enumerate(ops)]
        self.dur += [0] * (len(preds) - n_ops)
        self.order = self._topological_order(programs)

    def _topological_order(self, programs: Mapping[int, Sequence[OpId]]) -> list[int]:
        n = len(self.preds)
        succs: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for i, ps in enumerate(self.preds):
            indeg[i] = len(ps)
            for j, _ in ps:
                succs[j].append(i)
        ready = [i for i in range(n) if indeg[i] == 0]
        order: list[int] = []
        while ready:
            i = ready.pop()
            order.append(i)
            for k in succs[i]:
                indeg[k] -= 1
                if indeg[k] == 0:
                    ready.append(k)
        if len(order) < n:
            self._raise_deadlock(programs, set(order))
        return order

    def _raise_deadlock(self, programs: Mapping[int, Sequence[OpId]], done: set[int]) -> None:
        lines = []
        for rank in sorted(programs):
            for step, op in enumerate(programs[rank]):
                i = self.index[op]
                if i in done:
                    continue
                waits = []
                for j, _ in self.preds[i]:
                    if j in done:
                        continue
                    if j >= self.n_ops:
                        waits.append("the optimizer barrier (every W/B it waits for)")
                    else:
                        waits.append(f"{self.ops[j]} on rank {self.rank_of[j]}")
                lines.append(f"rank {rank} step {step}: {op} waits for {', '.join(waits)}")
                break
        raise DeadlockError([error(
            "E420", "the programs deadlock: no rank can make progress",
            detail="\n".join(lines),
            hint="a rank's program runs its ops in order; reorder the ops so that every op's "
                 "dependencies come earlier in the programs they belong to")])

    def run(self, iterations: int) -> ProgramRun:
        n = len(self.preds)
        start = [0] * n
        end = [0] * n
        gpu_ready = {rank: 0 for rank in self.first_of_rank}
        first_node = {i: rank for rank, i in self.first_of_rank.items()}
        iteration_end: list[int] = []
        iteration_start: list[int] = []
        preds, dur, order = self.preds, self.dur, self.order
        for _ in range(iterations):
            for i in order:
                t = 0
                for j, delay in preds[i]:
                    e = end[j] + delay
                    if e > t:
                        t = e
                rank = first_node.get(i)
                if rank is not None and gpu_ready[rank] > t:
                    t = gpu_ready[rank]
                start[i] = t
                end[i] = t + dur[i]
            real = range(self.n_ops)
            iteration_end.append(max((end[i] for i in real), default=0))
            iteration_start.append(min((start[i] for i in real), default=0))
            # The first op of the next iteration on a rank waits for the last op of this one.
            for rank in gpu_ready:
                gpu_ready[rank] = 0
            for i in real:
                r = self.rank_of[i]
                if end[i] > gpu_ready[r]:
                    gpu_ready[r] = end[i]
        return ProgramRun(
            start={op: start[i] for i, op in enumerate(self.ops)},
            end={op: end[i] for i, op in enumerate(self.ops)},
            executor={op: self.rank_of[i] for i, op in enumerate(self.ops)},
            iteration_end=tuple(iteration_end),
            iteration_start=tuple(iteration_start),
        )


def run_programs(instance: Instance, programs: Mapping[int, Sequence[OpId]], iterations: int = 1) -> ProgramRun:
    """Run every rank's program `iterations` times back to back, each op as early as allowed."""
    return _Compiled(instance, programs).run(iterations)


def schedule_from_programs(instance: Instance, programs: Mapping[int, Sequence[OpId]],
                           solver: SolverInfo) -> Schedule:
    """Time one iteration of the given programs (each op as early as possible) as a `Schedule`.

    This is how list schedulers turn the order they chose into start/end times.
    """
    run = run_programs(instance, programs, iterations=1)
    ops = tuple(
        ScheduledOp(rank=run.executor[op], kind=op.kind, dp=op.dp, pp=op.pp, mb=op.mb,
                    start=run.start[op], end=run.end[op])
        for rank in sorted(programs) for op in programs[rank]
    )
    return Schedule(instance=instance, ops=ops, solver=solver)
