"""CP-SAT planner: re-route, rebalance and order every op under memory limits.

`solve(instance, options)` runs the greedy list scheduler first (a valid plan
in milliseconds), hands its schedule to CP-SAT as a complete hint, and returns
whichever of the two the simulator times faster. The two share the work budget
`options.time_limit` (`SEED_SHARE`, `search_budget`). docs/planner.md explains the
model; in short:

- **Placement.** For each microbatch (d, m) at stage s, one literal per
  candidate executor (`schedc.opgraph.candidate_executors`): a failed GPU's
  work goes to a live peer, a slow GPU's work may move to its peers. F, B and
  W of (d, m, s) share that literal (the activations live on the executor).
- **Time.** One optional interval per op and candidate; `NoOverlap` per GPU;
  dependencies with the boundary transfer; the optimizer after its stage's
  barrier (or the global one without staggering).
- **Memory.** Per GPU a cumulative over variable-size intervals
  [F start, B end) holding `activation - stash` and [F start, W end) holding
  `stash` (without decoupling: [F start, B end) holding `activation`), with
  capacity `gpu_memory - static`.
- **Objective.** The steady-state period P >= (end of O) - (first start) of
  every live GPU: repeating the one-iteration schedule every P is feasible, so
  the simulator's time is at most P. P's domain starts at
  `period_lower_bound`: the largest of `Instance.lower_bound` (work per stage),
  `cpsat_bound.chain_bound` (a pipeline's round trip through its busiest
  stage) and `cpsat_bound.placement_bound` (the busiest GPU once whole
  microbatches are placed), so the search stops when it reaches it and the
  reported bound is not the often loose work bound.

Monolithic models stop paying off beyond a few thousand ops
(measured: presolve alone takes seconds at ~25k ops), so pipelines that no failure touches and that
receive no re-routed work in the seed are fixed to the seed's timing; when even
the remaining model is too large, the greedy plan is returned (`fallback`).
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
import time
from dataclasses import dataclass, replace

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.opgraph import (
    candidate_executors,
    compute_kinds,
    data_deps,
    last_backward_kind,
    optimizer_waits_for,
)
from schedc.schedule import OpId, Schedule, SolverInfo
from schedc.simulate_engine import DeadlockError, ProgramGraph, graph_of, schedule_from_programs
from schedc.solvers import SolveOptions
from schedc.solvers.common import fits_in_flight, fmt_bytes, gpu_name, steady_iteration_time
from schedc.solvers.cpsat_bound import period_lower_bound
from schedc.solvers.sandbox import SolverFailed, solve_contained

NAME = "cpsat"

#: Above this many free compute ops CP-SAT's presolve alone outlasts a budget of a second or
#: two (it takes seconds at ~25k ops) and the seed is returned (`fallback`). Check: the
#: scale points of `schedc bench` (cpsat's status and solve time at 64-4,096 GPUs).
MAX_MODEL_OPS = 2500
#: Rough cost of building the model in Python, per op (seconds); used to skip
#: CP-SAT when the deadline cannot even cover the build.
_BUILD_S_PER_OP = 150e-6
#: OR-Tools' CP-SAT module, and the seconds its import is assumed to cost: under a deadline
#: shorter than this plus `MIN_SEARCH_S` CP-SAT is not imported (0.4-1.2 s when measured).
#: Re-measure: `python -X importtime -c "import ortools.sat.python.cp_model"`.
_CP_MODEL = "ortools.sat.python.cp_model"
_IMPORT_S = 0.8
#: Below this many seconds left, CP-SAT is not started (its start-up alone takes ~0.1 s).
MIN_SEARCH_S = 0.15
#: Share of the remaining wall time CP-SAT is given (see `_solve_model`).
WALL_SHARE = 0.5
#: Calibration of the work budget, so that `time_limit` of work takes about `time_limit` of
#: wall on 2 idle cores: a CP-SAT solve costs a fixed part (forking the solve's process, loading
#: the model, presolve: seconds its deterministic time hardly counts) plus seconds per unit of
#: deterministic time, as (fixed s, s per unit, s per unit per 1,000 model variables). CP-SAT
#: runs one subsolver task at a time (`interleave_batch_size`), so its CPU time is the wall time
#: it would take on an idle machine. Fitted (least mean |log error|) on the 38 solves of
#: `python bench/compile_budget.py --json rows.json` (436-2,105 variables, 0.02-0.92 units):
#: 0.2 s fixed and 2.4-2.8 s per unit; a solve's own cost is 0.5-2x the fit (a model's loading,
#: which nothing counted in advance shows, makes the spread). Re-measure: run that command
#: alone on a quiet machine and fit `cpu_s` of its `solves` against `det_used` and `variables`.
_WALL_MODEL = (0.2, 2.25, 0.25)
#: Share of a compile's work budget greedy's local search may spend on the seed
#: (`greedy.polish_work`); CP-SAT gets what the seed's counted work left (at least
#: `MIN_SEARCH_SHARE`), less the model's build, so that seed and search together cost about
#: `time_limit` (each got all of it before, and a compile took twice its `time_limit` and more).
SEED_SHARE = 0.4
MIN_SEARCH_SHARE = 0.3


def deterministic_budget(time_limit: float, n_variables: int) -> float:
    """CP-SAT's deterministic-time limit for a work budget of `time_limit` seconds on a model of
    `n_variables`: about `time_limit` of wall on 2 quiet cores (`_WALL_MODEL`; a budget below the
    solve's fixed part gets a token 0.01 units), and the same units (so the same plan) on any
    machine under any load."""
    fixed, per_unit, per_k = _WALL_MODEL
    return max(0.01, (time_limit - fixed) / (per_unit + per_k * n_variables / 1000))


# -- feasibility ---------------------------------------------------------------


def check_feasible(instance: Instance) -> None:
    """Raise `InfeasibleError` (E3xx) when no schedule can exist for `instance`.

    E301: a stage has no live GPU (re-routing is impossible; recover from a
    checkpoint). E310: a stage's GPUs cannot hold one microbatch in flight
    next to their static memory. One microbatch in flight always suffices
    otherwise (run microbatches one at a time), so these are the only
    memory-infeasible cases.
    """
    diags = []
    for s in range(instance.pp):
        if not instance.live_gpus(s):
            lost = ", ".join(f"(dp={g.dp}, pp={g.pp})" for g in instance.gpus if g.pp == s)
            diags.append(error(
                "E301", f"stage {s} has no live replica: every GPU that holds it failed ({lost})",
                hint="re-routing needs a live peer of the stage that holds its weights; restore the "
                     "job from the last checkpoint (on replacement GPUs or with fewer pipelines)"))
    for s in range(instance.pp):
        live = instance.live_gpus(s)
        if not live:
            continue
        c = instance.stages[s]
        room = instance.gpu_memory - c.static
        if room >= c.activation:
            continue
        fits = fits_in_flight(instance, live[0].rank)
        need = c.static + c.activation
        where = gpu_name(instance, live[0].rank)
        if len(live) > 1:
            where += f" and the {len(live) - 1} other live GPU{'s' if len(live) > 2 else ''} of stage {s}"
        if room < 0:
            detail = (f"static {fmt_bytes(c.static)} (weights, gradients, optimizer state) alone "
                      f"exceeds gpu.memory {fmt_bytes(instance.gpu_memory)}; one microbatch in flight "
                      f"needs {fmt_bytes(need - instance.gpu_memory)} more")
            hint = (f"raise gpu.memory to at least {fmt_bytes(need)} or move layers off stage {s} "
                    "(more pipeline stages); activation recomputation cannot help here")
        else:
            detail = (f"static {fmt_bytes(c.static)} + one microbatch's activation "
                      f"{fmt_bytes(c.activation)} = {fmt_bytes(need)} > gpu.memory "
                      f"{fmt_bytes(instance.gpu_memory)}; one microbatch in flight needs "
                      f"{fmt_bytes(need - instance.gpu_memory)} more")
            hint = (f"raise gpu.memory to at least {fmt_bytes(need)}, shrink stage {s}'s activation "
                    "(activation recomputation, a smaller microbatch_size) or move layers off stage "
                    f"{s} (more pipeline stages); fewer microbatches in flight cannot help: "
                    "schedules already run with one")
        diags.append(error(
            "E310",
            f"stage {s} does not fit in memory: {where} can hold {fits} microbatches in flight, "
            f"a schedule needs at least 1", detail=detail, hint=hint))
    if diags:
        raise InfeasibleError(diags)


# -- timing --------------------------------------------------------------------


def iteration_time(schedule: Schedule) -> int:
    """Steady-state period of a schedule's programs, as the simulator measures it."""
    graph = graph_of(schedule)
    if graph is not None:  # a planner's schedule: its graph is the programs' (and may have run)
        return graph.period()
    programs = {r: [op.id for op in ops] for r, ops in schedule.programs.items()}
    return steady_iteration_time(schedule.instance, programs)


def span_bound(schedule: Schedule) -> int:
    """The largest per-GPU span (last end - first start): a period the schedule can repeat at."""
    graph = graph_of(schedule)
    if graph is not None:  # a planner's schedule: each rank's span without a pass over every op
        end, _ = graph.run(1)
        o0 = graph.o0
        return max((end[o0 + r] - s for r, s in graph.first_starts().items()), default=0)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for op in schedule.ops:
        first[op.rank] = min(first.get(op.rank, op.start), op.start)
        last[op.rank] = max(last.get(op.rank, op.end), op.end)
    return max((last[r] - first[r] for r in first), default=0)


def retime(instance: Instance, schedule: Schedule, info: SolverInfo) -> Schedule | None:
    """The programs of `schedule` (possibly made for another instance) timed on `instance`.

    Returns None when they do not fit it: an executor that is no longer live,
    an op that is missing or does not exist, an optimizer step that is not its
    program's last op, a deadlock, or a GPU over its memory.

    The ops are checked and encoded in one pass (no `OpId` per op, the executors allowed
    per (pipeline, stage) looked up once), and the graph that times them also gives their
    memory peaks: a replan under a deadline re-times the previous plan at about the cost of
    one greedy candidate (`_RETIME_COST`).
    """
    inst = instance
    live = {g.rank for g in inst.live_gpus()}
    if inst.redundant_forward or any(op.rank not in live for op in schedule.ops):
        return None  # (before sorting any program: after a failure, the usual case)
    D, S, M = inst.dp, inst.pp, inst.microbatches
    kind_code = {k: i for i, k in enumerate(compute_kinds(inst))}
    allowed: dict[tuple[int, int], tuple[int, ...]] = {}
    codes: dict[int, list[int]] = {}
    n_ops = 0
    for r, ops in schedule.programs.items():
        if r not in live:
            continue  # (a GPU with no ops at all: one with ops returned None above)
        g = inst.gpu_of_rank(r)
        prog: list[int] = []
        for step, op in enumerate(ops):
            if op.pp != g.pp:
                return None
            if op.kind == "O":
                if op.dp != g.dp or step != len(ops) - 1:
                    return None
                continue
            k = kind_code.get(op.kind)
            if k is None or op.mb is None or not (0 <= op.dp < D and 0 <= op.mb < M):
                return None
            key = (op.dp, op.pp)
            ranks = allowed.get(key)
            if ranks is None:
                ranks = allowed[key] = candidate_executors(inst, op.dp, op.pp)
            if r not in ranks:
                return None
            prog.append(((op.dp * M + op.mb) * S + op.pp) * 3 + k)
        if not ops or ops[-1].kind != "O":
            return None  # every live GPU steps its optimizer, last
        codes[r] = prog
        n_ops += len(prog)
    # Every compute op once: as many codes as ops, all distinct (each is in range, above).
    if set(codes) != live or n_ops != D * S * M * len(kind_code) or len({c for p in codes.values() for c in p}) != n_ops:
        return None
    try:
        graph = ProgramGraph(inst, codes)
    except DeadlockError:
        return None
    if any(peak > inst.gpu_memory for peak in graph.peaks().values()):
        return None
    return Schedule(instance=inst, ops=graph.scheduled_ops(), solver=info)


# -- the model -----------------------------------------------------------------


@dataclass(frozen=True)
class _Result:
    schedule: Schedule | None
    status: str  # CP-SAT's status name
    objective: float | None
    bound: float | None  # CP-SAT's proven bound, when the model was the whole instance's
    detail: str
    cut_by_deadline: bool = False  # the wall-clock deadline, not the work budget, ended the search


def _free_pipelines(instance: Instance, seed: Schedule, ops_per_pipeline: int) -> set[int]:
    """Pipelines the model keeps free; the others are fixed to the seed's timing.

    Always free: pipelines with a failed or slow GPU, and those whose GPUs run
    re-routed work in the seed (their timing depends on that work). Then, while
    the model stays under `MAX_MODEL_OPS`, the other pipelines that could take
    work from a failed or slow GPU, nearest first, so that CP-SAT may move
    work where the seed did not.
    """
    if instance.fault_free:
        return set(range(instance.dp))
    free = {g.dp for g in instance.gpus if not g.live or g.speed < 1.0}
    graph = graph_of(seed)
    if graph is not None:  # a planner's schedule: its op codes say whose microbatch each op is
        per_dp = 3 * instance.pp * instance.microbatches  # code // per_dp: the op's pipeline
        for r, prog in graph.programs.items():
            own = instance.gpu_of_rank(r).dp
            others = {c // per_dp for c in prog} - {own}
            if others:
                free.add(own)
                free |= others
    else:
        for op in seed.ops:
            if op.kind != "O" and op.rank != instance.gpu(op.dp, op.pp).rank:
                free.add(op.dp)
                free.add(instance.gpu_of_rank(op.rank).dp)
    affected = sorted({g.dp for g in instance.gpus if not g.live or g.speed < 1.0})
    extra = sorted((min(abs(d - a) for a in affected), d) for d in range(instance.dp) if d not in free)
    for _, d in extra:
        if (len(free) + 1) * ops_per_pipeline > MAX_MODEL_OPS:
            break
        free.add(d)
    return free


def _forward_order_cuts(inst: Instance, seed: Schedule, free: set[int]) -> list[tuple[OpId, OpId]]:
    """Symmetry cuts: pairs (F of microbatch m, F of m + 1) at one stage whose order the model
    fixes. The microbatches of a pipeline whose every stage has one executor are interchangeable
    (relabelling them keeps every schedule's times), so their forward order may be fixed at each
    stage, here wherever the seed agrees (a hint the model forbids would be lost). Not for
    pipelines whose work may move: a microbatch re-routed to a faster GPU may overtake, and the
    model's bound must stay a bound on every schedule (`_Result.bound`)."""
    seed_start = {op.id: op.start for op in seed.ops if op.kind == "F"}
    cuts = []
    for d in sorted(free):
        if any(len(candidate_executors(inst, d, t)) > 1 for t in range(inst.pp)):
            continue
        for s in range(inst.pp):
            for mb in range(inst.microbatches - 1):
                a, b = OpId("F", d, s, mb), OpId("F", d, s, mb + 1)
                if seed_start[a] <= seed_start[b]:
                    cuts.append((a, b))
    return cuts


def _solve_model(instance: Instance, seed: Schedule, free: set[int], options: SolveOptions,
                 wall_left: float | None, lb: int) -> _Result:
    """Build and solve the model, pipelines outside `free` fixed to `seed`, the period at least
    `lb` (`period_lower_bound`). CP-SAT ends on its deterministic limit (from
    `options.time_limit`), or at `options.deadline` when there is one (`wall_left`: seconds of it
    left for the search)."""
    from ortools.sat.python import cp_model

    inst = instance
    kinds = compute_kinds(inst)
    lastk = last_backward_kind(inst)
    seed_ops = {op.id: op for op in seed.ops}
    # Every schedule with a period P has a shift inside [0, 3P]: take a GPU that starts first
    # (at 0); its stage's ops all end by P, every B below it (which precedes them) and every F
    # above it too, and each GPU's ops lie within P of such an op. So no plan at least as fast
    # as the seed is cut off, and the model's bound stays a bound. The last microsecond is
    # kept free of ops (the makespan intervals below).
    horizon = max(seed.makespan, 3 * span_bound(seed)) + 1
    m = cp_model.CpModel()

    start: dict[OpId, object] = {}
    end: dict[OpId, object] = {}
    hint: dict[object, int] = {}
    on_rank: dict[int, list[tuple[object, object | None]]] = {}  # rank -> (start var/const, literal)
    intervals: dict[int, list[object]] = {}
    mem: dict[int, tuple[list[object], list[int]]] = {}
    fixed_end: dict[OpId, int] = {}  # ops of frozen pipelines
    choice: dict[tuple[int, int, int], dict[int, object]] = {}  # (d, s, mb) -> rank -> literal

    def var(name: str, value: int, lo: int = 0, hi: int = horizon):
        v = m.NewIntVar(lo, hi, name)
        hint[v] = value
        return v

    for s in range(inst.pp):
        c = inst.stages[s]
        for d in range(inst.dp):
            if d not in free:
                for mb in range(inst.microbatches):
                    for k in kinds:
                        op = seed_ops[OpId(k, d, s, mb)]
                        intervals.setdefault(op.rank, []).append(
                            m.NewIntervalVar(op.start, op.duration, op.end, ""))
                        fixed_end[op.id] = op.end
                        on_rank.setdefault(op.rank, []).append((op.start, None))
                continue
            # Only GPUs of free pipelines may take work: a frozen GPU's timing and memory are fixed.
            cands = [r for r in candidate_executors(inst, d, s) if inst.gpu_of_rank(r).dp in free]
            for mb in range(inst.microbatches):
                chosen = seed_ops[OpId("F", d, s, mb)].rank
                lits = {}
                for r in cands:
                    if len(cands) == 1:
                        lits[r] = None
                    else:
                        lit = m.NewBoolVar(f"x{d}_{s}_{mb}_{r}")
                        hint[lit] = int(r == chosen)
                        lits[r] = lit
                if len(cands) > 1:
                    m.AddExactlyOne(lits.values())
                choice[(d, s, mb)] = lits
                for k in kinds:
                    op = OpId(k, d, s, mb)
                    sop = seed_ops[op]
                    st, en = var(f"s{op}", sop.start), var(f"e{op}", sop.end)
                    start[op], end[op] = st, en
                    for r, lit in lits.items():
                        dur = inst.duration(k, s, r)
                        if lit is None:
                            iv = m.NewIntervalVar(st, dur, en, "")
                        else:
                            iv = m.NewOptionalIntervalVar(st, dur, en, lit, "")
                        intervals.setdefault(r, []).append(iv)
                        if k == "F":
                            on_rank.setdefault(r, []).append((st, lit))
                # Memory held on the executor while the microbatch is in flight.
                f_s, f_e = start[OpId("F", d, s, mb)], None
                holds = ([("B", c.activation - c.stash), ("W", c.stash)] if inst.decouple_backward
                         else [("B", c.activation)])
                for k, demand in holds:
                    if demand <= 0:
                        continue
                    f_e = end[OpId(k, d, s, mb)]
                    size = var(f"m{k}{d}_{s}_{mb}", seed_ops[OpId(k, d, s, mb)].end
                               - seed_ops[OpId("F", d, s, mb)].start)
                    for r, lit in lits.items():
                        if lit is None:
                            iv = m.NewIntervalVar(f_s, size, f_e, "")
                        else:
                            iv = m.NewOptionalIntervalVar(f_s, size, f_e, lit, "")
                        mem.setdefault(r, ([], []))
                        mem[r][0].append(iv)
                        mem[r][1].append(demand)

    # Dependencies (a frozen predecessor is a constant).
    for op, st in start.items():
        if op.kind == "O":
            continue
        for dep in data_deps(inst, op):
            if dep.op in end:
                m.Add(st >= end[dep.op] + dep.delay)
            else:
                m.Add(st >= fixed_end[dep.op] + dep.delay)

    for a, b in _forward_order_cuts(inst, seed, free):
        m.Add(start[a] <= start[b])

    # Optimizer barriers and O per live GPU.
    barriers: dict[tuple[int, ...], object] = {}
    for group in sorted({optimizer_waits_for(inst, s) for s in range(inst.pp)}):
        ends_seed = [seed_ops[OpId(lastk, d, s, mb)].end for s in group for d in range(inst.dp)
                     for mb in range(inst.microbatches)]
        bar = var(f"bar{group}", max(ends_seed, default=0))
        for s in group:
            for d in range(inst.dp):
                for mb in range(inst.microbatches):
                    op = OpId(lastk, d, s, mb)
                    m.Add(bar >= (end[op] if op in end else fixed_end[op]))
        barriers[group] = bar

    seed_p = span_bound(seed)
    period = m.NewIntVar(min(lb, seed_p), seed_p, "P")
    hint[period] = seed_p
    seed_first: dict[int, int] = {}
    for op in seed.ops:
        seed_first[op.rank] = min(seed_first.get(op.rank, op.start), op.start)
    for g in inst.live_gpus():
        r = g.rank
        o = OpId("O", g.dp, g.pp)
        so = seed_ops[o]
        dur = inst.duration("O", g.pp, r)
        o_s, o_e = var(f"s{o}", so.start), var(f"e{o}", so.end)
        m.Add(o_s >= barriers[optimizer_waits_for(inst, g.pp)])
        intervals.setdefault(r, []).append(m.NewIntervalVar(o_s, dur, o_e, ""))
        first = var(f"a{r}", seed_first[r])
        m.Add(first <= o_s)
        for st, lit in on_rank.get(r, []):
            if lit is None:
                m.Add(first <= st)
            else:
                m.Add(first <= st).OnlyEnforceIf(lit)
        m.Add(period >= o_e - first)
    # Each GPU's NoOverlap and cumulative gets a full-capacity interval at [horizon - 1, horizon):
    # CP-SAT takes it for a makespan and skips searching the precedence graph for one, which
    # with these models' chains of dependencies took up to 15 s of wall while counting 0.2
    # deterministic units, so a 1 s compile took 16 s (bench: gpt3-1.3b-8x4x16-2-slow-s0; now
    # 1.6 s, the same plans on the whole bench and grid). It excludes no plan worth having:
    # one at least as fast as the seed fits in [0, horizon - 1] (above).
    for r, ivs in intervals.items():
        if len(ivs) > 1:
            m.AddNoOverlap(ivs + [m.NewIntervalVar(horizon - 1, 1, horizon, "")])
    for r, (ivs, demands) in mem.items():
        cap = inst.gpu_memory - inst.stages[inst.gpu_of_rank(r).pp].static
        # Frozen pipelines' memory use is unchanged from the seed, which respected the limit,
        # and their GPUs run no free work (else they would be touched), so only free GPUs count.
        if sum(demands) > cap:
            m.AddCumulative(ivs + [m.NewIntervalVar(horizon - 1, 1, horizon, "")], demands + [cap], cap)
    m.Minimize(period)
    for v, val in hint.items():
        m.AddHint(v, val)

    deadline = options.deadline
    wall = None if deadline is None else min(wall_left, deadline - time.monotonic() - 0.01)
    if wall is not None and wall < MIN_SEARCH_S:
        return _Result(None, "SKIPPED", None, None, "CP-SAT skipped: building the model took the time "
                       "left before the deadline", cut_by_deadline=True)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = max(1, options.workers)
    # CP-SAT's own SIGINT handler would swallow Ctrl-C during a solve and stay installed after
    # it, so that a later Ctrl-C kills the process with no KeyboardInterrupt (no cleanup): the
    # caller's signal handling stays the caller's (`sandbox.solve_contained`).
    p.catch_sigint_signal = False
    p.random_seed = options.seed
    p.symmetry_level = 0
    p.cp_model_probing_level = 0
    # The deterministic limit ends the search the same way on every run, on any machine under
    # any load: the work budget (`SolveOptions`).
    p.max_deterministic_time = deterministic_budget(options.time_limit, len(m.Proto().variables))
    p.interleave_search = True  # with a deterministic limit: the same plan on every run
    # The limit is checked between batches of subsolver tasks; batches of one keep the overshoot
    # small (measured: 2.4 units used of a 0.4 limit at the default, 0.400 with 1).
    p.interleave_batch_size = 1
    stop_at = None
    if wall is not None:
        # CP-SAT overshoots its wall limit (presolve and loading are not interrupted at once;
        # by up to ~0.25 s under load when measured), so it gets a share of what is left, and it
        # is stopped when the deadline comes, whatever CP-SAT's own clock says (and killed just
        # after, if it does not stop: `sandbox.KILL_AFTER_S`).
        # Check: `python bench/replan_latency.py --deadlines 0.1`, max within the deadline.
        p.max_time_in_seconds = max(0.01, WALL_SHARE * wall - 0.05)
        stop_at = deadline - 0.15
    try:
        # In a child process: an OR-Tools abort must not end the caller (a launcher's
        # supervisor replans in its own process); greedy's plan is kept instead.
        solved = solve_contained(solver, m, stop_at)
    except SolverFailed as e:
        return _Result(None, "FAILED", None, None, str(e), cut_by_deadline=e.at_deadline)
    name = solved.status_name
    cut = (wall is not None and solved.status != cp_model.OPTIMAL
           and solved.deterministic_time < 0.999 * p.max_deterministic_time)
    if solved.status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Result(None, name, None, None, f"CP-SAT: {name}" + (" at the deadline" if cut else ""),
                       cut_by_deadline=cut)
    objective = solved.objective_value
    # With pipelines fixed to the seed the model is a restriction, and its bound bounds only it.
    bound = solved.best_objective_bound if len(free) == inst.dp else None

    programs: dict[int, list[tuple[int, int, OpId]]] = {g.rank: [] for g in inst.live_gpus()}
    for s in range(inst.pp):
        for d in range(inst.dp):
            for mb in range(inst.microbatches):
                if d not in free:
                    for k in kinds:
                        op = seed_ops[OpId(k, d, s, mb)]
                        programs[op.rank].append((op.start, op.end, op.id))
                    continue
                lits = choice[(d, s, mb)]
                rank = next(r for r, lit in lits.items() if lit is None or solved.boolean_value(lit))
                for k in kinds:
                    op = OpId(k, d, s, mb)
                    programs[rank].append((solved.value(start[op]), solved.value(end[op]), op))
    for g in inst.live_gpus():
        o = OpId("O", g.dp, g.pp)
        programs[g.rank].append((1 << 62, 1 << 62, o))  # O closes each program
    ordered = {r: [op for _, _, op in sorted(v)] for r, v in programs.items()}
    sched = schedule_from_programs(inst, ordered, SolverInfo(name=NAME))
    detail = f"CP-SAT {name.lower()}"
    if cut:
        detail += (f", stopped by the deadline after {solved.deterministic_time:.3f} of "
                   f"{p.max_deterministic_time:.3f} deterministic units")
    return _Result(sched, name, objective, bound, detail, cut_by_deadline=cut)


def warm_up() -> None:
    """Load OR-Tools now (0.3-1 s), so that the first `solve`/`replan` under a deadline can use CP-SAT.

    A launcher calls this once at start-up, before the first failure arrives.
    """
    importlib.import_module(_CP_MODEL)


def warm_up_in_background() -> threading.Thread:
    """`warm_up` on a daemon thread, so that a launcher's start-up does not wait for it. A replan
    that comes while the import is still under way does not wait for it either: it plans as if
    OR-Tools were not loaded (`loaded`)."""
    thread = threading.Thread(target=warm_up, name="schedc-ortools-warm-up", daemon=True)
    thread.start()
    return thread


def loaded() -> bool:
    """Whether OR-Tools' CP-SAT module is imported completely. A module that another thread is
    still importing is in `sys.modules` already; using it then would wait on that import."""
    module = sys.modules.get(_CP_MODEL)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


# -- the solver ----------------------------------------------------------------


#: What re-timing the previous plan (`retime`, then its steady-state time) costs in greedy
#: candidates of the same instance: 1.06 at 32 and 64 GPUs when set (a slowdown, the `slow 0.6`
#: rows of `python bench/replan_latency.py`); the margin keeps a replan that has time for one
#: candidate only from starting it (re-measure: time `retime` and `iteration_time` against
#: the third value of greedy's `solve_counted` under a deadline that allows one candidate).
_RETIME_COST = 1.5


def _seeds(instance: Instance, options: SolveOptions) -> tuple[list[Schedule], bool, float]:
    """(seeds, whether the deadline left one out or cut greedy's list short, the work greedy
    spent in calibrated seconds: `greedy.solve_counted`). Greedy's local search gets
    `SEED_SHARE` of the work budget."""
    from schedc.solvers.greedy import solve_counted

    # greedy first: it always returns a plan, and its first candidate is a good one, so a
    # tight deadline still gets a good plan. The previous plan (re-timed on the new
    # instance) is tried only if time is left; it comes first in the list so that it wins
    # ties (a launcher would rather keep its plan than switch to an equally fast one).
    first, spent, candidate_s = solve_counted(instance, replace(options, time_limit=options.time_limit * SEED_SHARE))
    seeds = [first]
    cut = first.solver.stopped_by == "deadline"
    if options.hint is not None:
        # Re-timing the previous plan builds and runs its graph and makes its ops, as a greedy
        # candidate does, and then times its steady state: `_RETIME_COST` candidates.
        if (options.deadline is not None
                and time.monotonic() + _RETIME_COST * candidate_s >= options.deadline):
            cut = True
        else:
            warm = retime(instance, options.hint, SolverInfo(name=NAME, detail="warm start"))
            if warm is not None:
                seeds.insert(0, warm)
    return seeds, cut, spent


def search_budget(time_limit: float, seed_spent: float, free_ops: int) -> float:
    """CP-SAT's share of a work budget of `time_limit`: what the seed's counted work
    (`seed_spent`) left, at least `MIN_SEARCH_SHARE` of it, less the model's estimated build
    (`_BUILD_S_PER_OP` per free op). A function of counted quantities only (deterministic)."""
    left = max(time_limit * MIN_SEARCH_SHARE, time_limit - seed_spent)
    return max(0.0, left - _BUILD_S_PER_OP * free_ops)


def _seed_time(seed: Schedule) -> int:
    """A seed's simulated iteration time; greedy's objective already is exactly that."""
    if seed.solver.name == "greedy" and seed.solver.objective is not None:
        return int(seed.solver.objective)
    return iteration_time(seed)


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """Plan `instance`: greedy first, then CP-SAT warm-started from it, within `options.time_limit`
    of work for both (greedy's local search gets `SEED_SHARE` of it, CP-SAT what greedy's counted
    work left: `search_budget`).

    Returns the faster (by simulated iteration time) of the seed (greedy, or
    `options.hint` re-timed when it still fits the instance) and CP-SAT's plan.
    `SolverInfo.status` is `optimal` when the returned plan's time equals a
    proven bound, `feasible` when CP-SAT's plan won without proof, and
    `fallback` when the seed is returned. `objective` is the period CP-SAT
    (or the seed) guarantees (the largest per-GPU span), `bound` the proven
    lower bound on it. Raises `InfeasibleError` (E3xx) when no schedule exists.
    Deterministic: every search ends on a work budget (`options.time_limit` as CP-SAT's
    deterministic time, greedy's counted candidates), never on the clock, unless
    `options.deadline` is set; a plan the deadline decided has `stopped_by="deadline"`.
    """
    t0 = time.monotonic()
    deadline = options.deadline
    check_feasible(instance)
    seeds, seeds_cut, seed_spent = _seeds(instance, options)
    lb = period_lower_bound(instance)

    def finish(schedule: Schedule, status: str, objective, bound, detail: str, cut: bool = False) -> Schedule:
        stopped = "deadline" if (cut or seeds_cut) and status != "optimal" else "work"
        return replace(schedule, solver=SolverInfo(
            name=NAME, status=status, objective=objective, bound=bound,
            wall_s=time.monotonic() - t0, detail=detail, stopped_by=stopped))

    per_pipeline = instance.pp * instance.microbatches * len(compute_kinds(instance))
    # Greedy's time is its objective (no simulation, which takes seconds at thousands of
    # GPUs); only a previous plan re-timed on the new instance is simulated here.
    scored = sorted(((_seed_time(s), i, s) for i, s in enumerate(seeds)), key=lambda x: x[:2])
    best_time, _, best = scored[0]
    seed_name = "previous plan" if best.solver.detail == "warm start" else best.solver.name

    if best_time <= lb:
        return finish(best, "optimal", float(best_time), float(lb), f"{seed_name} reaches the lower bound")
    free = _free_pipelines(instance, best, per_pipeline)
    n_free = len(free) * per_pipeline
    if n_free > MAX_MODEL_OPS:
        return finish(best, "fallback", float(span_bound(best)), float(lb),
                      f"{seed_name}: {n_free} free ops exceed the CP-SAT model's limit {MAX_MODEL_OPS}")
    wall_left = None
    if deadline is not None:
        # Leave room after the search for re-timing and simulating CP-SAT's plan.
        wall_left = deadline - time.monotonic() - _BUILD_S_PER_OP * n_free * 2
        if wall_left < MIN_SEARCH_S:
            return finish(best, "fallback", float(span_bound(best)), float(lb),
                          f"{seed_name}: no time left for CP-SAT before the deadline", cut=True)
        if not loaded() and wall_left < _IMPORT_S + MIN_SEARCH_S:
            return finish(best, "fallback", float(span_bound(best)), float(lb),
                          f"{seed_name}: no time to load OR-Tools before the deadline (call "
                          "schedc.solvers.cpsat.warm_up() at start-up)", cut=True)
    work = search_budget(options.time_limit, seed_spent, n_free)
    if work <= 0:
        return finish(best, "fallback", float(span_bound(best)), float(lb),
                      f"{seed_name}: the work budget does not cover building CP-SAT's model")
    res = _solve_model(instance, best, free, replace(options, time_limit=work), wall_left, lb)
    if res.schedule is None:
        return finish(best, "fallback", float(span_bound(best)), float(lb), f"{seed_name}; {res.detail}",
                      cut=res.cut_by_deadline)
    cp_time = iteration_time(res.schedule)
    bound = float(max(math.ceil((res.bound or 0.0) - 1e-9), lb))
    if cp_time < best_time:
        status = "optimal" if cp_time <= bound else "feasible"
        return finish(res.schedule, status, res.objective, bound, res.detail, cut=res.cut_by_deadline)
    status = "optimal" if best_time <= bound else "fallback"
    return finish(best, status, float(span_bound(best)), bound,
                  f"{seed_name} kept: {res.detail} found nothing faster", cut=res.cut_by_deadline)
