"""CP-SAT re-partitioning: a shape's slice boundaries and its GPUs chosen together.

`solve_layout(units, dp, pp, microbatches, memory, gpus, held, speed, ...)`
lays `units` out as `dp` pipelines of `pp` stages on `gpus` at the least
`repartition.layout_objective`: ``horizon x ((M + P - 1) x slowest slot +
slowest optimizer step) + the largest state transfer``. The greedy rule (`repartition.greedy_layout`)
splits at full speed and then deals GPUs; this model sees that a slow GPU
makes its whole stage slow, and which GPU already holds which units, while it
cuts. docs/planner.md ("Re-partitioning with CP-SAT") has the model; in short:

- **Slices.** One literal per stage s and slice [a, b) that fits `memory`
  (`repartition.fits` on `units.slice_costs(a, b, dp, pp, s)`, precomputed for
  every (a, b, s): a layer slice's costs are not a sum over its layers, with
  the embedding and head on the ends and times rounded per slice). Exactly one
  per stage, and stage s ends where stage s + 1 starts (a path through the cut
  points, so even the LP relaxation is contiguous).
- **GPUs.** y[g, s]: GPU g runs a slot of stage s; `dp` per stage, at most one
  slot per GPU. Pipelines are not told apart (nothing in the objective does):
  a stage's GPUs go to pipelines 0..dp-1 in rank order. GPUs alike in speed and
  in what they hold take stages in rank order (symmetry).
- **Bottleneck.** T >= ``ceil(work / speed)`` of stage s's slice for each speed
  present in stage s (z[s, v] <- y[g, s] for the GPUs g of speed v), precomputed
  per speed (integers, as the simulator's `scaled_duration`); T >= the
  full-speed optimum of `partition_units`. O, the slowest optimizer step, alike.
- **Transfer.** need[g, u] for every unit u that GPU g does not hold:
  y[g, s] and "u in stage s" imply need[g, u]; R x bandwidth >= 10^6 x the
  bytes GPU g needs, for every g.
- **Objective.** horizon x ((M + P - 1) x T + O) + R.

The greedy layout is the model's complete hint and stays the answer when
CP-SAT does not beat it (`fallback`), so the result is never worse than
greedy's. Deterministic: one worker, a fixed seed and a deterministic-time
budget (`time_limit` is a work budget, as in `SolveOptions`), never the clock.
"""

from __future__ import annotations

import math
from math import gcd
from typing import Mapping, NamedTuple, Sequence

from schedc.layout import HORIZON_ITERATIONS, Layout, Units, fits, layout_objective, work
from schedc.repartition import greedy_layout
from schedc.solvers.sandbox import Solved, SolverFailed, solve_contained
from schedc.spec import scaled_duration

#: Seconds of wall per unit of CP-SAT's deterministic time on these models (one worker, 2 shared
#: cores), so that `time_limit` of work takes about `time_limit` of wall: 2.3-2.6 on the solves
#: of bench/repartition_gap.py that search longest (the 2 x 7 slow-GPU states, 0.13-0.2 units);
#: short solves are mostly fixed costs (up to 20 s per unit at 0.01 units). Re-measure there.
_WALL_S_PER_DET = 2.5


class LayoutResult(NamedTuple):
    """`layout`: the best layout found (None when `status` is ``infeasible``); `objective`: its
    `layout_objective`; `bound`: CP-SAT's proven lower bound on every layout of the shape (None
    when it proved nothing); `status`: ``optimal`` (objective == bound), ``feasible`` (CP-SAT's
    layout, not proven), ``fallback`` (greedy's layout: CP-SAT found none better, or failed) or
    ``infeasible`` (no split fits `memory`, or too few GPUs)."""

    layout: Layout | None
    objective: int | None
    bound: int | None
    status: str


