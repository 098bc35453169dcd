"""Local search around greedy's best plan: who runs each microbatch, then in what order.

Greedy's candidates (`solvers.greedy`) are whole plans built by rules; the
best of them is often one move away from a faster plan that no rule makes
(docs/baselines.md, "improve"). Two neighbourhoods, each searched by first
improvement (a move is kept when the steady iteration, `ProgramGraph.period`,
gets strictly shorter):

1. **Placement**: one microbatch of a failed or slow GPU moves to another
   GPU that may run it (a live peer of its stage, or back to its slow owner;
   a full-speed GPU keeps its own, as in CP-SAT's model and the proven
   bounds), and the table is list-scheduled again the way its candidate was
   (`Start.reschedule`). Microbatches are visited in the list scheduler's
   order (`assign.microbatch_key`), stages in order, target GPUs in rank
   order; after a kept move the scan goes on from the next move, and ends
   after a whole round of the moves without one.
2. **Order**: on the steady state's critical path
   (`ProgramGraph.waits_on_program`), an op whose inputs were there but
   which waited for the op before it on its GPU moves one, two or three
   places earlier; first on every GPU of its stage whose program holds the
   same ops at those places (symmetric pipelines share one critical cycle,
   and moving it on one alone changes nothing), then on its own GPU alone.
   A move that deadlocks the programs or takes a GPU over its memory is
   skipped.

Work is counted, not timed: each evaluation costs its programs' ops times
the iterations it plays, more per op for large programs (`evaluation_cost`), and the
search stops when `work` such units are spent, so the same input gives the
same plan on any machine.
A `deadline` (replan) also stops it, before an evaluation that the slowest
one so far says would not end in time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from schedc.instance import Instance
from schedc.opgraph import candidate_executors
from schedc.simulate_engine import DeadlockError, ProgramGraph, decode_op
from schedc.solvers.assign import Executor, microbatch_key
from schedc.verify import memory_profile

#: `reschedule(executor)` -> (op codes per rank, a topological order of them).
Reschedule = Callable[[Executor], "tuple[dict[int, list[int]], list[int]]"]

#: Share of the work the placement search may use; the order search gets the rest and what
#: the placement search left.
PLACEMENT_SHARE = 0.6

#: Places an op on the critical path moves earlier at most.
MAX_SHIFT = 3


@dataclass(frozen=True)
class Improved:
    graph: ProgramGraph  # the best programs found (`best`'s if no move helped)
    period: int
    placement_moves: int  # moves kept on the way to `graph`
    order_moves: int
    evaluations: int
    stopped_by: str  # "work", "deadline", or "local optimum" (no move helps)
    spent: int = 0  # work units the evaluations cost (counted: the same on any machine)


def executor_of(instance: Instance, codes: dict[int, Sequence[int]]) -> Executor:
    """The table `executor[u][s]` of the programs `codes`: the rank that runs each forward."""
    S, M = instance.pp, instance.microbatches
    ex: Executor = [[-1] * S for _ in range(instance.dp * M)]
    for rank, prog in codes.items():
        for c in prog:
            us, kind = divmod(c, 3)
            if kind == 0:
                u, s = divmod(us, S)
                ex[u][s] = rank
    return ex


#: Ops at which an evaluation costs twice as much per op: larger programs run slower per op
#: (1.5-1.9 us per unit up to 6,144 ops, 2.6 at 49,152 and 3.9 at 196,608 before this term),
#: and the work budget should buy the same wall time at any size. Re-measure: time
#: `improve(..., work=W)` at those sizes and divide by W (as for `greedy.UNITS_PER_S`).
SIZE_OPS = 100_000


def evaluation_cost(instance: Instance, rounds: int) -> int:
    """Work units of one evaluation: the ops list-scheduled (`rounds` iterations; 0 for an
    order move, which only times the programs) and timed once more, per op dearer as the
    programs grow (`SIZE_OPS`)."""
    n_ops = instance.dp * instance.pp * instance.microbatches * 3
    return int(n_ops * (rounds + 1) * (1 + n_ops / SIZE_OPS))


class _Budget:
    """Counted work, and the wall clock when a deadline is set."""

    def __init__(self, work: float, deadline: float | None, seconds_per_unit: float):
        self.left = work
        self.deadline = deadline
        self.slowest = seconds_per_unit  # of the slowest evaluation so far (or the caller's guess)
        self.evaluations = 0
        self.spent = 0
        self.stopped_by = "local optimum"

    def allows(self, cost: int) -> bool:
        if cost > self.left:
            self.stopped_by = "work"
            return False
        if self.deadline is not None and time.monotonic() + self.slowest * cost > self.deadline:
            self.stopped_by = "deadline"
            return False
        return True

    def spend(self, cost: int, began: float) -> None:
        self.left -= cost
        self.spent += cost
        self.evaluations += 1
        self.slowest = max(self.slowest, (time.perf_counter() - began) / cost)


def _placement_moves(instance: Instance) -> Iterator[tuple[int, int, int]]:
    """(u, s, rank) moves in scan order: each microbatch of a failed or slow GPU to every other
    GPU that may run it (`opgraph.candidate_executors`: a full-speed GPU keeps its own, the
    rule the proven bounds and CP-SAT's model share)."""
    S, M = instance.pp, instance.microbatches
    key = microbatch_key(instance)
    movable = {(d, s): candidate_executors(instance, d, s) for d in range(instance.dp) for s in range(S)
               if len(candidate_executors(instance, d, s)) > 1}
    for u in sorted(range(instance.dp * M), key=lambda u: key[u]):
        for s in range(S):
            for r in movable.get((u // M, s), ()):
                yield u, s, r


@dataclass(frozen=True)
class Start:
    """A list-scheduled plan whose placement the placement search may start from."""

    period: int
    graph: ProgramGraph
    reschedule: Reschedule  # list-schedules a placement the way this plan was
    rounds: int  # iterations `reschedule` plays


def improve(instance: Instance, best: tuple[int, ProgramGraph], starts: Sequence[Start], *,
            work: float, bound: int, deadline: float | None = None,
            seconds_per_unit: float = 0.0) -> Improved:
    """Search both neighbourhoods until `work` units are spent, `deadline` comes, the period
    reaches `bound`, or no move helps. `best` is the fastest plan so far (period, programs).
    With failed or slow GPUs the placement search starts from each of `starts` in turn (their
    placements differ; the next starts where the last one's moves ran out); the order search
    then starts from the fastest plan found. `seconds_per_unit` guesses an evaluation's wall
    time before the first one is timed (with a deadline, no evaluation starts that would end
    after it by that guess)."""
    budget = _Budget(work * PLACEMENT_SHARE, deadline, seconds_per_unit)
    placed = 0
    if instance.failed_gpus or instance.slow_gpus:
        for start in starts:
            if best[0] <= bound or budget.stopped_by != "local optimum":
                break
            found, kept = _search_placement(instance, start, budget, bound)
            if found[0] < best[0]:
                best, placed = found, kept
    ordered = 0
    if best[0] > bound and budget.stopped_by != "deadline":
        budget.left += work * (1 - PLACEMENT_SHARE)
        budget.stopped_by = "local optimum"
        best, ordered = _search_order(instance, best, budget, bound)
    return Improved(graph=best[1], period=best[0], placement_moves=placed, order_moves=ordered,
                    evaluations=budget.evaluations, spent=budget.spent,
                    stopped_by="local optimum" if best[0] <= bound else budget.stopped_by)


def _search_placement(instance: Instance, start: Start, budget: _Budget, bound: int
                      ) -> tuple[tuple[int, ProgramGraph], int]:
    best = (start.period, start.graph)
    ex = executor_of(instance, start.graph.programs)
    cost = evaluation_cost(instance, start.rounds)
    moves = list(_placement_moves(instance))
    kept = 0
    since_kept = 0  # moves tried since the last kept one: a whole round of them ends the scan
    i = 0
    while moves and since_kept < len(moves) and best[0] > bound:
        u, s, r = moves[i % len(moves)]
        i += 1
        since_kept += 1
        if ex[u][s] == r:
            continue  # the microbatch is there already (an earlier move put it there)
        if not budget.allows(cost):
            break
        began = time.perf_counter()
        old, ex[u][s] = ex[u][s], r
        codes, order = start.reschedule(ex)
        graph = ProgramGraph(instance, codes, order)
        period = graph.period()
        budget.spend(cost, began)
        if period < best[0]:
            best = (period, graph)
            kept += 1
            since_kept = 0
        else:
            ex[u][s] = old
    return best, kept


def _signature(instance: Instance, owner: list[int], c: int) -> tuple[int, int, int, int]:
    """An op as seen from its GPU: kind, stage, microbatch, and its pipeline relative to the GPU's."""
    S, M = instance.pp, instance.microbatches
    us, kind = divmod(c, 3)
    u, s = divmod(us, S)
    d, m = divmod(u, M)
    return kind, s, m, (d - instance.gpus[owner[c]].dp) % instance.dp


def _fits(instance: Instance, rank: int, prog: Sequence[int]) -> bool:
    return memory_profile(instance, rank, [decode_op(instance, c) for c in prog]).peak <= instance.gpu_memory


def _order_variants(instance: Instance, graph: ProgramGraph, a: int, c: int
                    ) -> Iterator[dict[int, list[int]]]:
    """The programs changed by moving c (after a on its rank) 1..MAX_SHIFT places earlier: on
    every rank of the stage with the same ops there (when there are several), then alone."""
    programs = graph.programs
    rank = graph.owner[c]
    prog = list(programs[rank])
    j = prog.index(c)
    stage = instance.gpus[rank].pp
    same_stage = [g.rank for g in instance.live_gpus(stage)]
    for shift in range(1, MAX_SHIFT + 1):
        if j - shift < 0:
            return
        pattern = [_signature(instance, graph.owner, x) for x in prog[j - shift:j + 1]]
        mirrored = {}
        for r in same_stage:
            p = list(programs.get(r, ()))
            if len(p) > j and [_signature(instance, graph.owner, x) for x in p[j - shift:j + 1]] == pattern:
                mirrored[r] = p[:j - shift] + [p[j]] + p[j - shift:j] + p[j + 1:]
        if len(mirrored) > 1:
            yield mirrored
        yield {rank: prog[:j - shift] + [c] + prog[j - shift:j] + prog[j + 1:]}


def _search_order(instance: Instance, best: tuple[int, ProgramGraph], budget: _Budget,
                  bound: int) -> tuple[tuple[int, ProgramGraph], int]:
    cost = evaluation_cost(instance, 0)
    kept = 0
    while best[0] > bound:
        period, graph = best
        found = False
        tried: set[tuple[int, int]] = set()
        for a, c in graph.waits_on_program():
            if (a, c) in tried:
                continue
            tried.add((a, c))
            for changed in _order_variants(instance, graph, a, c):
                if not all(_fits(instance, r, p) for r, p in changed.items()):
                    continue
                if not budget.allows(cost):
                    return best, kept
                began = time.perf_counter()
                programs = {r: list(p) for r, p in graph.programs.items()}
                programs.update(changed)
                try:
                    candidate = ProgramGraph(instance, programs)
                    new = candidate.period()
                except DeadlockError:
                    budget.spend(cost, began)
                    continue
                budget.spend(cost, began)
                if new < period:
                    best = (new, candidate)
                    kept += 1
                    found = True
                    break
            if found:
                break
        if not found:
            break
    return best, kept
