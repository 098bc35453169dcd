"""The verifier: does a schedule obey every rule of docs/architecture.md (the meaning of a schedule)?

`verify_schedule(schedule)` checks a `Schedule` against its own `Instance`
and raises one `VerificationError` carrying *all* violations it found (up to
`MAX_DIAGNOSTICS`), or returns None. It is independent of every solver (it
never imports `schedc.solvers`): a schedule is trusted only once it passed
here. A valid schedule is recognised by `schedule_passes`, one pass over the
ops by integer code plus a sort of each rank's program, fast enough for
replan's latency budget; only a rejected one goes through `diagnose`, the
rule-by-rule checker that writes the messages and grids.

Codes (stable, documented in docs/verifier.md):

    E400 more violations than shown          E405 wrong duration
    E401 completeness                        E406 memory over the limit
    E402 executor                            E407 optimizer ordering
    E403 dependency (with transfer time)     E408 malformed times
    E404 two ops overlap on one GPU          E409 a repeated pipeline differs from
                                                  the one it repeats (symmetric schedules)
    (E420/E421: the program runner)

A `schedc.symmetry.SymmetricSchedule` (a large cluster planned by classes of
pipelines) is checked part by part (each class planned alone), after E409
makes sure that expanding it gives a schedule of the cluster; the verdict is
the one the expanded schedule gets op by op (tests/test_symmetry.py).

Messages name ops in torch.distributed.pipelining's notation prefixed by the
owning pipeline (``d1:2F5``); where a rank's program is involved the
diagnostic's `detail` shows the rank x step grid around the failing step,
like torch's ``_format_pipeline_order``, with ``<-- ERROR HERE``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from operator import add, eq, lt
from functools import cached_property
from typing import Iterable, Mapping, Sequence

from schedc.diagnostics import Diagnostic, VerificationError, error
from schedc.instance import Instance
from schedc.memo import IdentityCache
from schedc.opgraph import OpGraph, data_deps, last_backward_kind, optimizer_waits_for
from schedc.schedule import OpId, Schedule, ScheduledOp

#: At most this many diagnostics are raised; the last one says how many were left out.
MAX_DIAGNOSTICS = 20

#: Steps shown above and below the failing step in a grid.
GRID_CONTEXT = 3
#: Columns (ranks) shown in a grid at most; beyond that only ranks near the error.
GRID_MAX_RANKS = 16


# -- memory: shared by the verifier and the simulator ----------------------------


@dataclass(frozen=True)
class MemoryProfile:
    """Memory of one GPU over one iteration of its program."""

    static: int
    peak: int  # static + the most bytes in flight at any instant
    peak_step: int  # index in the program of the op at whose start the peak is first reached (-1: static only)


def memory_profile(instance: Instance, rank: int, program: Sequence[ScheduledOp | OpId]) -> MemoryProfile:
    """Peak memory of GPU `rank` running `program` (its ops in order) once.

    `static` of the GPU's stage, plus `activation` from the start of each F;
    the end of B frees `activation - stash` (without decoupling: all of it);
    the end of W frees `stash`. Ops of one GPU run one after another, so the
    events happen in program order and a free at the end of an op comes before
    an allocation at the start of the next one, even at the same instant.
    """
    gpu = instance.gpus[rank]
    static = instance.stages[gpu.pp].static
    stages = instance.stages
    decouple = instance.decouple_backward
    in_flight = 0
    peak, peak_step = static, -1
    for step, op in enumerate(program):
        kind = op.kind
        if kind == "F" or kind == "R":
            # R (Bamboo's redundant forward) keeps the shadowed stage's activation until the
            # microbatch's own B here: what a holder needs to take over with it in flight.
            in_flight += stages[instance.shadowed(op.pp) if kind == "R" else op.pp].activation
            if static + in_flight > peak:
                peak, peak_step = static + in_flight, step
        elif kind == "B":
            c = stages[op.pp]
            in_flight -= c.activation - c.stash if decouple else c.activation
            if instance.redundant_forward and instance.runs_redundant(op.dp, op.pp):
                in_flight -= stages[instance.shadowed(op.pp)].activation
        elif kind == "W":
            in_flight -= stages[op.pp].stash
    return MemoryProfile(static=static, peak=peak, peak_step=peak_step)


# -- the rank x step grid ---------------------------------------------------------


def format_grid(programs: Mapping[int, Sequence[object]], error_rank: int | None = None,
                error_step: int | None = None, *, ranks: Iterable[int] = (),
                context: int = GRID_CONTEXT) -> str:
    """The rank x step grid of `programs` around `error_step`, torch style.

    One column per rank, one row per step; the row of `error_step` ends with
    ``<-- ERROR HERE`` and its cell on `error_rank` is marked with ``*``.
    Steps are positions in each rank's program, not times (as in torch).
    With many ranks, only `ranks` and their neighbours are shown.
    """
    all_ranks = sorted(programs)
    if len(all_ranks) > GRID_MAX_RANKS:
        wanted = set()
        for r in list(ranks) + ([error_rank] if error_rank is not None else []):
            wanted |= {r - 1, r, r + 1}
        all_ranks = [r for r in all_ranks if r in wanted] or all_ranks[:GRID_MAX_RANKS]
    n_steps = max((len(programs[r]) for r in all_ranks), default=0)
    if error_step is None:
        lo, hi = 0, min(n_steps, 2 * context + 1)
    else:
        lo, hi = max(0, error_step - context), min(n_steps, error_step + context + 1)
    width = len(str(max(n_steps - 1, 0)))
    labels = [f"Step {i:0{width}d}" for i in range(lo, hi)]
    cols = []
    for r in all_ranks:
        prog = programs[r]
        cells = []
        for i in range(lo, hi):
            cell = str(prog[i]) if i < len(prog) else ""
            if r == error_rank and i == error_step:
                cell = f"*{cell}"
            cells.append(cell)
        head = f"Rank {r}"
        w = max([len(head)] + [len(c) for c in cells])
        cols.append((head, cells, w))
    pad = " " * (len(labels[0]) + 2) if labels else ""
    lines = [(pad + " ".join(f"{h:<{w}}" for h, _, w in cols)).rstrip()]
    if lo > 0:
        lines.append("...")
    for k, label in enumerate(labels):
        row = f"{label}: " + " ".join(f"{cells[k]:<{w}}" for _, cells, w in cols)
        row = row.rstrip()
        if error_step is not None and lo + k == error_step:
            row += " <-- ERROR HERE"
        lines.append(row)
    if hi < n_steps:
        lines.append("...")
    return "\n".join(lines)


# -- the verifier -------------------------------------------------------------------


class _Checker:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.inst = schedule.instance
        self.found: list[tuple[int, Diagnostic]] = []  # (rule order, diagnostic)
        self._programs: dict[int, tuple[ScheduledOp, ...]] | None = None
        self._step: dict[int, int] | None = None  # id(op) -> position in its rank's program

    @cached_property
    def graph(self) -> OpGraph:
        """The instance's op graph (what must run where), for the op and executor rules."""
        return OpGraph(self.inst)

    # programs are only needed for grids and a few rules; build them once
    @property
    def programs(self) -> dict[int, tuple[ScheduledOp, ...]]:
        if self._programs is None:
            self._programs = self.schedule.programs
        return self._programs

    def programs_ranks(self) -> list[int]:
        return sorted({g.rank for g in self.inst.gpus if g.live} | {op.rank for op in self.schedule.ops})

    def step_of(self, op: ScheduledOp) -> int:
        if self._step is None:
            self._step = {id(o): i for prog in self.programs.values() for i, o in enumerate(prog)}
        return self._step.get(id(op), -1)

    def grid(self, op: ScheduledOp, *others: ScheduledOp) -> str:
        return format_grid(self.programs, op.rank, self.step_of(op), ranks=[o.rank for o in others])

    def add(self, code: str, message: str, *, hint: str = "", detail: str = "") -> None:
        self.found.append((len(self.found), error(code, message, hint=hint, detail=detail)))

    def full(self) -> bool:
        # Keep counting past the cap (for the summary) but stop building expensive grids.
        return len(self.found) >= MAX_DIAGNOSTICS

    # E408: times
    def check_times(self) -> list[ScheduledOp]:
        """Report malformed times; returns the ops whose times the other rules can use."""
        good = []
        for op in self.schedule.ops:
            s, e = op.start, op.end
            if not (isinstance(s, int) and isinstance(e, int)) or isinstance(s, bool) or isinstance(e, bool):
                self.add("E408", f"{op} has non-integer times (start {s!r}, end {e!r})",
                         hint="times are integer microseconds")
            elif s < 0:
                self.add("E408", f"{op} starts at {s} us, before time 0",
                         hint="times are non-negative integer microseconds")
            elif e < s:
                self.add("E408", f"{op} ends at {e} us, before it starts at {s} us")
            else:
                good.append(op)
        return good

    # E401 (identity, duplicates, missing) and E402 (executors)
    def check_identity(self, ops: list[ScheduledOp]) -> dict[OpId, ScheduledOp]:
        inst = self.inst
        n_ranks = len(inst.gpus)
        kinds = {"F", "B", "W", "O"} if inst.decouple_backward else {"F", "B", "O"}
        if inst.redundant_forward:
            kinds.add("R")
        by_id: dict[OpId, ScheduledOp] = {}
        for op in ops:
            if not 0 <= op.rank < n_ranks:
                self.add("E402", f"{op} runs on rank {op.rank}, which does not exist "
                                 f"(ranks are 0..{n_ranks - 1})")
                continue
            if op.kind not in kinds:
                if op.kind == "R":
                    self.add("E401", f"{op} is a redundant forward (R), but this instance has no "
                                     "redundant computation",
                             hint="R ops belong to the `redundant` baseline's plans only")
                elif op.kind == "W":
                    self.add("E401", f"{op} is a W op, but decouple_backward is off",
                             hint="without decoupling B is the full backward and there is no W")
                else:
                    self.add("E401", f"op of unknown kind {op.kind!r} on rank {op.rank}")
                continue
            if not (0 <= op.dp < inst.dp and 0 <= op.pp < inst.pp):
                self.add("E401", f"{op} names pipeline {op.dp} stage {op.pp}, outside "
                                 f"dp=0..{inst.dp - 1}, pp=0..{inst.pp - 1}")
                continue
            if op.kind == "O":
                if op.mb is not None:
                    self.add("E401", f"optimizer op {op} names microbatch {op.mb}; O has none")
                    continue
            elif op.mb is None or not 0 <= op.mb < inst.microbatches:
                self.add("E401", f"{op} names microbatch {op.mb}, outside 0..{inst.microbatches - 1}")
                continue
            other = by_id.get(op.id)
            if other is not None:
                self.add("E401", f"{op} is scheduled twice: on rank {other.rank} at {other.start} us "
                                 f"and on rank {op.rank} at {op.start} us",
                         hint="every op runs exactly once")
                continue
            by_id[op.id] = op
        graph = self.graph
        missing = [o for o in graph.compute_ops + graph.redundant_ops if o not in by_id]
        for op in list(by_id.values()):
            if op.kind == "R" and not inst.runs_redundant(op.dp, op.pp):
                self.add("E401", f"{op} is a redundant forward on GPU (dp={op.dp}, pp={op.pp}), "
                                 "which runs none (it failed, or the GPU it stands for did and it "
                                 "runs that stage itself)")
                del by_id[op.id]
        for o in missing[:MAX_DIAGNOSTICS]:
            self.add("E401", f"{o} is missing: no rank runs it",
                     hint="every F, B" + (", W" if inst.decouple_backward else "")
                          + " of every microbatch at every stage must be scheduled")
        if len(missing) > MAX_DIAGNOSTICS:
            self.add("E401", f"... {len(missing) - MAX_DIAGNOSTICS} more ops are missing")
        for o in graph.optimizer_ops:
            if o not in by_id:
                self.add("E401", f"{o} is missing: live GPU (dp={o.dp}, pp={o.pp}) "
                                 f"(rank {inst.gpu(o.dp, o.pp).rank}) has no optimizer op",
                         hint="each live GPU runs exactly one O per iteration")
        return by_id

    def check_executors(self, by_id: dict[OpId, ScheduledOp]) -> None:
        inst = self.inst
        graph = self.graph
        for op in by_id.values():
            gpu = inst.gpus[op.rank]
            if inst.redundant_forward and gpu.live and op.rank not in graph.candidates(op.id):
                own = inst.gpu(op.dp, op.pp)
                runs = (f"its own GPU, rank {own.rank}" if own.live or op.kind in ("O", "R") else
                        f"the holder of its stage's copy, rank {inst.holder(op.dp, op.pp).rank}")
                self.add("E402", f"{op} runs on rank {op.rank} (dp={gpu.dp}, pp={gpu.pp}); with "
                                 f"redundant computation it runs on {runs}",
                         hint="Bamboo moves no work between pipelines: a failed GPU's stage runs on "
                              "the GPU before it in its pipeline, which holds a copy",
                         detail="" if self.full() else self.grid(op))
            elif not gpu.live:
                self.add("E402", f"{op} runs on rank {op.rank} (dp={gpu.dp}, pp={gpu.pp}), which failed",
                         hint="failed GPUs run nothing; re-route the op to a live GPU of its stage",
                         detail="" if self.full() else self.grid(op))
            elif gpu.pp != op.pp and not inst.redundant_forward:
                self.add("E402", f"{op} of stage {op.pp} runs on rank {op.rank}, a GPU of stage {gpu.pp}",
                         hint=f"an op runs on a live GPU of its own stage; stage {op.pp} has ranks "
                              + ", ".join(str(g.rank) for g in inst.live_gpus(op.pp)),
                         detail="" if self.full() else self.grid(op))
            elif op.kind == "O" and gpu.dp != op.dp:
                self.add("E402", f"{op} is the optimizer of GPU (dp={op.dp}, pp={op.pp}) but runs on "
                                 f"rank {op.rank} (dp={gpu.dp}, pp={gpu.pp})",
                         hint="each O runs on its own GPU")
        # F, B and W of one (d, m, s) share one executor: the activations live there.
        kinds = ("B", "W") if inst.decouple_backward else ("B",)
        if inst.redundant_forward:
            kinds += ("R",)
        for f in by_id.values():
            if f.kind != "F":
                continue
            for k in kinds:
                other = by_id.get(OpId(k, f.dp, f.pp, f.mb))
                if other is not None and other.rank != f.rank:
                    self.add("E402", f"{other} runs on rank {other.rank} but {f} runs on rank {f.rank}",
                             hint="F, B and W of one microbatch at one stage share one executor "
                                  "(the activations live there)",
                             detail="" if self.full() else self.grid(other, f))
                    break

    def check_durations(self, by_id: dict[OpId, ScheduledOp]) -> None:
        inst = self.inst
        for op in by_id.values():
            want = inst.duration(op.kind, op.pp, op.rank)
            if op.end - op.start != want:
                speed = inst.gpus[op.rank].speed
                at = f" at speed {speed:g}" if speed < 1.0 else ""
                self.add("E405", f"{op} on rank {op.rank} lasts {op.end - op.start} us "
                                 f"({op.start}..{op.end}); it takes {want} us{at}",
                         hint="a duration is the stage's cost divided by the GPU's speed, rounded up")

    def check_dependencies(self, by_id: dict[OpId, ScheduledOp]) -> None:
        inst = self.inst
        for op in by_id.values():
            if op.kind == "O":
                continue
            for dep in data_deps(inst, op.id):
                pred = by_id.get(dep.op)
                if pred is None:
                    continue  # reported as missing
                earliest = pred.end + dep.delay
                if op.start < earliest:
                    via = (f" plus the {dep.delay} us transfer across the stage boundary"
                           if dep.delay else "")
                    self.add("E403", f"{op} starts at {op.start} us, before {pred.id} ends at "
                                     f"{pred.end} us{via} (earliest start {earliest} us)",
                             hint="an op starts after its dependencies end; "
                                  "stage boundaries always pay the transfer time",
                             detail="" if self.full() else self.grid(op, pred))

    def check_programs(self) -> None:
        """E404 overlap, E406 memory and 'O is last' (E407), per rank's program."""
        inst = self.inst
        for rank, prog in sorted(self.programs.items()):
            if not 0 <= rank < len(inst.gpus):
                continue
            for a, b in zip(prog, prog[1:]):
                if b.start < a.end:
                    self.add("E404", f"{a} ({a.start}..{a.end} us) and {b} ({b.start}..{b.end} us) "
                                     f"overlap on rank {rank}",
                             hint="a GPU runs one op at a time",
                             detail="" if self.full() else self.grid(b))
            seen_o = None
            for op in prog:
                if seen_o is not None and op.kind != "O":
                    self.add("E407", f"{op} runs on rank {rank} after its optimizer op {seen_o} "
                                     f"(starts {op.start} us, O starts {seen_o.start} us)",
                             hint="O is the last op of its GPU's program in an iteration",
                             detail="" if self.full() else self.grid(op, seen_o))
                    break
                if op.kind == "O":
                    seen_o = op
            if not inst.gpus[rank].live or (not inst.redundant_forward
                                            and any(o.pp != inst.gpus[rank].pp for o in prog)):
                continue  # reported as executor errors; memory would be meaningless
            mem = memory_profile(inst, rank, prog)
            if mem.peak > inst.gpu_memory:
                op = prog[mem.peak_step]
                self.add("E406", f"rank {rank} needs {mem.peak} bytes at the start of {op} "
                                 f"({op.start} us), {mem.peak - inst.gpu_memory} bytes over its "
                                 f"{inst.gpu_memory} bytes (static {mem.static} + "
                                 f"{mem.peak - mem.static} in flight)",
                         hint="fewer microbatches in flight on this GPU: run a B (or W) before this F",
                         detail="" if self.full() else self.grid(op))

    def check_optimizer(self, by_id: dict[OpId, ScheduledOp]) -> None:
        inst = self.inst
        kind = last_backward_kind(inst)
        last_end: dict[int, ScheduledOp] = {}  # stage -> its last-ending W (or B)
        for op in by_id.values():
            if op.kind == kind:
                cur = last_end.get(op.pp)
                if cur is None or (op.end, op.id) > (cur.end, cur.id):
                    last_end[op.pp] = op
        for o in by_id.values():
            if o.kind != "O":
                continue
            # One diagnostic per O, naming the W it waits for that ends last.
            waits = [last_end[s] for s in optimizer_waits_for(inst, o.pp) if s in last_end]
            w = max(waits, key=lambda x: (x.end, x.id), default=None)
            if w is None or o.start >= w.end:
                continue
            if w.pp == o.pp:
                why = f"{w.id} of its own stage ends at {w.end} us"
                hint = "O of a stage starts after every " + kind + " of that stage, on all its GPUs"
            else:
                why = f"{w.id} of stage {w.pp} ends at {w.end} us"
                hint = "without stagger_optimizer every O waits for every " + kind + " of every stage"
            self.add("E407", f"{o} on rank {o.rank} starts at {o.start} us, before {why}",
                     hint=hint, detail="" if self.full() else self.grid(o, w))

    def run(self) -> list[Diagnostic]:
        timed = {id(op) for op in self.check_times()}
        by_id = self.check_identity(list(self.schedule.ops))
        self.check_executors(by_id)
        # Rules about time only look at ops with well-formed times (the rest are reported).
        if len(timed) < len(self.schedule.ops):
            by_id = {k: op for k, op in by_id.items() if id(op) in timed}
            self._programs = {r: tuple(sorted((o for o in self.schedule.ops if id(o) in timed and o.rank == r),
                                              key=lambda o: (o.start, o.end, o.id)))
                              for r in self.programs_ranks()}
        self.check_durations(by_id)
        self.check_dependencies(by_id)
        self.check_programs()
        self.check_optimizer(by_id)
        diags = [d for _, d in self.found]
        if len(diags) > MAX_DIAGNOSTICS:
            extra = len(diags) - (MAX_DIAGNOSTICS - 1)
            diags = diags[:MAX_DIAGNOSTICS - 1] + [error(
                "E400", f"{extra} more violations not shown",
                hint="fix the ones above first; many usually share one cause")]
        return diags


