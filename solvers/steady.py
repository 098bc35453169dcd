"""A fast steady-state evaluator for solvers that try many candidate orders.

It computes exactly what `schedc.timing.run_programs` (and so the simulator)
computes for the iteration time: K iterations back to back, each op as early
as its program and its dependencies allow, period ceil((T_{K-1} -
T_{K-1-L}) / L). It works on integer op codes instead of `OpId`s and exploits
the shape of the graph (every compute op has at most one data predecessor,
plus its program predecessor; an O waits for one barrier), which makes it
several times faster; `tests/test_solvers.py` checks that both agree.

Op codes: compute op kind k (F=0, B=1, W=2) of microbatch u = d*M + m at
stage s is ``(u*S + s)*3 + k``. O is never encoded: every live rank's
program gets its O appended here.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from schedc.instance import Instance
from schedc.opgraph import optimizer_waits_for
from schedc.schedule import OpId, ScheduledOp

KINDS = ("F", "B", "W")
_CODE = {"F": 0, "B": 1, "W": 2}


def encode(instance: Instance, programs: Mapping[int, Sequence[OpId]]) -> dict[int, list[int]]:
    """Compute ops of each program as integer codes (O dropped)."""
    S, M = instance.pp, instance.microbatches
    return {r: [((op.dp * M + op.mb) * S + op.pp) * 3 + _CODE[op.kind] for op in prog if op.kind != "O"]
            for r, prog in programs.items()}


def decode(instance: Instance, programs: Mapping[int, Sequence[int]]) -> dict[int, list[OpId]]:
    """Integer programs back to `OpId`s (O not added)."""
    S, M = instance.pp, instance.microbatches
    out = {}
    for r, prog in programs.items():
        ops = []
        for c in prog:
            us, k = divmod(c, 3)
            u, s = divmod(us, S)
            ops.append(OpId(KINDS[k], u // M, s, u % M))
        out[r] = ops
    return out


class CodeGraph:
    """Integer programs (each live rank's O appended) flattened for repeated runs."""

    def __init__(self, instance: Instance, programs: Mapping[int, Sequence[int]],
                 order: Sequence[int] | None = None):
        inst = instance
        S, M = inst.pp, inst.microbatches
        U = inst.dp * M
        n_compute = U * S * 3
        live = [g for g in inst.gpus if g.live]
        groups: dict[tuple[int, ...], int] = {}
        for g in live:
            groups.setdefault(optimizer_waits_for(inst, g.pp), 0)
        group_list = list(groups)
        bar0 = n_compute
        for gi, grp in enumerate(group_list):
            groups[grp] = bar0 + gi
        o0 = bar0 + len(group_list)
        n = o0 + len(inst.gpus)

        pa = [-1] * n  # program predecessor (for a first op: its rank's O, previous iteration)
        pb = [-1] * n  # data predecessor
        db = [0] * n  # delay after the data predecessor
        dur = [0] * n
        tr = [inst.boundary_transfer(s) for s in range(S)]
        last_kind = 2 if inst.decouple_backward else 1
        for g in live:
            r = g.rank
            prog = programs.get(r, ())
            dF = inst.duration("F", g.pp, r)
            dB = inst.duration("B", g.pp, r)
            dW = inst.duration("W", g.pp, r) if inst.decouple_backward else 0
            o = o0 + r
            prev = o
            for c in prog:
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
                else:
                    dur[c] = dW
                    pb[c] = c - 1  # B of the same stage
            pa[o] = prev
            pb[o] = groups[optimizer_waits_for(inst, g.pp)]
            dur[o] = inst.duration("O", g.pp, r)
        self.bar_preds = [[(u * S + s) * 3 + last_kind for s in grp for u in range(U)]
                          for grp in group_list]
        if order is None:
            order = _topological(programs, pa, pb, n_compute)
        self.instance = inst
        self.programs = programs
        self.order = list(order) + list(range(bar0, o0)) + [o0 + g.rank for g in live]
        self.o_nodes = [o0 + g.rank for g in live]
        self.o0, self.bar0 = o0, bar0
        self.pa, self.pb, self.db, self.dur = pa, pb, db, dur
        self.n = n

    def run(self, iterations: int) -> tuple[list[int], list[int]]:
        """End times of the last iteration (by node) and T_k of every iteration."""
        pa, pb, db, dur, bar0, o0 = self.pa, self.pb, self.db, self.dur, self.bar0, self.o0
        zero = self.n  # a node that always ends at 0: the data predecessor of ops without one
        steps = [(i, pa[i], pb[i] if pb[i] >= 0 else zero, db[i], dur[i])
                 for i in self.order if not bar0 <= i < o0]
        n_compute = len(steps) - len(self.o_nodes)
        compute, o_steps = steps[:n_compute], steps[n_compute:]
        bars = [(bar0 + k, preds) for k, preds in enumerate(self.bar_preds)]
        end = [0] * (self.n + 1)
        ends: list[int] = []
        for _ in range(iterations):
            # Each op starts after its program predecessor (for a first op: its rank's O of
            # the previous iteration, still in `end`) and its data predecessor plus delay.
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
            ends.append(max((end[o] for o in self.o_nodes), default=0))
        return end, ends

    def period(self, iterations: int = 8, window: int = 4) -> int:
        _, ends = self.run(iterations)
        window = min(window, len(ends) - 1)
        if window <= 0:
            return ends[-1]
        return math.ceil((ends[-1] - ends[-1 - window]) / window)

    def scheduled_ops(self) -> tuple[ScheduledOp, ...]:
        """One iteration, each op as early as allowed: what `schedule_from_programs` gives
        for the same programs (ranks in order, each program in order, O last)."""
        inst = self.instance
        S, M = inst.pp, inst.microbatches
        end, _ = self.run(1)
        dur = self.dur
        out = []
        for r in sorted(self.programs):
            g = inst.gpus[r]
            for c in self.programs[r]:
                us, k = divmod(c, 3)
                u, s = divmod(us, S)
                out.append(ScheduledOp(rank=r, kind=KINDS[k], dp=u // M, pp=s, mb=u % M,
                                       start=end[c] - dur[c], end=end[c]))
            o = self.o0 + r
            out.append(ScheduledOp(rank=r, kind="O", dp=g.dp, pp=g.pp, mb=None,
                                   start=end[o] - dur[o], end=end[o]))
        return tuple(out)


def steady_period(instance: Instance, programs: Mapping[int, Sequence[int]],
                  order: Sequence[int] | None = None, iterations: int = 8, window: int = 4) -> int:
    """Steady-state iteration time of integer programs, each live rank's O appended.

    `order`, if given, must list every compute op code in an order that
    respects dependencies and program order (e.g. the order a list scheduler
    started them); otherwise one is computed.
    """
    return CodeGraph(instance, programs, order).period(iterations, window)


def _topological(programs: Mapping[int, Sequence[int]], pa: list[int], pb: list[int],
                 n_compute: int) -> list[int]:
    """Compute ops in an order respecting program order and data dependencies."""
    ops = [c for prog in programs.values() for c in prog]
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
    out = []
    while stack:
        c = stack.pop()
        out.append(c)
        for x in succ[c]:
            indeg[x] -= 1
            if indeg[x] == 0:
                stack.append(x)
    if len(out) < len(ops):
        raise RuntimeError("programs deadlock")  # solvers only evaluate deadlock-free programs
    return out
