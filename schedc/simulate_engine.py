"""The simulator's engine: run per-rank programs as early as their dependencies allow.

This is the one place that turns *orders* into *times* (the rules are in
docs/architecture.md). The simulator (`schedc.simulate`) uses it
for K iterations back to back (steady-state metrics); solvers use it to time
the orders they choose (`schedule_from_programs`) and to rank candidate
orders (`ProgramGraph.period`, called thousands of times, so it is built for
speed). It knows the dependency rules and nothing about any solver.

Programs list each rank's compute ops (F, B, W) in order; every live rank runs
its optimizer op O after them (an O inside a program must be its last op).

Speed: ops are integer codes (`encode`), and the graph's shape is used
directly: a compute op has at most one program predecessor and one data
predecessor (plus the transfer delay); an O waits for its program's last op
and one barrier per group of stages (every W, or B without decoupling, of
those stages). One iteration is then a single pass over a precomputed
topological order. The first op of a program waits for its rank's O, whose
end still holds the previous iteration's value when the op is reached; that
is how iterations chain.

Programs that cannot all progress (a cycle between program order and
dependencies, or an op waiting for one that no rank runs) raise
`DeadlockError` (E420) naming, for each stuck rank, the op it is stuck at and
what that op waits for; an op in two programs is E421.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import accumulate
from typing import Mapping, Sequence

from schedc.diagnostics import VerificationError, error
from schedc.memo import IdentityCache
from schedc.instance import Instance
from schedc.opgraph import optimizer_waits_for
from schedc.schedule import OpId, ScheduledOp, Schedule, SolverInfo, scheduled_op

#: Iterations run back to back, and the window of the last periods averaged (docs/architecture.md, the simulator).
STEADY_ITERATIONS = 8
STEADY_WINDOW = 4

KINDS = ("F", "B", "W")
_KIND_CODE = {"F": 0, "B": 1, "W": 2}
#: With redundant computation (Bamboo) there is no W (B is the full backward) and the third
#: slot of a code holds R, the redundant forward.
REDUNDANT_KINDS = ("F", "B", "R")
_REDUNDANT_CODE = {"F": 0, "B": 1, "R": 2}


def kind_names(instance: Instance) -> tuple[str, str, str]:
    """The op kind of each code slot (code % 3) for `instance`."""
    return REDUNDANT_KINDS if instance.redundant_forward else KINDS


def _kind_codes(instance: Instance) -> dict[str, int]:
    return _REDUNDANT_CODE if instance.redundant_forward else _KIND_CODE


class DeadlockError(VerificationError):
    """The per-rank programs cannot all run to completion."""


def steady_period(iteration_end: Sequence[int], window: int = STEADY_WINDOW) -> int:
    """ceil((T_{K-1} - T_{K-1-L}) / L), with L shrunk to K-1 when fewer iterations ran."""
    k = len(iteration_end)
    if k == 0:
        return 0
    if k == 1:
        return iteration_end[0]
    n = min(window, k - 1)
    return -(-(iteration_end[-1] - iteration_end[-1 - n]) // n)


# -- op codes -------------------------------------------------------------------


def encode_op(instance: Instance, op: OpId) -> int:
    """Integer code of a compute op: ((d*M + m)*S + s)*3 + kind (F=0, B=1, W=2; R=2 with
    redundant computation, which has no W)."""
    return ((op.dp * instance.microbatches + op.mb) * instance.pp + op.pp) * 3 + _kind_codes(instance)[op.kind]


def decode_op(instance: Instance, code: int) -> OpId:
    us, k = divmod(code, 3)
    u, s = divmod(us, instance.pp)
    d, m = divmod(u, instance.microbatches)
    return OpId(kind_names(instance)[k], d, s, m)


def encode(instance: Instance, programs: Mapping[int, Sequence[OpId]]) -> dict[int, list[int]]:
    """Compute ops of each program as integer codes (O dropped)."""
    S, M = instance.pp, instance.microbatches
    code = _kind_codes(instance)
    return {r: [((op.dp * M + op.mb) * S + op.pp) * 3 + code[op.kind] for op in prog if op.kind != "O"]
            for r, prog in programs.items()}


def decode(instance: Instance, programs: Mapping[int, Sequence[int]]) -> dict[int, list[OpId]]:
    """Integer programs back to `OpId`s (no O)."""
    return {r: [decode_op(instance, c) for c in prog] for r, prog in programs.items()}


def _check_ops(instance: Instance, programs: Mapping[int, Sequence[OpId]]) -> dict[int, list[int]]:
    """Codes of the programs, after checking every op can be encoded and O comes last."""
    kinds = ("F", "B", "W") if instance.decouple_backward else ("F", "B")
    if instance.redundant_forward:
        kinds += ("R",)
    n_gpus = len(instance.gpus)
    for rank, prog in programs.items():
        if not 0 <= rank < n_gpus or not instance.gpus[rank].live:
            if prog:
                raise VerificationError([error(
                    "E402", f"rank {rank} has a program but is not a live GPU",
                    hint="failed GPUs run nothing; move its ops to live peers of the same stage")])
            continue
        for step, op in enumerate(prog):
            if op.kind == "O":
                if step != len(prog) - 1:
                    raise VerificationError([error(
                        "E407", f"{op} is not the last op of rank {rank}'s program",
                        hint="the optimizer step ends a GPU's iteration: move it to the end")])
                continue
            if (op.kind not in kinds or op.mb is None or not 0 <= op.dp < instance.dp
                    or not 0 <= op.pp < instance.pp or not 0 <= op.mb < instance.microbatches):
                raise VerificationError([error(
                    "E401", f"rank {rank} runs {op}, which is not an op of this instance",
                    hint=f"ops are F, B{', W' if instance.decouple_backward else ''} of pipelines "
                         f"0..{instance.dp - 1}, stages 0..{instance.pp - 1}, "
                         f"microbatches 0..{instance.microbatches - 1}")])
    return encode(instance, {r: p for r, p in programs.items() if p})


# -- the graph ------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramRun:
    """The end of every iteration, and the times of the last one."""

    iteration_end: tuple[int, ...]  # T_k: end of the last op of iteration k
    _graph: "ProgramGraph" = field(repr=False, compare=False)
    _end: tuple[int, ...] = field(repr=False, compare=False)

    @property
    def iterations(self) -> int:
        return len(self.iteration_end)

    @cached_property
    def end(self) -> dict[OpId, int]:
        """Absolute end of every op in the last iteration."""
        return {op: self._end[node] for op, node in self._graph.nodes().items()}

    @cached_property
    def start(self) -> dict[OpId, int]:
        dur = self._graph.dur
        return {op: self._end[node] - dur[node] for op, node in self._graph.nodes().items()}


class ProgramGraph:
    """Integer programs flattened for repeated runs (see the module docstring).

    `programs` maps each rank to its compute-op codes in order. `order`, if
    given, must list every compute code in an order that respects program
    order and data dependencies (e.g. the order a list scheduler started
    them); otherwise one is computed, and deadlocks are reported.
    """

    def __init__(self, instance: Instance, programs: Mapping[int, Sequence[int]],
                 order: Sequence[int] | None = None):
        inst = instance
        S, M = inst.pp, inst.microbatches
        U = inst.dp * M
        n_compute = U * S * 3
        live = [g for g in inst.gpus if g.live]
        group_of = {g.pp: optimizer_waits_for(inst, g.pp) for g in live}
        group_list = list(dict.fromkeys(group_of.values()))
        bar0 = n_compute
        bar_node = {grp: bar0 + i for i, grp in enumerate(group_list)}
        o0 = bar0 + len(group_list)
        n = o0 + len(inst.gpus)

        pa = [-1] * n  # program predecessor (a first op: its rank's O, previous iteration)
        pb = [-1] * n  # data predecessor
        db = [0] * n  # delay after the data predecessor
        dur = [0] * n
        owner = [-1] * n_compute  # rank running each compute op, -1 if none
        tr = [inst.boundary_transfer(s) for s in range(S)]
        last_kind = 2 if inst.decouple_backward else 1
        redundant = inst.redundant_forward
        for g in live:
            r = g.rank
            prog = programs.get(r, ())
            dF = inst.duration("F", g.pp, r)
            dB = inst.duration("B", g.pp, r)
            dW = inst.duration("W", g.pp, r) if inst.decouple_backward else 0
            if redundant:
                dW = inst.duration("R", g.pp, r)
            o = o0 + r
            prev = o
            for c in prog:
                if owner[c] != -1:
                    raise DeadlockError([error(
                        "E421", f"op {decode_op(inst, c)} appears twice: in the programs of rank "
                                f"{owner[c]} and rank {r}",
                        hint="every op must run exactly once; remove one of them")])
                owner[c] = r
                pa[c] = prev
                prev = c
                k = c % 3
                s = (c // 3) % S
                if k == 0:
                    dur[c] = dF
                    if s > 0:
                        pb[c] = c - 3  # F of stage s-1
                        db[c] = tr[s - 1]
                elif k == 1:
                    dur[c] = dB
                    if s == S - 1:
                        pb[c] = c - 1  # F of the same stage
                    else:
                        pb[c] = c + 3  # B of stage s+1
                        db[c] = tr[s]
                elif not redundant:
                    dur[c] = dW
                    pb[c] = c - 1  # B of the same stage
                else:
                    dur[c] = dW  # R: the shadowed stage's forward; its F, if any, ran before
                    if s < S - 1:
                        pb[c] = c - 2  # F of the same stage
                if redundant and s != g.pp:
                    # An op of the failed successor's stage, run by its holder (Bamboo).
                    dur[c] = inst.duration(kind_names(inst)[k], s, r)
            pa[o] = prev
            pb[o] = bar_node[group_of[g.pp]]
            dur[o] = inst.duration("O", g.pp, r)
        self.bar_preds = [[(u * S + s) * 3 + last_kind for s in grp for u in range(U)]
                          for grp in group_list]
        self.instance = inst
        self.programs = programs
        self.pa, self.pb, self.db, self.dur, self.owner = pa, pb, db, dur, owner
        self.o0, self.bar0, self.n = o0, bar0, n
        self.o_nodes = [o0 + g.rank for g in live]
        self._check_missing()
        if order is None:
            order = self._topological()
        self.order = list(order)

    def _check_missing(self) -> None:
        """An op waiting for one that no rank runs would wait forever: E420."""
        owner, pb, inst = self.owner, self.pb, self.instance
        missing: list[str] = []
        for r, prog in self.programs.items():
            for c in prog:
                b = pb[c]
                if b >= 0 and owner[b] == -1:
                    missing.append(f"{decode_op(inst, c)} on rank {r} waits for {decode_op(inst, b)}, "
                                   "which no rank runs")
        for grp, preds in zip(self._groups(), self.bar_preds):
            absent = [c for c in preds if owner[c] == -1]
            if absent:
                missing.append(f"the optimizers of stage{'s' if len(grp) > 1 else ''} "
                               f"{', '.join(map(str, grp))} wait for {decode_op(inst, absent[0])}"
                               f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}, "
                               "which no rank runs")
        if missing:
            more = f"\n... and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise DeadlockError([error(
                "E420", "the programs deadlock: some ops wait for ops that no rank runs",
                detail="\n".join(missing[:10]) + more,
                hint="every F, B and W of every microbatch must be in exactly one rank's program")])

    def _groups(self) -> list[tuple[int, ...]]:
        live = self.instance.live_gpus()
        return list(dict.fromkeys(optimizer_waits_for(self.instance, g.pp) for g in live))

    def _topological(self) -> list[int]:
        """Compute ops in an order respecting program order and data dependencies."""
        pa, pb, n_compute = self.pa, self.pb, self.bar0
        ops = [c for prog in self.programs.values() for c in prog]
        succ: dict[int, list[int]] = {c: [] for c in ops}
        indeg = dict.fromkeys(ops, 0)
        for c in ops:
            a = pa[c]
            if a < n_compute:  # a first op's pa is an O: not an edge within the iteration
                succ[a].append(c)
                indeg[c] += 1
            b = pb[c]
            if b >= 0:
                succ[b].append(c)
                indeg[c] += 1
        stack = [c for c in ops if indeg[c] == 0]
        out: list[int] = []
        while stack:
            c = stack.pop()
            out.append(c)
            for x in succ[c]:
                indeg[x] -= 1
                if indeg[x] == 0:
                    stack.append(x)
        if len(out) < len(ops):
            self._raise_deadlock(set(out))
        return out

    def _raise_deadlock(self, done: set[int]) -> None:
        inst, pb = self.instance, self.pb
        lines = []
        for rank in sorted(self.programs):
            for step, c in enumerate(self.programs[rank]):
                if c in done:
                    continue
                waits = []
                if step > 0:
                    prev = self.programs[rank][step - 1]
                    waits.append(f"{decode_op(inst, prev)} (the op before it on rank {rank})")
                b = pb[c]
                if b >= 0 and b not in done:
                    waits.append(f"{decode_op(inst, b)} on rank {self.owner[b]}")
                lines.append(f"rank {rank} step {step}: {decode_op(inst, c)} waits for {', '.join(waits)}")
                break
        raise DeadlockError([error(
            "E420", "the programs deadlock: no rank can make progress",
            detail="\n".join(lines),
            hint="a rank's program runs its ops in order; reorder the ops so that every op's "
                 "dependencies come earlier in the programs they belong to")])

    def run(self, iterations: int, history: list[list[int]] | None = None) -> tuple[list[int], list[int]]:
        """End times by node in the last iteration, and T_k of every iteration; with `history`,
        a copy of every iteration's end times is appended to it. A graph's programs never change,
        so each run without history is kept by its number of iterations: a planner times its
        plan (`period`, K iterations), takes its schedule from one iteration (`scheduled_ops`),
        and the simulator then runs the same graph K iterations again (a third of a 0.1 s
        replan at 64 GPUs was these runs; when only the last run was kept, the one-iteration
        run in between made the simulator's a fresh one)."""
        runs = self.__dict__.setdefault("_runs", {})
        kept = runs.get(iterations) if history is None else None
        if kept is not None:
            return list(kept[0]), list(kept[1])
        end, ends = self._run(iterations, history)
        if history is None:
            runs[iterations] = (tuple(end), tuple(ends))
        return end, ends

    def _steps(self) -> tuple[list, list, list, list[int]]:
        """What one iteration computes, node by node in order: (node, program predecessor, data
        predecessor, delay, duration) for the compute ops and the O ops, (node, the ops it waits
        for) for the barriers; and the nodes no iteration computes, which stay at 0 (the zero
        node, a failed GPU's O). Made once per graph, used by every run."""
        steps = self.__dict__.get("_steps_made")
        if steps is None:
            pa, pb, db, dur = self.pa, self.pb, self.db, self.dur
            zero = self.n  # a node that always ends at 0: the data predecessor of ops without one
            computed = set(self.order).union(self.o_nodes, range(self.bar0, self.bar0 + len(self.bar_preds)))
            steps = self._steps_made = (
                [(i, pa[i], pb[i] if pb[i] >= 0 else zero, db[i], dur[i]) for i in self.order],
                [(i, pa[i], pb[i], db[i], dur[i]) for i in self.o_nodes],
                [(self.bar0 + k, preds) for k, preds in enumerate(self.bar_preds)],
                [i for i in range(self.n + 1) if i not in computed])
        return steps

    def _run(self, iterations: int, history: list[list[int]] | None) -> tuple[list[int], list[int]]:
        """Run `iterations` iterations. An iteration is a function of the previous one's O ends
        alone (a first op waits for its rank's O; every other input is of the same iteration), and
        adding P to every O end adds P to every end of the next iteration (all ends are at least
        0, so the zero node never sets one). So once every O of iteration k ended exactly P later
        than in iteration k - c (c up to `_CYCLE`; a failed GPU's pipeline often alternates
        between two iterations, c = 2), iteration k + j is iteration k - c + j shifted by P for
        every j > 0, and the rest of the run follows from the last c iterations, not op by op:
        the same ends, exactly. Without history only. The first iteration's ends are kept
        as the one-iteration run (what `scheduled_ops` takes)."""
        compute, o_steps, bars, idle = self._steps()
        o_nodes = self.o_nodes
        end = [0] * (self.n + 1)
        ends: list[int] = []
        o_hist: list[list[int]] = []  # the O ends of every iteration
        kept: list[list[int]] = []  # the ends of the last _CYCLE iterations (without history)
        for k in range(iterations):
            for i, a, b, d, du in compute:
                t = end[a]
                e = end[b] + d
                end[i] = (e if e > t else t) + du
            for i, preds in bars:
                end[i] = max([end[j] for j in preds], default=0)
            for i, a, b, d, du in o_steps:
                t = end[a]
                e = end[b] + d
                end[i] = (e if e > t else t) + du
            o_end = [end[o] for o in o_nodes]
            ends.append(max(o_end, default=0))
            if history is not None:
                history.append(list(end))
                continue
            if k == 0 and iterations > 1:
                self.__dict__.setdefault("_runs", {}).setdefault(1, (tuple(end), (ends[0],)))
            if k + 1 == iterations or not o_end:
                continue
            o_hist.append(o_end)
            kept.append(list(end))
            del kept[:-_CYCLE]
            for c in range(1, min(_CYCLE, k) + 1):
                back = o_hist[k - c]
                p = o_end[0] - back[0]
                if p >= 0 and all(x - y == p for x, y in zip(o_end, back)):
                    return self._repeat(kept[-c:], ends, iterations, c, p, idle)
        return end, ends

    @staticmethod
    def _repeat(last: list[list[int]], ends: list[int], iterations: int, c: int, p: int,
                idle: list[int]) -> tuple[list[int], list[int]]:
        """The run's last ends and every T_i, from the ends of iterations k - c + 1 .. k (`last`)
        where iteration k's O ends are iteration k - c's plus `p`: from k + 1 on, iteration i is
        iteration i - c shifted by `p` (T_i = T_(i-c) + p)."""
        k = len(ends) - 1
        while len(ends) < iterations:
            ends.append(ends[-c] + p)
        q, r = divmod(iterations - 1 - (k - c + 1), c)  # the last is iteration k - c + 1 + r, q c on
        add = q * p
        out = [x + add for x in last[r]] if add else list(last[r])
        for i in idle:
            out[i] = 0
        return out, ends

    def barrier_summary(self) -> "BarrierSummary | None":
        """What the rest of a cluster needs to know of these programs to run them beside others
        that share its optimizer barriers (`combine_summaries`): the barriers' times in the first
        iteration, and how each barrier's time in iteration k+1 follows from every barrier's
        time in iteration k (max-plus: bar'[h] = max over g of bar[g] + transfer[h][g]).

        It holds when every rank's last op is one its optimizer waits for (a rank's O then
        starts at its barrier): what every schedule that passes the verifier has. None when
        it does not hold; run the programs instead."""
        groups = self._groups()
        pred_sets = [set(p) for p in self.bar_preds]
        index = {self.bar0 + k: k for k in range(len(groups))}
        for o in self.o_nodes:
            last = self.pa[o]
            if last >= self.o0 or last not in pred_sets[index[self.pb[o]]]:
                return None  # a rank without ops, or whose last op its barrier does not wait for
        end, _ = self.run(1)
        first = tuple(end[self.bar0 + k] for k in range(len(groups)))
        transfer = []
        for g in range(len(groups)):
            start = [NEG] * (self.n + 1)  # the zero node too: from iteration 1 on, every path starts at an O
            for o in self.o_nodes:
                if index[self.pb[o]] == g:
                    start[o] = self.dur[o]  # O(k) of group g ends at bar_g(k) + its duration
            end = self._one_iteration(start)
            transfer.append(tuple(end[self.bar0 + h] for h in range(len(groups))))
        tail = [NEG] * len(groups)
        for o in self.o_nodes:
            k = index[self.pb[o]]
            tail[k] = max(tail[k], self.dur[o])
        perm = sorted(range(len(groups)), key=lambda k: groups[k])  # the same order in every part
        return BarrierSummary(groups=tuple(groups[k] for k in perm), first=tuple(first[k] for k in perm),
                              transfer=tuple(tuple(transfer[g][h] for g in perm) for h in perm),
                              tail=tuple(tail[k] for k in perm))

    def _one_iteration(self, end: list[int]) -> list[int]:
        """The compute ops and barriers of one iteration after O ends given in `end` (in place)."""
        pa, pb, db, dur, zero = self.pa, self.pb, self.db, self.dur, self.n
        for i in self.order:
            b = pb[i] if pb[i] >= 0 else zero
            t = end[pa[i]]
            e = end[b] + db[i]
            end[i] = (e if e > t else t) + dur[i]
        for k, preds in enumerate(self.bar_preds):
            end[self.bar0 + k] = max([end[j] for j in preds], default=NEG)
        return end

    def waits_on_program(self, iterations: int = 2 * STEADY_ITERATIONS, settle: int = STEADY_ITERATIONS // 2
                         ) -> list[tuple[int, int]]:
        """(a, c) for each compute op c on the steady state's critical path that started when the
        op a before it on its rank ended (not when its inputs arrived): the places where the
        order of a program sets the period.

        The path is followed back from the last optimizer step to end, through whichever
        predecessor ended last (the program one on ties), back to iteration `settle`; ops of
        the `settle` last iterations are left out, so that the path has joined the critical
        cycle, and the `settle` first ones are not reached, which still fill the pipeline."""
        hist: list[list[int]] = []
        self.run(iterations, hist)
        pa, pb, db = self.pa, self.pb, self.db
        bar0, o0 = self.bar0, self.o0
        k = iterations - 1
        node = max(self.o_nodes, key=lambda o: hist[k][o])
        out: list[tuple[int, int]] = []
        while k >= settle:
            end = hist[k]
            if bar0 <= node < o0:  # a barrier: its last W
                node = max(self.bar_preds[node - bar0], key=lambda j: end[j])
                continue
            a, b = pa[node], pb[node]
            ka = k - 1 if a >= o0 else k  # a first op (or the O of an empty program) waits for
            ta = hist[ka][a] if ka >= 0 else 0  # the previous iteration's O
            if node >= o0:  # an O: its program's last op, or its barrier
                if ta >= end[b]:
                    if ka < 0:
                        break
                    node, k = a, ka
                else:
                    node = b
                continue
            tb = end[b] + db[node] if b >= 0 else 0
            if ta >= tb:
                if a < o0 and k < iterations - settle:  # (k >= settle: the loop ends there)
                    out.append((a, node))
                if ka < 0:
                    break
                node, k = a, ka
            elif b >= 0:
                node = b
            else:
                break
        return out

    def period(self, iterations: int = STEADY_ITERATIONS, window: int = STEADY_WINDOW) -> int:
        """Steady-state iteration time (docs/architecture.md, the simulator)."""
        return steady_period(self.run(iterations)[1], window)

    def nodes(self) -> dict[OpId, int]:
        """Every op (O included) and its node index, ranks in order, programs in order."""
        inst = self.instance
        out: dict[OpId, int] = {}
        for r in sorted(self.programs):
            if not inst.gpus[r].live:
                continue
            for c in self.programs[r]:
                out[decode_op(inst, c)] = c
        for g in inst.live_gpus():
            out[OpId("O", g.dp, g.pp)] = self.o0 + g.rank
        return out

    def scheduled_ops(self) -> tuple[ScheduledOp, ...]:
        """One iteration, each op as early as allowed, ranks in order and O last on each.

        The tuple is remembered (`graph_of`): a schedule made of it needs no graph built
        again to be simulated, unless two ops of a rank start at the same time (zero-length
        ops), where the schedule's program order (`Schedule.programs`: by start, then end and
        op id) may differ from this graph's."""
        known = self.__dict__.get("_ops")
        if known is not None:
            return known
        inst = self.instance
        end, _ = self.run(1)
        dur = self.dur
        out = []
        S, M = inst.pp, inst.microbatches
        names = kind_names(inst)
        n_codes = self.bar0
        table = _decoded(inst.dp, S, M, names) if n_codes <= _DECODED_MAX else None
        ties = False
        for g in inst.live_gpus():
            r = g.rank
            before = -1
            for c in self.programs.get(r, ()):
                if table is not None:
                    kind, d, s, m = table[c]
                else:
                    us, k = divmod(c, 3)  # decode_op, inlined: this runs once per op of every plan
                    u, s = divmod(us, S)
                    d, m = divmod(u, M)
                    kind = names[k]
                start = end[c] - dur[c]
                ties = ties or start <= before
                before = start
                out.append(scheduled_op(r, kind, d, s, m, start, end[c]))
            o = self.o0 + r
            ties = ties or end[o] - dur[o] <= before
            out.append(scheduled_op(r, "O", g.dp, g.pp, None, end[o] - dur[o], end[o]))
        ops = self._ops = tuple(out)
        if not ties:
            _BY_OPS.append(self)
        return ops

    def first_starts(self) -> dict[int, int]:
        """Each live rank's first op's start in one iteration (its O's when it runs nothing
        else): with `scheduled_ops`, a rank's span without sorting its ops."""
        end, _ = self.run(1)
        dur, o0 = self.dur, self.o0
        out = {}
        for g in self.instance.live_gpus():
            prog = self.programs.get(g.rank)
            first = prog[0] if prog else o0 + g.rank
            out[g.rank] = end[first] - dur[first]
        return out

    def peaks(self) -> dict[int, int]:
        """Each live rank's peak memory running its program once: what
        `schedc.verify.memory_profile` gives for the same program, from the op codes."""
        inst = self.instance
        if inst.redundant_forward:
            raise ValueError("peaks() does not model redundant computation")
        decouple = inst.decouple_backward
        delta: list[int] = []  # by code % (3 S): bytes an op of stage s adds, by kind
        for c in inst.stages:
            delta += [c.activation, -(c.activation - c.stash) if decouple else -c.activation,
                      -c.stash if decouple else 0]
        n = len(delta)
        out = {}
        for g in inst.live_gpus():
            held = max(accumulate(delta[x % n] for x in self.programs.get(g.rank, ())), default=0)
            out[g.rank] = inst.stages[g.pp].static + max(0, held)
        return out


#: Longest cycle of iterations a run looks for before it stops running ops one by one
#: (`ProgramGraph._run`): with K = 8 iterations, one that repeats every c only settles in time
#: for small c. Checking costs a copy of the ends per iteration (25 us at 6,000 ops, a fortieth
#: of an iteration's ops).
_CYCLE = 3


#: Op codes up to which `scheduled_ops` decodes from a table kept per shape of cluster (a replan
#: makes the ops of plans of one shape again and again; at 64 GPUs the table takes a third of
#: the decoding's cost away, about 1 ms, for 0.6 MB). Above it, each code is decoded as it comes.
_DECODED_MAX = 30_000


@lru_cache(maxsize=2)
def _decoded(dp: int, pp: int, microbatches: int, names: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """(kind, dp, pp, mb) of every compute op code (`decode_op`) of a cluster of this shape."""
    out = []
    for c in range(dp * microbatches * pp * 3):
        us, k = divmod(c, 3)
        u, s = divmod(us, pp)
        d, m = divmod(u, microbatches)
        out.append((names[k], d, s, m))
    return out


#: Minus infinity for max-plus sums in integers: "no path".
NEG = -(1 << 62)


@dataclass(frozen=True)
class BarrierSummary:
    """`ProgramGraph.barrier_summary`: groups of stages that share an optimizer barrier, each
    barrier's time in iteration 0, `transfer[h][g]` (bar_h(k+1) - bar_g(k) along the longest
    path, NEG if none) and `tail[g]`, the longest O after barrier g (an iteration ends at the
    latest bar_g + tail[g])."""

    groups: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]
    transfer: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]


