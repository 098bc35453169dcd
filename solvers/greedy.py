"""`greedy`: schedc's own list scheduler (docs/baselines.md).

It builds a few candidate plans and keeps the one with the shortest
steady-state iteration time (the programs run back to back,
`steady_iteration_time`, as the simulator measures them):

- placements (`solvers.assign`): speed-weighted balance, which moves failed
  GPUs' microbatches and part of a slow GPU's to peers so that loads even
  out (spread over the iteration, or the slow GPU's last ones), with slow
  GPUs also by earliest completion counting their (slow) optimizer step, and
  the plain round-robin re-routing of `reroute-1f1b`;
- priority rules for the list scheduler (`solvers.listsched`): 1F1B-like
  (each W right after its B) and ZB-like (B, then F, W filling idle time);
- in-flight limits: 1F1B's S - s per pipeline a GPU serves, or only memory;
- steady candidates: each placement with the ZB-like rule (1F1B-like when
  B and W are one op) and the memory limit, played over two iterations with
  the optimizer steps between them, keeping the second iteration's
  programs: a slow GPU's late O or a helper's extra microbatches shape how
  one iteration drains into the next, which a single iteration from an empty
  pipeline does not see;
- seeds: the 1F1B, ZB-H1 and ZB-H2 templates (the paper's, three
  variants of its warm-up depth and W deferral, and the best *split* shape on
  one pipeline, `best_split_style`) on instances without failed GPUs (so
  greedy is never worse than them), and `reroute-1f1b`'s own programs under failures
  (so it is never worse than re-routing).

Then a local search (`solvers.improve`) starts from the best: one microbatch
moved to another GPU of its stage (where a GPU failed or is slow), list-scheduled
again, then ops on the critical path moved earlier in their program; it spends
at most `polish_work(time_limit)` counted units of work.

It uses the instance's own options (decoupled B/W, staggered optimizer) and
never puts more microbatches in flight on a GPU than its memory holds.
Deterministic: the candidates are tried in a fixed order, ties keep the
first, and the local search counts its work. A plan whose time reaches the
proven lower bound (`cpsat_bound.period_lower_bound`) ends the search: no
plan can be faster.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from schedc.instance import Instance
from schedc.opgraph import compute_kinds
from schedc.schedule import OpId, Schedule, SolverInfo
from schedc.simulate_engine import ProgramGraph, encode, keep_graph
from schedc.symmetry import part_instance
from schedc.solvers import SolveOptions
from schedc.solvers.assign import Executor, balanced, completion_counts, microbatch_key, round_robin
from schedc.solvers.common import (barrier_instance, check_memory, check_stages_live, decoupled_programs,
                            fits_in_flight)
from schedc.solvers.cpsat_bound import period_lower_bound
from schedc.solvers.improve import Start, evaluation_cost, executor_of, improve
from schedc.solvers.listsched import Policy, list_schedule
from schedc.solvers.one_f_one_b import template_programs
from schedc.solvers.reroute import reroute_programs
from schedc.solvers.static_programs import ZB_H2_VARIANTS, split_styles

NAME = "greedy"

ONE_F_ONE_B = Policy(name="1f1b", kinds=("W", "B", "F"))
ZERO_BUBBLE = Policy(name="zb", kinds=("B", "F", "W"))

Programs = dict[int, list[OpId]]
#: Op codes per rank and a topological order; None for a candidate whose placement equals an
#: earlier one's (its plans were tried already).
Plan = "tuple[dict[int, list[int]], list[int] | None] | None"


def _caps(instance: Instance, executor: Executor, mode: str) -> list[int]:
    """Per rank in-flight limit: memory, and for "1f1b" also S - s per pipeline served."""
    M = instance.microbatches
    load = [0] * len(instance.gpus)
    for row in executor:
        for r in row:
            load[r] += 1
    caps = []
    for g in instance.gpus:
        if not g.live:
            caps.append(0)
            continue
        cap = fits_in_flight(instance, g.rank)
        if mode == "1f1b":
            cap = min(cap, (instance.pp - g.pp) * max(1, -(-load[g.rank] // M)))
        caps.append(max(cap, 1))
    return caps


#: Iterations the steady candidates play (their last one's programs are kept). On six of the
#: bench's failure scenarios the third and fourth iterations' programs ran as fast as the second's.
STEADY_ROUNDS = 2


def one_pipeline(instance: Instance) -> Instance:
    """Pipeline 0 of `instance` alone, every GPU live at full speed: where every pipeline runs
    the same template, each one's timing (and the period) is this pipeline's."""
    return part_instance(instance, (0,)).without_failures()


def best_split_style(instance: Instance) -> str:
    """The split ZB-H2 shape (`static_programs.split_styles`) with the shortest steady iteration on
    `one_pipeline(instance)`; ties keep the first. A screen: a handful of small graphs at any
    size of cluster, after which only the chosen shape is built for every pipeline."""
    single = one_pipeline(instance)
    best: tuple[int, str] | None = None
    for style in split_styles(instance.pp):
        period = ProgramGraph(single, encode(single, template_programs(single, style))).period()
        if best is None or period < best[0]:
            best = (period, style)
    assert best is not None
    return best[1]


def candidates(instance: Instance) -> Iterator[tuple[str, Callable[[], Plan]]]:
    """(name, build) for each candidate plan, in the fixed order they are tried."""
    inst = instance
    if not inst.failed_gpus:
        yield "template 1f1b", lambda: (encode(inst, template_programs(inst, "1f1b")), None)
        if inst.decouple_backward:
            yield "template zb-h1", lambda: (encode(inst, template_programs(inst, "zb-h1")), None)
            for style in ZB_H2_VARIANTS:
                yield f"template {style}", lambda style=style: (
                    encode(inst, template_programs(inst, style)), None)
    else:
        def rerouted() -> Plan:
            progs, _ = reroute_programs(barrier_instance(inst))
            return encode(inst, decoupled_programs(progs) if inst.decouple_backward else progs), None
        yield "reroute-1f1b", rerouted
    tables = {"balanced": lambda: balanced(inst, "spread"),
              "balanced-tail": lambda: balanced(inst, "first"),
              "round-robin": lambda: round_robin(inst)}
    if inst.slow_gpus:  # (without slow GPUs these equal `balanced`)
        tables["balanced-late"] = lambda: balanced(inst, "last")  # slow GPUs start late
        tables["completion"] = lambda: balanced(inst, "spread", completion_counts)  # O counted
        tables["completion-late"] = lambda: balanced(inst, "last", completion_counts)
    made: dict[str, Executor | None] = {}

    def placement(name: str) -> Executor | None:
        """The table, made when first needed (under a deadline most are never needed); None if
        it equals one made before (in the fixed order candidates are tried)."""
        if name not in made:
            ex = tables[name]()
            made[name] = None if any(ex == other for other in made.values() if other is not None) else ex
        return made[name]

    key = microbatch_key(inst)
    policies = [ONE_F_ONE_B, ZERO_BUBBLE] if inst.decouple_backward else [ONE_F_ONE_B]
    # `completion` only wins played in the steady state (on the bench it never won from an
    # empty pipeline): it is left out of the one-iteration candidates, which cost as much.
    for pname in (t for t in tables if t != "completion"):
        for policy in policies:
            for cap_mode in ("1f1b", "memory"):
                def build(pname=pname, policy=policy, cap_mode=cap_mode) -> Plan:
                    ex = placement(pname)
                    if ex is None:
                        return None
                    res = list_schedule(inst, ex, key, _caps(inst, ex, cap_mode), policy)
                    return res.codes, res.order
                yield f"{pname}/{policy.name}/{cap_mode}-cap", build
    # The same placements played in the steady state: the list scheduler runs two iterations
    # (each GPU's O and its barrier between them) and keeps the second's programs, whose
    # choices saw the next iteration's forwards arrive while this one drains (docs/baselines.md).
    steady_policy = policies[-1]
    for pname in tables:
        def build_steady(pname=pname) -> Plan:
            ex = placement(pname)
            if ex is None:
                return None
            res = list_schedule(inst, ex, key, _caps(inst, ex, "memory"), steady_policy,
                                iterations=STEADY_ROUNDS)
            return res.rounds[-1]
        yield f"{pname}/{steady_policy.name}/memory-cap/steady", build_steady
    if not inst.failed_gpus and inst.decouple_backward:
        # Last: screening the split shapes times (S + 1) x 4 one-pipeline programs, several
        # times one candidate's cost, which under a deadline would crowd the others out.
        yield "template zb-h2/split", lambda: (
            encode(inst, template_programs(inst, best_split_style(inst))), None)


def relative_cost(instance: Instance, name: str) -> float:
    """What a candidate costs relative to one list-scheduled iteration of the instance, so that
    under a deadline the slowest candidate so far predicts the next one: a steady candidate
    plays `STEADY_ROUNDS` iterations, the split ZB-H2 shape first times every
    `static_programs.split_styles` shape on one pipeline (one pipeline's graph costs about 1 / dp
    of the cluster's)."""
    if name.endswith("/steady"):
        return float(STEADY_ROUNDS)
    if name == "template zb-h2/split":
        return 1.0 + len(split_styles(instance.pp)) / instance.dp
    return 1.0


#: Above this many compute ops (e.g. 4096 GPUs), trying every candidate costs seconds each, so
#: only the seed and the candidate that won every measured instance are tried
#: (docs/baselines.md). A rule on size, not on the clock, so the result stays deterministic.
LARGE_OPS = 100_000
LARGE_CANDIDATES = ("balanced/zb/memory-cap", "balanced/1f1b/memory-cap")


def _in_order_of_promise(instance: Instance) -> list[tuple[str, Callable[[], Plan]]]:
    """The candidates to try, the usual winner first and the seed second.

    Under a tight deadline only the first one or two run, so the usual winner
    (`LARGE_CANDIDATES`, ~1.01-1.03x the lower bound where the seed is often
    1.5x) goes first; the seed (templates or `reroute-1f1b`) second keeps the
    "never worse than" guarantees whenever two candidates fit. Above
    `LARGE_OPS`, only these two are tried.
    """
    wanted = LARGE_CANDIDATES[0] if instance.decouple_backward else LARGE_CANDIDATES[1]
    listed = list(candidates(instance))
    first = [c for c in listed if c[0] == wanted]
    ordered = first + [c for c in listed if c[0] != wanted]
    return ordered[:2] if _large(instance) else ordered


def _large(instance: Instance) -> bool:
    """Above `LARGE_OPS` compute ops: two candidates only, and no local search."""
    return instance.dp * instance.pp * instance.microbatches * len(compute_kinds(instance)) > LARGE_OPS


#: Work units (`improve.evaluation_cost`) per second of work budget: the calibration that
#: makes `time_limit` of local search take about `time_limit` of wall on 2 idle cores (a unit
#: took 1.5-1.9 us on 4 x 4 x 8 to 8 x 8 x 32 clusters, 1.9-2.7 us of CPU on 2 x 5 clusters with
#: a failed GPU and one-pipeline grid specs, up to 5 us on a 1 x 8 x 32 grid spec). Too high
#: and a compile overruns its time limit, too low and the search stops early. Re-measure: time
#: `improve.improve(..., work=W)` on those shapes and divide by W, and
#: `python bench/compile_budget.py`.
UNITS_PER_S = 400_000


def polish_work(time_limit: float) -> float:
    """Work units the local search around the best candidate (`solvers.improve`) may spend:
    `time_limit` (a work budget, calibrated seconds: `UNITS_PER_S`) of them, counted, not timed."""
    return time_limit * UNITS_PER_S


def _is_template(name: str) -> bool:
    """Whether candidate `name` is a fixed construction (a template or re-routing), not a
    placement list-scheduled by a rule."""
    return name.startswith("template ") or name == "reroute-1f1b"


def _rounds(name: str) -> int:
    """Iterations the candidate `name` was list-scheduled over."""
    return STEADY_ROUNDS if name.endswith("/steady") else 1


def _rescheduler(instance: Instance, name: str) -> Callable[[Executor], tuple[dict[int, list[int]], list[int]]]:
    """List-schedule a placement the way candidate `name` was (its rule, in-flight limit and
    iterations); templates and re-routing use the steady candidates' rule with the memory limit."""
    policies = {p.name: p for p in (ONE_F_ONE_B, ZERO_BUBBLE)}
    if _is_template(name):
        policy, cap_mode = (ZERO_BUBBLE if instance.decouple_backward else ONE_F_ONE_B), "memory"
    else:
        _, rule, cap = name.split("/")[:3]
        policy, cap_mode = policies[rule], cap.removesuffix("-cap")
    rounds = _rounds(name)
    key = microbatch_key(instance)

    def reschedule(ex: Executor) -> tuple[dict[int, list[int]], list[int]]:
        res = list_schedule(instance, ex, key, _caps(instance, ex, cap_mode), policy, iterations=rounds)
        return res.rounds[-1] if rounds > 1 else (res.codes, res.order)
    return reschedule


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """The best of greedy's candidate plans (`solve_counted`, without the count)."""
    return solve_counted(instance, options)[0]


def solve_counted(instance: Instance, options: SolveOptions) -> tuple[Schedule, float, float]:
    """(plan, work spent in calibrated seconds: `UNITS_PER_S`, wall seconds the slowest
    candidate took per iteration it played: what a caller under a deadline can expect another
    plan of this size to cost to build and time): the best of greedy's candidate
    plans; E315 if a stage has no live GPU, E310 if one microbatch does not fit on some GPU.

    Candidates are tried in a fixed order (`_in_order_of_promise`) until one reaches the
    proven lower bound or the list ends: a counted amount of work, so the plan does not
    depend on the machine or its load. Only `options.deadline` (a launcher's replan) cuts
    the list short: the first candidate always runs, later ones only if they can finish by
    then (judged by the slowest so far, per unit of `relative_cost`), and the plan then
    records `stopped_by="deadline"`.
    Ties keep the earlier candidate. Unless the best is optimal or the deadline already
    skipped a candidate, the local search (`solvers.improve`) then starts from each distinct
    list-scheduled placement, fastest first, and from the best plan's order, within
    `polish_work(options.time_limit)` units (and the deadline, which it then records too).
    The work spent counts each candidate and each evaluation of the local search
    (`improve.evaluation_cost`), so it is the same on any machine: `cpsat` gives CP-SAT what the
    seed left of the budget.
    """
    started = time.perf_counter()
    check_stages_live(instance, solver=NAME)
    check_memory(instance, solver=NAME)
    bound = period_lower_bound(instance)
    best: tuple[int, str, ProgramGraph] | None = None
    listed: dict[tuple, tuple[int, str, ProgramGraph]] = {}  # placement -> its fastest candidate
    timed: list[tuple[int, str, ProgramGraph]] = []  # list-scheduled candidates, in order tried
    tried = 0
    deadline = options.deadline
    skipped = 0
    slowest = 0.0  # seconds per unit of `relative_cost` of the slowest candidate so far
    seen: set[tuple] = set()  # programs already timed (templates and rules often coincide)
    units = 0  # work spent, counted (`improve.evaluation_cost`)
    search = not _large(instance)  # the local search may follow the candidates
    for name, build in _in_order_of_promise(instance):
        if best is not None and best[0] <= bound:
            break  # optimal: no later candidate can be faster
        cost = relative_cost(instance, name)
        if best is not None and deadline is not None and time.monotonic() + slowest * cost > deadline:
            skipped += 1
            continue
        began = time.perf_counter()
        plan = build()
        if plan is None:
            continue  # a placement equal to an earlier one: its plans were tried
        codes, order = plan
        programs = tuple(tuple(codes[r]) for r in sorted(codes))
        if programs in seen:
            continue  # the same plan as an earlier candidate: the same time, and ties keep the earlier
        seen.add(programs)
        graph = ProgramGraph(instance, codes, order)
        period = graph.period()
        slowest = max(slowest, (time.perf_counter() - began) / cost)
        tried += 1
        units += evaluation_cost(instance, _rounds(name))
        if best is None or period < best[0]:
            best = (period, name, graph)
        if not _is_template(name) and search:
            timed.append((period, name, graph))
    assert best is not None  # candidates() always yields at least one plan
    period, name, graph = best
    polished = ""
    cut = bool(skipped)
    if period > bound and not cut and search:
        # The placement of each list-scheduled candidate, read only now that the search runs
        # (a replan that stops after one candidate never needs it).
        for p, n, g in timed:
            placement = tuple(map(tuple, executor_of(instance, g.programs)))
            if placement not in listed or p < listed[placement][0]:
                listed[placement] = (p, n, g)
        # Each placement once (several rules share one), fastest first, ties in candidate order.
        firsts = sorted(listed.values(), key=lambda x: x[0])
        starts = [Start(p, g, _rescheduler(instance, n), _rounds(n)) for p, n, g in firsts]
        # A candidate list-schedules one iteration and times it, as one placement move does:
        # the slowest candidate gives the first guess of seconds per unit.
        better = improve(instance, (period, graph), starts, work=polish_work(options.time_limit),
                         bound=bound, deadline=deadline,
                         seconds_per_unit=slowest / evaluation_cost(instance, 1))
        cut = better.stopped_by == "deadline"
        units += better.spent
        if better.period < period:
            period, graph = better.period, better.graph
            polished = (f"; then {better.placement_moves} placement and {better.order_moves} order "
                        f"moves ({better.evaluations} tried)")
    keep_graph(graph)  # the simulator will run these very programs
    optimal = period <= bound
    # The winner's graph times its one iteration: the same as schedule_from_programs, faster.
    info = SolverInfo(name=NAME, status="optimal" if optimal else "feasible", objective=float(period),
                      bound=float(bound), wall_s=time.perf_counter() - started,
                      detail=f"best of {tried} candidates: {name}{polished} (steady iteration {period} us"
                             + (", the proven lower bound)" if optimal else ")")
                             + (f"; {skipped} more skipped at the deadline" if skipped else ""),
                      stopped_by="deadline" if cut and not optimal else "work")
    return Schedule(instance=instance, ops=graph.scheduled_ops(), solver=info), units / UNITS_PER_S, slowest