# -- the fast path ------------------------------------------------------------------
#
# A valid schedule needs no message, so its check need not build any: one pass
# over the ops files each F/B/W under its integer code
# (`schedc.simulate_engine.encode_op`: ((d*M + m)*S + s)*3 + kind), and every
# other rule is then a comparison of whole columns of that table, run by C
# loops (map/operator/accumulate). Any doubt (a violation, an odd type, a tie
# in program order) returns False and `check_schedule` runs the rule-by-rule
# checker, which alone writes diagnostics.

_INT = {int}
_INT_OR_NONE = {int, type(None)}
_KIND_CODE = {"F": 0, "B": 1, "W": 2}
_NEVER = float("-inf")  # a predecessor end that every start is after (no dependency)


def schedule_passes(schedule: Schedule) -> bool:
    """True only if `schedule` obeys every rule of docs/architecture.md (the meaning of a schedule) (`diagnose` finds nothing).

    It never accepts what `diagnose` would reject, but may send a valid
    schedule there (ties in a rank's program order, int subclasses as times,
    a stash larger than the activation); that costs time, never correctness.
    """
    inst = schedule.instance
    ops = schedule.ops
    D, S, M = inst.dp, inst.pp, inst.microbatches
    gpus = inst.gpus
    n_ranks = len(gpus)
    if not ops or D * S * M == 0 or len(inst.stages) != S or inst.redundant_forward:
        return False  # (redundant computation: a baseline's plans, checked rule by rule)
    coords = {(g.dp, g.pp) for g in gpus}
    if (len(coords) != n_ranks or coords != {(d, s) for d in range(D) for s in range(S)}
            or any(g.rank != i for i, g in enumerate(gpus))):
        return False  # not one GPU per (dp, pp): leave such an instance to the full checker

    # Columns by comprehension: no tuple per op (which also keeps the GC quiet).
    ranks = [o.rank for o in ops]
    kinds = [o.kind for o in ops]
    dps = [o.dp for o in ops]
    pps = [o.pp for o in ops]
    mbs = [o.mb for o in ops]
    starts = [o.start for o in ops]
    ends = [o.end for o in ops]
    # E408 and E401/E402 on types and ranges, column by column.
    if not (set(map(type, starts)) <= _INT and set(map(type, ends)) <= _INT
            and set(map(type, ranks)) <= _INT and set(map(type, dps)) <= _INT
            and set(map(type, pps)) <= _INT and set(map(type, mbs)) <= _INT_OR_NONE):
        return False
    if min(starts) < 0 or any(map(lt, ends, starts)) or min(ranks) < 0 or max(ranks) >= n_ranks:
        return False
    decouple = inst.decouple_backward
    kind_code = _KIND_CODE if decouple else {"F": 0, "B": 1}

    # Per rank: live, its stage and pipeline, and its F/B/W durations.
    live = [g.live for g in gpus]
    rank_pp = [g.pp for g in gpus]
    rank_dp = [g.dp for g in gpus]
    durations: list[int] = []  # rank*3 + kind -> duration; failed GPUs run nothing
    o_duration: list[int] = []
    for g in gpus:
        durations += [inst.duration(k, g.pp, g.rank) for k in ("F", "B", "W")] if g.live else [-1] * 3
        o_duration.append(inst.duration("O", g.pp, g.rank) if g.live else -1)

    n_codes = D * M * S * 3
    start_at: list = [None] * n_codes
    end_at: list = [None] * n_codes
    rank_at = [-1] * n_codes
    programs: dict[int, list[int]] = {g.rank: [] for g in gpus if g.live}
    o_start: dict[int, int] = {}  # rank -> start of its O
    for r, k, d, s, m, st, en in zip(ranks, kinds, dps, pps, mbs, starts, ends):
        if not live[r] or s != rank_pp[r]:
            return False  # E402: a failed GPU, or a GPU of another stage
        if k == "O":
            if m is not None or d != rank_dp[r] or r in o_start or en - st != o_duration[r]:
                return False
            o_start[r] = st
            continue
        kc = kind_code.get(k)
        if kc is None or m is None or not 0 <= d < D or not 0 <= m < M:
            return False
        c = ((d * M + m) * S + s) * 3 + kc
        if end_at[c] is not None or en - st != durations[r * 3 + kc]:
            return False  # scheduled twice (E401), or a wrong duration (E405)
        start_at[c] = st
        end_at[c] = en
        rank_at[c] = r
        programs[r].append(c)

    # E401: the codes are distinct and in range, so counting them finds a missing one;
    # each O sits on its own live GPU, so one per live GPU means none is missing.
    n_kinds = 3 if decouple else 2
    if sum(map(len, programs.values())) != D * M * S * n_kinds or len(o_start) != sum(live):
        return False
    # E402: F, B (and W) of one (d, m, s) on one rank.
    if rank_at[0::3] != rank_at[1::3] or (decouple and rank_at[1::3] != rank_at[2::3]):
        return False

    # E403, per (d, m, s) index u = (d*M + m)*S + s, as columns.
    sf, ef = start_at[0::3], end_at[0::3]
    sb, eb = start_at[1::3], end_at[1::3]
    transfer = [inst.boundary_transfer(s) for s in range(S - 1)]
    # Delay after stage s's op towards stage s+1 (F) or s-1 (B); none across (d, m) rows.
    across = (transfer + [_NEVER]) * (D * M)
    # F of stage s > 0 after F of stage s-1 plus the transfer.
    if any(map(lt, sf[1:], map(add, ef[:-1], across[:-1]))):
        return False
    # B of stage s < S-1 after B of stage s+1 plus the transfer; B of the last stage after its F.
    if any(map(lt, sb[:-1], map(add, eb[1:], across[:-1]))):
        return False
    if any(map(lt, sb[S - 1::S], ef[S - 1::S])):
        return False
    if decouple and any(map(lt, start_at[2::3], eb)):
        return False  # W after its B

    # E404, E407 (O last) and E406, per rank's program in start order.
    memory = inst.gpu_memory
    pattern: list[int] = []  # bytes each op of stage s adds, by kind
    for cost in inst.stages:
        pattern += [cost.activation,
                    -(cost.activation - cost.stash) if decouple else -cost.activation,
                    -cost.stash if decouple else 0]
    delta_at = pattern * (D * M)
    for r, prog in programs.items():
        static = inst.stages[rank_pp[r]].static
        if not prog:
            if static > memory:
                return False
            continue
        prog.sort(key=start_at.__getitem__)
        p_start = list(map(start_at.__getitem__, prog))
        p_end = list(map(end_at.__getitem__, prog))
        # A tie in start leaves the order to (end, op id): let the full checker decide.
        if any(map(lt, p_start[1:], p_end[:-1])) or any(map(eq, p_start[1:], p_start[:-1])):
            return False
        o = o_start.get(r)  # O must start after every other op ended, so it comes last
        if o is not None and not (o >= p_end[-1] and o != p_start[-1]):
            return False
        # Prefix sums over every op, not only at F: never below the peak of the memory rule.
        if static + max(0, max(accumulate(map(delta_at.__getitem__, prog)))) > memory:
            return False

    # E407: each O after the last W (B) of its stage, or of every stage.
    last = 2 if decouple else 1
    last_end = end_at[last::3]
    stage_end = [max(last_end[s::S]) for s in range(S)]
    every = max(stage_end)
    stagger = inst.stagger_optimizer
    for r, o in o_start.items():
        if o < (stage_end[rank_pp[r]] if stagger else every):
            return False
    return True