def solve_layout(units: Units, dp: int, pp: int, microbatches: int, memory: int, gpus: Sequence[int],
                 held: Mapping[int, frozenset[int]], speed: Mapping[int, float] | None = None, *,
                 horizon_iterations: int = HORIZON_ITERATIONS, bandwidth: int, time_limit: float = 1.0,
                 seed: int = 0) -> LayoutResult:
    """The layout of `units` as `dp` x `pp` on `gpus` (ranks) with the least `layout_objective`,
    each stage within `memory` (`fits`, `microbatches` per pipeline); `held`: the units each GPU
    holds now; `speed`: GPU speeds (default 1.0); `bandwidth`: bytes/s a GPU receives state at.
    `time_limit`: a work budget (calibrated seconds; CP-SAT's deterministic time)."""
    from ortools.sat.python import cp_model

    gpus = sorted(set(gpus))
    speed = {g: min(1.0, speed.get(g, 1.0)) for g in gpus} if speed else {g: 1.0 for g in gpus}
    seed_layout = greedy_layout(units, dp, pp, microbatches, memory, gpus, held, speed)
    if seed_layout is None:
        return LayoutResult(None, None, None, "infeasible")

    def price(layout: Layout) -> int:
        return layout_objective(units, layout, held, speed, horizon_iterations=horizon_iterations,
                                bandwidth=bandwidth)

    seed_price = price(seed_layout)
    data = _Data(units, dp, pp, microbatches, memory, gpus, held, speed, horizon_iterations, bandwidth,
                 seed_layout)
    model = _Model(cp_model.CpModel(), data)
    model.hint(seed_layout)

    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = seed
    p.catch_sigint_signal = False  # the caller's Ctrl-C stays the caller's (solvers/cpsat.py)
    # Probing took 0.22 deterministic units of 0.3 (three passes) before the first branch on the
    # 2 x 7 GPT-350M model, and proved nothing the search did not (same optima, 4x less work).
    p.cp_model_probing_level = 0
    p.max_deterministic_time = max(0.01, time_limit / _WALL_S_PER_DET)
    try:
        solved = solve_contained(solver, model.m)  # an OR-Tools abort must not end the caller
    except SolverFailed:
        return LayoutResult(seed_layout, seed_price, None, "fallback")
    status = solved.status
    if status == cp_model.INFEASIBLE:  # the hint is feasible in the model: a bug if reached
        raise AssertionError("the layout model rejected greedy's layout")
    bound = math.ceil(solved.best_objective_bound - 1e-6) if status != cp_model.MODEL_INVALID else None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return LayoutResult(seed_layout, seed_price, bound, "fallback")
    layout = model.layout(solved)
    objective = price(layout)
    if objective > seed_price:
        return LayoutResult(seed_layout, seed_price, bound, "fallback")
    proven = status == cp_model.OPTIMAL or (bound is not None and objective <= bound)
    return LayoutResult(layout, objective, bound, "optimal" if proven else "feasible")


class _Data:
    """What the model is built from: every fitting slice's costs, per stage, precomputed."""

    def __init__(self, units: Units, dp: int, pp: int, microbatches: int, memory: int, gpus: list[int],
                 held: Mapping[int, frozenset[int]], speed: dict[int, float], horizon: int, bandwidth: int,
                 seed: Layout):
        self.units, self.dp, self.pp, self.n = units, dp, pp, units.count
        self.microbatches, self.memory, self.gpus, self.speed = microbatches, memory, gpus, speed
        self.held = {g: held.get(g, frozenset()) for g in gpus}
        self.horizon, self.bandwidth = horizon, bandwidth
        n = self.n
        #: slices[s]: [(a, b, work, optimizer)] of every slice stage s may hold within memory.
        self.slices: list[list[tuple[int, int, int, int]]] = []
        for s in range(pp):
            firsts = [0] if s == 0 else range(s, n - pp + s + 1)
            out = []
            for a in firsts:
                ends = [n] if s == pp - 1 else range(a + 1, n - pp + s + 2)
                for b in ends:
                    c = units.slice_costs(a, b, dp, pp, s)
                    if fits(c, s, pp, microbatches, memory):
                        out.append((a, b, work(c), c.optimizer))
            self.slices.append(out)
        self.speeds = sorted(set(speed.values()))
        self.unit_bytes = [units.state_bytes(u, u + 1) for u in range(n)]
        # partition_units' split (greedy's) has the least full-speed bottleneck of all that fit.
        self.full_speed_optimum = max(work(units.slice_costs(a, b, dp, pp, s))
                                      for s, (a, b) in enumerate(seed.slices))