def combine_summaries(parts: Sequence[BarrierSummary], iterations: int) -> tuple[int, ...]:
    """T_k, the end of every iteration k < `iterations`, of programs that share optimizer
    barriers and nothing else (the classes of a symmetric schedule): the barrier of a group
    waits for the latest W of it in every part. Exactly what running them all together gives."""
    groups = parts[0].groups
    if any(p.groups != groups for p in parts):
        raise ValueError("the parts group their optimizer barriers differently")
    G = len(groups)
    bar = [max(p.first[g] for p in parts) for g in range(G)]
    tail = [max(p.tail[g] for p in parts) for g in range(G)]
    ends = []
    for k in range(iterations):
        ends.append(max(bar[g] + tail[g] for g in range(G)))
        if k + 1 < iterations:
            bar = [max(p.transfer[h][g] + bar[g] for p in parts for g in range(G)) for h in range(G)]
    return tuple(ends)


def program_graph(instance: Instance, programs: Mapping[int, Sequence[OpId]]) -> ProgramGraph:
    """The graph of `OpId` programs (each live rank's O runs last, listed or not).

    A pure function of the instance and the programs, so the last few graphs are kept per
    instance object and given again for equal programs: a planner that timed programs
    (`schedule_from_programs`) and the simulator that runs the same programs of the resulting
    schedule build the graph once (about 0.15 s at 60,000 ops)."""
    codes = _check_ops(instance, programs)
    known = _GRAPHS.get(instance)
    if known is not None and known.programs == codes:
        return known
    graph = ProgramGraph(instance, codes)
    _GRAPHS.put(instance, graph)
    return graph