def diagnose(schedule: Schedule) -> list[Diagnostic]:
    """Every violation in `schedule`, rule by rule, with messages and grids.

    The slow path: `check_schedule` calls it only when `schedule_passes`
    found a problem (or could not decide), so the diagnostics of a rejected
    schedule come from here and nowhere else.
    """
    return _Checker(schedule).run()


def check_schedule(schedule: Schedule) -> list[Diagnostic]:
    """Every violation of docs/architecture.md's rules in `schedule` (at most `MAX_DIAGNOSTICS`), in rule order."""
    from schedc.symmetry import SymmetricSchedule

    if isinstance(schedule, SymmetricSchedule):
        return _check_symmetric(schedule)
    if schedule_passes(schedule):
        return []
    return diagnose(schedule)


def verify_schedule(schedule: Schedule) -> None:
    """Raise `VerificationError` with every violation of docs/architecture.md's rules, or return None.

    >>> verify_schedule(get_solver("1f1b")(instance, SolveOptions()))  # doctest: +SKIP
    """
    diags = check_schedule(schedule)
    if diags:
        raise VerificationError(diags)


def _check_symmetric(schedule) -> list[Diagnostic]:
    """A symmetric schedule: its layout repeats only like pipelines (E409), and every part (a
    class planned alone), its O ops at its own barriers, obeys every rule. Starting an O later
    (at the barrier it shares with the other parts) breaks none: it is its GPU's last op and
    holds no memory."""
    from schedc.symmetry import layout_problems, normalized_part

    problems = layout_problems(schedule.instance, schedule.layout, tuple(p.instance for p in schedule.parts))
    if problems:
        return [error("E409", f"the schedule repeats pipelines that are not alike: {p}",
                      hint="recompile the spec: a hand edit of `classes` or `gpus` broke the repetition")
                for p in problems]
    diags: list[Diagnostic] = []
    for c, part in enumerate(schedule.parts):
        if _PASSED.get(part) is not None:
            continue
        found = check_schedule(normalized_part(part))
        if not found:
            _PASSED.put(part, True)
        diags.extend(replace(d, message=f"class {c} (its pipelines numbered from 0): {d.message}") for d in found)
    return diags[:MAX_DIAGNOSTICS]


#: Parts that passed (a replan reuses the parts of classes it does not plan again).
_PASSED = IdentityCache(size=64)
