"""An event-driven list scheduler: the engine of `reroute-1f1b` and `greedy`.

Given an executor for every microbatch at every stage and a policy, it plays
one iteration (or several, each GPU's optimizer step between them) forward
in time: whenever a GPU is idle it starts one of the ops that are ready on
it (their inputs have arrived), chosen by the policy, and never starts a
forward that would take the GPU over its memory. The order in which each GPU
started its ops in an iteration is its program; `schedc.simulate_engine` then times
it (as early as allowed) and runs it back to back.

Deadlock freedom: memory alone never deadlocks (a GPU whose memory is full
holds microbatches whose backward is ready on it or will come from a later
stage, and the last stage's backward only needs its own forward), so if the
policy's extra limits (an in-flight cap, forwards in a fixed order) ever stop
every GPU at once, the engine drops those limits for the rest of the
iteration and goes on (`ListResult.relaxed` says so).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from schedc.instance import Instance
from schedc.schedule import OpId
from schedc.simulate_engine import decode


@dataclass(frozen=True)
class Policy:
    """How an idle GPU chooses among its ready ops.

    kinds: preference between ready kinds, e.g. ("W", "B", "F") runs each W
    right after its B (1F1B), ("B", "F", "W") defers W to fill idle time
    (ZB-H1-like). Within a kind the microbatch with the smallest key goes
    first. strict_forward: a GPU starts its forwards exactly in key order
    (waiting for the next one even if a later one has arrived).
    """

    name: str
    kinds: tuple[str, ...] = ("W", "B", "F")
    strict_forward: bool = False


@dataclass(frozen=True)
class ListResult:
    """Programs as op codes (`schedc.simulate_engine.encode`), compute ops only, per live rank."""

    instance: Instance
    codes: dict[int, list[int]]
    order: list[int]  # every op code in the order it was started (a topological order)
    makespan: int  # of the iterations played
    relaxed: bool  # the policy's limits had to be dropped to avoid a deadlock
    #: With `iterations` > 1: (codes, order) of every iteration played, the first one included.
    rounds: tuple[tuple[dict[int, list[int]], list[int]], ...] = ()

    @property
    def programs(self) -> dict[int, list[OpId]]:
        return decode(self.instance, self.codes)


def list_schedule(instance: Instance, executor: Sequence[Sequence[int]], key: Sequence[int],
                  caps: Sequence[int], policy: Policy, iterations: int = 1) -> ListResult:
    """Play `iterations` iterations. `executor[u][s]` is the rank that runs microbatch u = d*M + m
    at stage s; `key[u]` orders microbatches (smaller first); `caps[rank]` bounds how many
    microbatches a rank holds between the start of F and the end of B.

    With more than one iteration, each GPU steps its optimizer (O) once its own ops of an
    iteration ended and its barrier is reached (every W of its stage, or of every stage with
    a global barrier), and starts the next iteration's forwards only after it: so the choices
    of a later iteration see how the pipeline overlaps one iteration with the next (the
    steady state the programs will run in), where the first sees an empty pipeline.
    """
    inst = instance
    S, M = inst.pp, inst.microbatches
    U = inst.dp * M
    n_ranks = len(inst.gpus)
    decoupled = inst.decouple_backward
    tr = [inst.boundary_transfer(s) for s in range(S)]

    stage_of = [g.pp for g in inst.gpus]
    durF = [0] * n_ranks
    durB = [0] * n_ranks
    durW = [0] * n_ranks
    durO = [0] * n_ranks
    act = [0] * n_ranks
    bfree = [0] * n_ranks
    stash = [0] * n_ranks
    limit = [0] * n_ranks
    for g in inst.gpus:
        if not g.live:
            continue
        r, st = g.rank, inst.stages[g.pp]
        durF[r] = inst.duration("F", g.pp, r)
        durB[r] = inst.duration("B", g.pp, r)
        durW[r] = inst.duration("W", g.pp, r) if decoupled else 0
        durO[r] = inst.duration("O", g.pp, r)
        act[r] = st.activation
        stash[r] = st.stash if decoupled else 0
        bfree[r] = st.activation - stash[r]
        limit[r] = inst.gpu_memory - st.static

    # Forwards each rank will run, in key order (for strict_forward).
    f_seq: list[list[int]] = [[] for _ in range(n_ranks)]
    for u in sorted(range(U), key=key.__getitem__):
        for s in range(S):
            f_seq[executor[u][s]].append(u)
    f_ptr = [0] * n_ranks

    # Optimizer barriers (more than one iteration only): the group of stages each O waits for,
    # the ops of an iteration each rank has left, and each group's last-kind ops left.
    n_ops = [0] * n_ranks
    group = [0 if not inst.stagger_optimizer else s for s in range(S)]
    group_size = [0] * S
    for u in range(U):
        for s in range(S):
            n_ops[executor[u][s]] += 3 if decoupled else 2
            group_size[group[s]] += 1
    members: list[list[int]] = [[] for _ in range(S)]
    for g in inst.gpus:
        if g.live:
            members[group[g.pp]].append(g.rank)
    ops_left = list(n_ops)
    group_left = [list(group_size) for _ in range(iterations)]  # by iteration, then group
    it_of = [0] * n_ranks  # the iteration each rank works on (advances when its O ends)
    stepping = [False] * n_ranks
    pending: list[list[int]] = [[] for _ in range(n_ranks)]  # forwards of the next iteration
    firsts: list[list[int]] = [[] for _ in range(n_ranks)]  # stage-0 forwards a rank starts with
    for u in range(U):
        firsts[executor[u][0]].append(u)

    readyF: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
    readyB: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
    readyW: list[deque] = [deque() for _ in range(n_ranks)]
    mem = [0] * n_ranks
    inflight = [0] * n_ranks
    busy = [False] * n_ranks
    cap = list(caps)
    strict = policy.strict_forward
    kinds = policy.kinds
    rounds: list[tuple[list[list[int]], list[int]]] = [
        ([[] for _ in range(n_ranks)], []) for _ in range(iterations)]

    # Events: (time, seq, what, rank, u, kind). what 0 = an op ended, 1 = an input arrived.
    events: list[tuple[int, int, int, int, int, str]] = []
    seq = 0
    for u in range(U):
        r = executor[u][0]
        heapq.heappush(readyF[r], (key[u], u))
    remaining = iterations * U * S * (3 if decoupled else 2)
    relaxed = False
    now = 0
    touched = set(executor[u][0] for u in range(U))

    def start(r: int, t: int, u: int, kind: str, k: int, dur: int) -> None:
        """Start op `kind` (code offset `k`) of microbatch `u` on rank `r` at time `t`."""
        nonlocal seq
        busy[r] = True
        c = (u * S + stage_of[r]) * 3 + k
        programs, order = rounds[it_of[r]]
        programs[r].append(c)
        order.append(c)
        seq += 1
        heapq.heappush(events, (t + dur, seq, 0, r, u, kind))

    def dispatch(r: int, t: int) -> None:
        nonlocal seq
        if iterations > 1 and ops_left[r] == 0:
            # Every op of this iteration ended: step the optimizer once the barrier is reached.
            it = it_of[r]
            if not stepping[r] and group_left[it][group[stage_of[r]]] == 0 and it + 1 < iterations:
                stepping[r] = busy[r] = True
                seq += 1
                heapq.heappush(events, (t + durO[r], seq, 0, r, -1, "O"))
            return
        for kind in kinds:
            if kind == "B":
                if readyB[r]:
                    start(r, t, heapq.heappop(readyB[r])[1], "B", 1, durB[r])
                    return
            elif kind == "W":
                if readyW[r]:
                    start(r, t, readyW[r].popleft(), "W", 2, durW[r])
                    return
            else:
                heap = readyF[r]
                if not heap or inflight[r] >= cap[r] or mem[r] + act[r] > limit[r]:
                    continue
                if strict:
                    # Forwards start in key order, so the next one is f_seq[r][f_ptr[r]].
                    if heap[0][1] != f_seq[r][f_ptr[r]]:
                        continue
                    f_ptr[r] += 1
                mem[r] += act[r]
                inflight[r] += 1
                start(r, t, heapq.heappop(heap)[1], "F", 0, durF[r])
                return

    def op_ended(r: int, s: int, last: bool) -> None:
        """Count an ended op of rank r's iteration towards its O and its group's barrier."""
        ops_left[r] -= 1
        if last:
            grp, left = group[s], group_left[it_of[r]]
            left[grp] -= 1
            if left[grp] == 0:
                touched.update(members[grp])

    while True:
        for r in sorted(touched):
            if not busy[r]:
                dispatch(r, now)
        touched = set()
        if not events:
            if remaining == 0:
                break
            if relaxed:
                raise RuntimeError("list scheduler stuck with relaxed limits")  # see module doc
            relaxed = True
            strict = False
            cap = [1 << 30] * n_ranks
            touched = {g.rank for g in inst.gpus if g.live}
            continue
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, what, r, u, kind = heapq.heappop(events)
            touched.add(r)
            if what == 1:
                if kind == "F":
                    if it_of[r] == u // U:
                        heapq.heappush(readyF[r], (key[u % U], u % U))
                    else:
                        pending[r].append(u % U)
                else:
                    heapq.heappush(readyB[r], (key[u], u))
                continue
            busy[r] = False
            if kind == "O":
                # The next iteration: its first forwards, and those that arrived meanwhile.
                stepping[r] = False
                it_of[r] += 1
                ops_left[r] = n_ops[r]
                f_ptr[r] = 0
                for v in firsts[r] if stage_of[r] == 0 else ():
                    heapq.heappush(readyF[r], (key[v], v))
                for v in pending[r]:
                    heapq.heappush(readyF[r], (key[v], v))
                pending[r] = []
                continue
            remaining -= 1
            s = stage_of[r]
            if kind == "F":
                if s + 1 < S:
                    r2 = executor[u][s + 1]
                    seq += 1
                    heapq.heappush(events, (now + tr[s], seq, 1, r2, u + it_of[r] * U, "F"))
                else:
                    heapq.heappush(readyB[r], (key[u], u))
            elif kind == "B":
                mem[r] -= bfree[r]
                inflight[r] -= 1
                if decoupled:
                    readyW[r].append(u)
                if s > 0:
                    r2 = executor[u][s - 1]
                    seq += 1
                    heapq.heappush(events, (now + tr[s - 1], seq, 1, r2, u, "B"))
                if iterations > 1:
                    op_ended(r, s, not decoupled)
                continue
            else:
                mem[r] -= stash[r]
                if iterations > 1:
                    op_ended(r, s, True)
                continue
            if iterations > 1:
                op_ended(r, s, False)
    per_round = []
    for programs, order in rounds:
        per_round.append(({g.rank: programs[g.rank] for g in inst.gpus if g.live}, order))
    codes, order = per_round[0]
    return ListResult(instance=inst, codes=codes, order=order, makespan=now, relaxed=relaxed,
                      rounds=tuple(per_round) if iterations > 1 else ())