_GRAPHS = IdentityCache(size=2)  # a graph holds its instance: few, so little is kept alive
#: The last graphs whose `scheduled_ops` made a schedule's ops (a tuple cannot be weakly
#: referenced, so the graphs, which hold their tuples, are kept: two, as `_GRAPHS`).
_BY_OPS: deque = deque(maxlen=2)


def graph_of(schedule: Schedule) -> "ProgramGraph | None":
    """The graph whose one-iteration timing `schedule.ops` is (the very tuple its
    `scheduled_ops` returned, so the same programs on the same instance), or None: a planner's
    schedule can be simulated and measured without building its graph again."""
    ops = schedule.ops
    for graph in _BY_OPS:
        if graph._ops is ops and graph.instance is schedule.instance:
            return graph
    return None


def keep_graph(graph: ProgramGraph) -> None:
    """Offer a graph a planner built itself (with its own topological order) to `program_graph`,
    so that simulating the plan it chose does not build it again (~8 ms at 6,000 ops, a tenth of
    a 0.1 s replan)."""
    _GRAPHS.put(graph.instance, graph)


def run_programs(instance: Instance, programs: Mapping[int, Sequence[OpId]],
                 iterations: int = 1) -> ProgramRun:
    """Run every rank's program `iterations` times back to back, each op as early as allowed."""
    graph = program_graph(instance, programs)
    end, ends = graph.run(iterations)
    return ProgramRun(iteration_end=tuple(ends), _graph=graph, _end=tuple(end))


def schedule_from_programs(instance: Instance, programs: Mapping[int, Sequence[OpId]],
                           solver: SolverInfo) -> Schedule:
    """Time one iteration of the given programs (each op as early as possible) as a `Schedule`.

    This is how list schedulers turn the order they chose into start/end times.
    """
    return Schedule(instance=instance, ops=program_graph(instance, programs).scheduled_ops(), solver=solver)