class _Model:
    """The CP-SAT model of one shape; one method per constraint family."""

    def __init__(self, m, data: _Data):
        self.m, self.d = m, data
        self._slices()
        self._gpus()
        self._bottleneck()
        self._transfer()
        self._symmetry()
        d = data
        m.Minimize(d.horizon * ((d.microbatches + d.pp - 1) * self.T + self.O) + self.R)

    def _slices(self) -> None:
        m, d = self.m, self.d
        self.x = [{(a, b): m.NewBoolVar(f"x{s}_{a}_{b}") for a, b, _, _ in d.slices[s]} for s in range(d.pp)]
        for s in range(d.pp):
            m.AddExactlyOne(self.x[s].values())
        for s in range(d.pp - 1):  # stage s ends where stage s + 1 starts
            for cut in range(1, d.n):
                ends = [v for (a, b), v in self.x[s].items() if b == cut]
                starts = [v for (a, b), v in self.x[s + 1].items() if a == cut]
                if ends or starts:
                    m.Add(sum(ends) == sum(starts))
        # inside[s][u]: unit u is in stage s's slice.
        self.inside: list[dict[int, object]] = []
        for s in range(d.pp):
            row = {}
            for u in range(d.n):
                covering = [v for (a, b), v in self.x[s].items() if a <= u < b]
                if covering:
                    row[u] = m.NewBoolVar(f"in{s}_{u}")
                    m.Add(row[u] == sum(covering))
            self.inside.append(row)

    def _gpus(self) -> None:
        m, d = self.m, self.d
        self.y = {g: [m.NewBoolVar(f"y{g}_{s}") for s in range(d.pp)] for g in d.gpus}
        for s in range(d.pp):
            m.Add(sum(self.y[g][s] for g in d.gpus) == d.dp)
        for g in d.gpus:
            m.AddAtMostOne(self.y[g])

    def _bottleneck(self) -> None:
        """T: the slowest slot; O: the slowest optimizer step. Both per speed present in a stage,
        precomputed as integers (no 1/speed in the model)."""
        m, d = self.m, self.d
        self.dur = [{v: {(a, b): scaled_duration(w, v) for a, b, w, _ in d.slices[s]} for v in d.speeds}
                    for s in range(d.pp)]
        step = [{v: {(a, b): scaled_duration(o, v) for a, b, _, o in d.slices[s]} for v in d.speeds}
                for s in range(d.pp)]
        top = max(max(t.values()) for s in range(d.pp) for t in self.dur[s].values())
        # partition_units' full-speed optimum: no layout's slowest slot is faster (speed <= 1).
        self.T = m.NewIntVar(d.full_speed_optimum, top, "T")
        self.O = m.NewIntVar(0, max(max(t.values()) for s in range(d.pp) for t in step[s].values()), "O")
        fastest = d.speeds[-1]
        self.z = {}
        for s in range(d.pp):
            for v in d.speeds:
                slot = sum(t * self.x[s][k] for k, t in self.dur[s][v].items())
                opt = sum(t * self.x[s][k] for k, t in step[s][v].items())
                if v == fastest:  # every stage has a GPU, at best this fast
                    m.Add(self.T >= slot)
                    m.Add(self.O >= opt)
                    continue
                z = self.z[s, v] = m.NewBoolVar(f"z{s}_{v}")
                for g in d.gpus:
                    if d.speed[g] == v:
                        m.AddImplication(self.y[g][s], z)
                m.Add(self.T >= slot).OnlyEnforceIf(z)
                m.Add(self.O >= opt).OnlyEnforceIf(z)
        self.step = step

    def _transfer(self) -> None:
        m, d = self.m, self.d
        k = gcd(10**6, d.bandwidth)
        per_byte, per_us = 10**6 // k, d.bandwidth // k  # R x per_us >= bytes x per_byte
        total = sum(d.unit_bytes)
        self.R = m.NewIntVar(0, -(-total * 10**6 // d.bandwidth), "R")
        self.need: dict[tuple[int, int], object] = {}
        for g in d.gpus:
            terms = []
            for u in range(d.n):
                if u in d.held[g] or d.unit_bytes[u] == 0:
                    continue
                v = self.need[g, u] = m.NewBoolVar(f"need{g}_{u}")
                for s in range(d.pp):
                    if u in self.inside[s]:
                        m.AddBoolOr([self.y[g][s].Not(), self.inside[s][u].Not(), v])
                terms.append(d.unit_bytes[u] * per_byte * v)
            if terms:
                m.Add(per_us * self.R >= sum(terms))

    def _symmetry(self) -> None:
        """GPUs alike in speed and held units are interchangeable: the lower rank takes the lower
        stage (an unused GPU counts as stage pp). Any layout has a relabelling that obeys this."""
        m, d = self.m, self.d
        for group in _alike(d).values():
            for g, h in zip(group, group[1:]):
                m.Add(sum((d.pp - s) * self.y[g][s] for s in range(d.pp))
                      >= sum((d.pp - s) * self.y[h][s] for s in range(d.pp)))

    def hint(self, layout: Layout) -> None:
        """Every variable's value in `layout` (relabelled to obey `_symmetry`)."""
        m, d = self.m, self.d
        stage_of = _canonical_stages(d, layout)
        for s, (a, b) in enumerate(layout.slices):
            for key, v in self.x[s].items():
                m.AddHint(v, key == (a, b))
            for u, v in self.inside[s].items():
                m.AddHint(v, a <= u < b)
        for g in d.gpus:
            for s in range(d.pp):
                m.AddHint(self.y[g][s], stage_of.get(g) == s)
        for (s, v), z in self.z.items():
            m.AddHint(z, any(stage_of.get(g) == s and d.speed[g] == v for g in d.gpus))
        for (g, u), v in self.need.items():
            s = stage_of.get(g)
            m.AddHint(v, s is not None and layout.slices[s][0] <= u < layout.slices[s][1])
        most = max(sum(d.unit_bytes[u] for u in range(*layout.slices[s]) if u not in d.held[g])
                   for g, s in stage_of.items())
        m.AddHint(self.R, -(-most * 10**6 // d.bandwidth))
        m.AddHint(self.T, max(self.dur[s][d.speed[g]][layout.slices[s]] for g, s in stage_of.items()))
        m.AddHint(self.O, max(self.step[s][d.speed[g]][layout.slices[s]] for g, s in stage_of.items()))

    def layout(self, solved: Solved) -> Layout:
        d = self.d
        slices = tuple(next(k for k, v in self.x[s].items() if solved.boolean_value(v)) for s in range(d.pp))
        stage_gpus = [[g for g in d.gpus if solved.boolean_value(self.y[g][s])] for s in range(d.pp)]
        ranks = tuple(tuple(stage_gpus[s][i] for s in range(d.pp)) for i in range(d.dp))
        return Layout(d.dp, d.pp, d.microbatches, slices, ranks)


def _alike(d: _Data) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for g in d.gpus:
        groups.setdefault((d.speed[g], tuple(sorted(d.held[g]))), []).append(g)
    return groups


def _canonical_stages(d: _Data, layout: Layout) -> dict[int, int]:
    """GPU -> its stage in `layout`, with alike GPUs swapped so that lower ranks take lower stages."""
    stage_of = {r: s for row in layout.ranks for s, r in enumerate(row)}
    out = {}
    for group in _alike(d).values():
        positions = sorted(stage_of.get(g, d.pp) for g in group)
        for g, s in zip(group, positions):
            if s < d.pp:
                out[g] = s
    return out
