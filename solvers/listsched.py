"""An event-driven list scheduler: the engine of `reroute-1f1b` and `greedy`.

Given an executor for every microbatch at every stage and a policy, it plays
one iteration forward in time: whenever a GPU is idle it starts one of the
ops that are ready on it (their inputs have arrived), chosen by the policy,
and never starts a forward that would take the GPU over its memory. The
order in which each GPU started its ops is its program; `schedc.timing`
then times it (as early as allowed) and runs it back to back.

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
from schedc.timing import decode


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
    """Programs as op codes (`schedc.timing.encode`), compute ops only, per live rank."""

    instance: Instance
    codes: dict[int, list[int]]
    order: list[int]  # every op code in the order it was started (a topological order)
    makespan: int  # of the one iteration played
    relaxed: bool  # the policy's limits had to be dropped to avoid a deadlock

    @property
    def programs(self) -> dict[int, list[OpId]]:
        return decode(self.instance, self.codes)


def list_schedule(instance: Instance, executor: Sequence[Sequence[int]], key: Sequence[int],
                  caps: Sequence[int], policy: Policy) -> ListResult:
    """Play one iteration. `executor[u][s]` is the rank that runs microbatch u = d*M + m at
    stage s; `key[u]` orders microbatches (smaller first); `caps[rank]` bounds how many
    microbatches a rank holds between the start of F and the end of B.
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

    readyF: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
    readyB: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
    readyW: list[deque] = [deque() for _ in range(n_ranks)]
    mem = [0] * n_ranks
    inflight = [0] * n_ranks
    busy = [False] * n_ranks
    cap = list(caps)
    strict = policy.strict_forward
    kinds = policy.kinds
    programs: list[list[int]] = [[] for _ in range(n_ranks)]
    order: list[int] = []

    # Events: (time, seq, what, rank, u, kind). what 0 = an op ended, 1 = an input arrived.
    events: list[tuple[int, int, int, int, int, str]] = []
    seq = 0
    for u in range(U):
        r = executor[u][0]
        heapq.heappush(readyF[r], (key[u], u))
    remaining = U * S * (3 if decoupled else 2)
    relaxed = False
    now = 0
    touched = set(executor[u][0] for u in range(U))

    def start(r: int, t: int, u: int, kind: str, k: int, dur: int) -> None:
        """Start op `kind` (code offset `k`) of microbatch `u` on rank `r` at time `t`."""
        nonlocal seq
        busy[r] = True
        c = (u * S + stage_of[r]) * 3 + k
        programs[r].append(c)
        order.append(c)
        seq += 1
        heapq.heappush(events, (t + dur, seq, 0, r, u, kind))

    def dispatch(r: int, t: int) -> None:
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
                    heapq.heappush(readyF[r], (key[u], u))
                else:
                    heapq.heappush(readyB[r], (key[u], u))
                continue
            busy[r] = False
            remaining -= 1
            s = stage_of[r]
            if kind == "F":
                if s + 1 < S:
                    r2 = executor[u][s + 1]
                    seq += 1
                    heapq.heappush(events, (now + tr[s], seq, 1, r2, u, "F"))
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
            else:
                mem[r] -= stash[r]
    codes = {g.rank: programs[g.rank] for g in inst.gpus if g.live}
    return ListResult(instance=inst, codes=codes, order=order, makespan=now, relaxed=relaxed)
