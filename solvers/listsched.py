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

#: Code slot (op code % 3) of each kind a policy may prefer.
_KIND_SLOT = {"F": 0, "B": 1, "W": 2}


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

    readyF: list[list[int]] = [[] for _ in range(n_ranks)]
    readyB: list[list[int]] = [[] for _ in range(n_ranks)]
    readyW: list[deque] = [deque() for _ in range(n_ranks)]
    mem = [0] * n_ranks
    inflight = [0] * n_ranks
    busy = [False] * n_ranks
    cap = list(caps)
    strict = policy.strict_forward
    prefer = tuple(_KIND_SLOT[k] for k in policy.kinds)
    steady = iterations > 1
    rounds: list[tuple[list[list[int]], list[int]]] = [
        ([[] for _ in range(n_ranks)], []) for _ in range(iterations)]
    programs_now = [rounds[0][0][r] for r in range(n_ranks)]  # each rank's program this iteration
    order_now = [rounds[0][1]] * n_ranks  # the start order of the iteration each rank works on
    push, pop = heapq.heappush, heapq.heappop

    # Events: (time, seq, what, rank, u); what: an op ended (0 F, 1 B, 2 W, 3 O) or an input
    # arrived (4 a forward's, 5 a backward's). `seq` orders events of one time in the order they
    # were made (so the rest of a tuple is never compared).
    remaining = iterations * U * S * (3 if decoupled else 2)
    events: list[tuple[int, int, int, int, int]] = []
    seq = 0
    # Ready ops as one int each, key[u] * U + u: ordered as (key[u], u) (0 <= u < U).
    kv = [key[u] * U + u for u in range(U)]
    for u in range(U):
        push(readyF[executor[u][0]], kv[u])
    relaxed = False
    now = 0
    touched = set(executor[u][0] for u in range(U))

    def op_ended(r: int, s: int, last: bool) -> None:
        """Count an ended op of rank r's iteration towards its O and its group's barrier."""
        ops_left[r] -= 1
        if last:
            grp, left = group[s], group_left[it_of[r]]
            left[grp] -= 1
            if left[grp] == 0:
                touched.update(members[grp])

    while True:
        # An idle GPU starts one of its ready ops, the policy's preferred kind first (ranks in
        # order, so that events of one time are made in a fixed order).
        for r in sorted(touched) if len(touched) > 1 else touched:
            if busy[r]:
                continue
            if steady and ops_left[r] == 0:
                # Every op of this iteration ended: step the optimizer once the barrier is reached.
                it = it_of[r]
                if not stepping[r] and group_left[it][group[stage_of[r]]] == 0 and it + 1 < iterations:
                    stepping[r] = busy[r] = True
                    seq += 1
                    push(events, (now + durO[r], seq, 3, r, -1))
                continue
            for k in prefer:
                if k == 1:
                    if not readyB[r]:
                        continue
                    u = pop(readyB[r]) % U
                    dur = durB[r]
                elif k == 2:
                    if not readyW[r]:
                        continue
                    u = readyW[r].popleft()
                    dur = durW[r]
                else:
                    heap = readyF[r]
                    if not heap or inflight[r] >= cap[r] or mem[r] + act[r] > limit[r]:
                        continue
                    if strict:
                        # Forwards start in key order, so the next one is f_seq[r][f_ptr[r]].
                        if heap[0] % U != f_seq[r][f_ptr[r]]:
                            continue
                        f_ptr[r] += 1
                    mem[r] += act[r]
                    inflight[r] += 1
                    u = pop(heap) % U
                    dur = durF[r]
                busy[r] = True
                c = (u * S + stage_of[r]) * 3 + k
                programs_now[r].append(c)
                order_now[r].append(c)
                seq += 1
                push(events, (now + dur, seq, k, r, u))
                break
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
            _, _, what, r, u = pop(events)
            touched.add(r)
            if what == 4:  # a forward's input arrived (u counts iterations: u // U)
                if it_of[r] == u // U:
                    push(readyF[r], kv[u % U])
                else:
                    pending[r].append(u % U)
                continue
            if what == 5:
                push(readyB[r], kv[u])
                continue
            busy[r] = False
            if what == 3:
                # The next iteration: its first forwards, and those that arrived meanwhile.
                stepping[r] = False
                it = it_of[r] = it_of[r] + 1
                programs_now[r] = rounds[it][0][r]
                order_now[r] = rounds[it][1]
                ops_left[r] = n_ops[r]
                f_ptr[r] = 0
                for v in firsts[r] if stage_of[r] == 0 else ():
                    push(readyF[r], kv[v])
                for v in pending[r]:
                    push(readyF[r], kv[v])
                pending[r] = []
                continue
            remaining -= 1
            s = stage_of[r]
            if what == 0:
                if s + 1 < S:
                    seq += 1
                    push(events, (now + tr[s], seq, 4, executor[u][s + 1], u + it_of[r] * U))
                else:
                    push(readyB[r], kv[u])
                if steady:
                    op_ended(r, s, False)
            elif what == 1:
                mem[r] -= bfree[r]
                inflight[r] -= 1
                if decoupled:
                    readyW[r].append(u)
                if s > 0:
                    seq += 1
                    push(events, (now + tr[s - 1], seq, 5, executor[u][s - 1], u))
                if steady:
                    op_ended(r, s, not decoupled)
            else:
                mem[r] -= stash[r]
                if steady:
                    op_ended(r, s, True)
    per_round = []
    for programs, order in rounds:
        per_round.append(({g.rank: programs[g.rank] for g in inst.gpus if g.live}, order))
    codes, order = per_round[0]
    return ListResult(instance=inst, codes=codes, order=order, makespan=now, relaxed=relaxed,
                      rounds=tuple(per_round) if iterations > 1 else ())
