"""The simulator: steady-state metrics of a schedule's per-rank programs (docs/architecture.md, the simulator).

`simulate(schedule)` keeps only each rank's *program* (`Schedule.programs`)
and runs K iterations of all of them back to back with the simulator's
engine, `schedc.simulate_engine.run_programs` (the one place that turns
orders into times), then reports the steady-state period, per-GPU busy time,
bubble ratio and peak memory. Programs that cannot run raise the engine's
`DeadlockError`.

`Metrics` is what a schedule reports (schedule.json's ``metrics``, the
summary table of `schedc compile`/`schedc simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from schedc.memo import IdentityCache
from schedc.schedule import Schedule, SolverInfo
from schedc.simulate_engine import (STEADY_ITERATIONS, ProgramRun, combine_summaries, graph_of, program_graph,
                                    run_programs, steady_period)
from schedc.verify import memory_profile

#: Iterations simulated back to back (K); the window averaged over is `schedc.simulate_engine.STEADY_WINDOW`.
DEFAULT_ITERATIONS = STEADY_ITERATIONS


@dataclass(frozen=True)
class SimResult:
    """What running the programs K times back to back shows."""

    iteration_time: int  # steady-state period, microseconds
    iteration_end: tuple[int, ...]  # T_k for k = 0..K-1
    busy_time: Mapping[int, int]  # rank -> microseconds of ops per iteration
    bubble_ratio: Mapping[int, float]  # rank -> 1 - busy / iteration_time
    peak_memory: Mapping[int, int]  # rank -> bytes
    memory_limit: int
    lower_bound: float
    run: ProgramRun | None = field(repr=False, compare=False)  # None for a symmetric schedule

    @property
    def ratio_to_lower_bound(self) -> float:
        return self.iteration_time / self.lower_bound if self.lower_bound > 0 else 1.0


@dataclass(frozen=True)
class Metrics:
    """The metrics every schedule reports (docs/architecture.md, the simulator)."""

    iteration_time: int
    lower_bound: float
    ratio_to_lower_bound: float
    bubble_ratio: Mapping[int, float]
    busy_time: Mapping[int, int]
    peak_memory: Mapping[int, int]
    memory_limit: int
    solver: SolverInfo
    fault_free_iteration_time: int | None = None
    # Whose fault-free plan that time is: one reference for every solver's slowdown, the best
    # of the solver's own fault-free plan and greedy's (`schedc.plan.compile`).
    fault_free_solver: str | None = None

    @property
    def slowdown(self) -> float | None:
        """iteration_time / fault_free_iteration_time, when the latter is known."""
        if not self.fault_free_iteration_time:
            return None
        return self.iteration_time / self.fault_free_iteration_time

    @property
    def mean_bubble_ratio(self) -> float:
        vals = list(self.bubble_ratio.values())
        return sum(vals) / len(vals) if vals else 0.0

    @property
    def max_bubble_ratio(self) -> float:
        return max(self.bubble_ratio.values(), default=0.0)

    @property
    def max_peak_memory(self) -> int:
        return max(self.peak_memory.values(), default=0)

    def to_json(self) -> dict:
        """The ``metrics`` object of schedule.json; rank keys are strings."""
        s = self.solver
        return {
            "iteration_time": self.iteration_time,
            "fault_free_iteration_time": self.fault_free_iteration_time,
            "fault_free_solver": self.fault_free_solver,
            "slowdown": _round(self.slowdown),
            "lower_bound": _round(self.lower_bound),
            "ratio_to_lower_bound": _round(self.ratio_to_lower_bound),
            "bubble_ratio": {str(r): _round(v) for r, v in sorted(self.bubble_ratio.items())},
            "busy_time": {str(r): v for r, v in sorted(self.busy_time.items())},
            "peak_memory": {str(r): v for r, v in sorted(self.peak_memory.items())},
            "memory_limit": self.memory_limit,
            "solver": {**s.to_json(), "wall_s": round(s.wall_s, 3)},
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def simulate(schedule: Schedule, *, iterations: int = DEFAULT_ITERATIONS) -> SimResult:
    """Run the schedule's per-rank programs `iterations` times back to back.

    Start times in the schedule are ignored; only each rank's order counts.
    Raises `schedc.simulate_engine.DeadlockError` (E420/E421) if the programs cannot run.
    """
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    from schedc.symmetry import SymmetricSchedule

    if isinstance(schedule, SymmetricSchedule):
        return _simulate_symmetric(schedule, iterations)
    inst = schedule.instance
    graph = graph_of(schedule) if not inst.redundant_forward else None
    if graph is not None:
        # A planner's schedule, made by this graph from these very programs: run it (or take
        # the run its planner already made) without sorting and encoding its ops again.
        end, ends = graph.run(iterations)
        run = ProgramRun(iteration_end=tuple(ends), _graph=graph, _end=tuple(end))
        peaks = graph.peaks()
    else:
        programs = schedule.programs
        run = run_programs(inst, {r: [op.id for op in prog] for r, prog in programs.items()}, iterations)
        graph = run._graph  # its op durations are the ones the run used
        peaks = {g.rank: memory_profile(inst, g.rank, programs.get(g.rank, ())).peak
                 for g in inst.gpus if g.live}
    period = steady_period(run.iteration_end)
    busy: dict[int, int] = {}
    bubble: dict[int, float] = {}
    peak: dict[int, int] = {}
    dur, o0 = graph.dur, graph.o0
    for g in inst.gpus:
        if not g.live:
            continue
        busy[g.rank] = sum(map(dur.__getitem__, graph.programs.get(g.rank, ()))) + dur[o0 + g.rank]
        bubble[g.rank] = 1.0 - busy[g.rank] / period if period > 0 else 0.0
        peak[g.rank] = peaks[g.rank]
    return SimResult(
        iteration_time=period,
        iteration_end=run.iteration_end,
        busy_time=MappingProxyType(busy),
        bubble_ratio=MappingProxyType(bubble),
        peak_memory=MappingProxyType(peak),
        memory_limit=inst.gpu_memory,
        lower_bound=inst.lower_bound,
        run=run,
    )


#: Per part: its barrier summary, busy time and peak memory per local rank (a replan reuses parts).
_PARTS = IdentityCache(size=64)


def _part_summary(part: Schedule):
    known = _PARTS.get(part)
    if known is None:
        inst = part.instance
        programs = part.programs
        graph = program_graph(inst, {r: [op.id for op in prog] for r, prog in programs.items()})
        busy = {r: sum(inst.duration(op.kind, op.pp, r) for op in prog) for r, prog in programs.items()}
        peak = {r: memory_profile(inst, r, prog).peak for r, prog in programs.items()}
        known = (graph.barrier_summary(), busy, peak)
        _PARTS.put(part, known)
    return known


def _simulate_symmetric(schedule, iterations: int) -> SimResult:
    """A symmetric schedule: each part (a class planned alone) is summarised once by how its
    optimizer barriers carry over from one iteration to the next (`ProgramGraph.barrier_summary`),
    and the parts run together through the barriers they share (`combine_summaries`): the
    iteration ends of running the whole reduced schedule, at a cost per class. Every copy of a
    GPU's program has its busy time, bubble and peak memory; the lower bound is the cluster's."""
    summaries = [_part_summary(part) for part in schedule.parts]
    if any(s[0] is None for s in summaries):  # a rank with no ops: run the reduced schedule instead
        return _expand_metrics(schedule, simulate(schedule.reduced, iterations=iterations))
    ends = combine_summaries([s[0] for s in summaries], iterations)
    period = steady_period(ends)
    lay, pp = schedule.layout, schedule.instance.pp
    n = len(schedule.instance.gpus)
    busy_at: list[int | None] = [None] * n  # by full rank, so the maps come out in rank order
    peak_at: list[int] = [0] * n
    for off, (_, part_busy, part_peak) in zip(lay.offsets, summaries):
        for local, b in part_busy.items():
            p = part_peak[local]
            for full in schedule.full_ranks[off * pp + local]:
                busy_at[full], peak_at[full] = b, p
    live = [r for r in range(n) if busy_at[r] is not None]
    busy = {r: busy_at[r] for r in live}
    return SimResult(iteration_time=period, iteration_end=ends,
                     busy_time=MappingProxyType(busy),
                     bubble_ratio=MappingProxyType({r: 1.0 - b / period if period > 0 else 0.0
                                                    for r, b in busy.items()}),
                     peak_memory=MappingProxyType({r: peak_at[r] for r in live}),
                     memory_limit=schedule.instance.gpu_memory, lower_bound=schedule.instance.lower_bound,
                     run=None)


def _expand_metrics(schedule, red: SimResult) -> SimResult:
    """The reduced schedule's simulation, per-GPU figures given to every copy."""
    busy, bubble, peak = {}, {}, {}
    for r, fulls in enumerate(schedule.full_ranks):
        if r in red.busy_time:
            for full in fulls:
                busy[full], bubble[full], peak[full] = red.busy_time[r], red.bubble_ratio[r], red.peak_memory[r]
    return replace(red, busy_time=MappingProxyType(dict(sorted(busy.items()))),
                   bubble_ratio=MappingProxyType(dict(sorted(bubble.items()))),
                   peak_memory=MappingProxyType(dict(sorted(peak.items()))),
                   lower_bound=schedule.instance.lower_bound)


def metrics_of(schedule: Schedule, sim: SimResult | None = None, *,
               fault_free_iteration_time: int | None = None, fault_free_solver: str | None = None) -> Metrics:
    """The `Metrics` of a schedule, simulating it unless `sim` is given."""
    sim = sim if sim is not None else simulate(schedule)
    return Metrics(
        iteration_time=sim.iteration_time,
        lower_bound=sim.lower_bound,
        ratio_to_lower_bound=sim.ratio_to_lower_bound,
        bubble_ratio=sim.bubble_ratio,
        busy_time=sim.busy_time,
        peak_memory=sim.peak_memory,
        memory_limit=sim.memory_limit,
        solver=schedule.solver,
        fault_free_iteration_time=fault_free_iteration_time,
        fault_free_solver=fault_free_solver,
    )
