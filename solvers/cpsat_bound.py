"""Lower bounds on the steady-state period beyond `Instance.lower_bound`, for the CP-SAT planner.

Two bounds, each valid for every schedule of the instance:

- `chain_bound`: a pipeline's round trip through its busiest stage (below);
- `placement_bound`: the busiest GPU once whole microbatches are placed
  (see its docstring).

The chain bound:

`Instance.lower_bound` (docs/architecture.md, the simulator) counts work per stage only. It misses
what limits most pipelines in practice: a GPU's iteration spans from its
first op to its O, and between those it must wait for its microbatches to
travel down the pipeline, queue through a downstream stage, and come back.

For a pipeline d whose GPUs g (stage a) and h (stage b >= a) are the only
candidates for (d, a) and (d, b) (live and at full speed, so every
microbatch of d runs there, `candidate_executors`):

- every F(d, m, a) starts at or after g's first start f_g, so every F(d, m, b)
  starts at or after f_g + fwd(a -> b) (F durations and transfers);
- h runs all M forwards and M backwards of d at stage b, one at a time, each
  B after its own F: the last of them ends at or after
  f_g + fwd(a -> b) + M * (F_b + B_b);
- that microbatch's B reaches stage a after back(b -> a) (transfers and B
  durations), then its W runs on g, then g's O (which waits for every W of
  its stage).

So g's span, and with it the period (the steady state's iteration is a
one-iteration schedule whose spans are at most its period; docs/planner.md),
is at least the sum.

With a global optimizer barrier (no staggering) every iteration also fills
and drains the pipeline: h's first F of an iteration starts at least
fwd(a -> b) after g's, h then runs all its F, B (and W) of d before the
barrier, and g's next iteration starts only after the barrier and g's own O.
So the period is also at least fwd(a -> b) + M * (F_b + B_b + W_b) + O_a.
On the Zero Bubble grid (bench/zero_bubble_grid.py, p = 4, m = 8, F = B = W
= 1 ms, 10 us) it is 27.03 ms where the work bound says 24 ms, and greedy's
plan reaches it: proven optimal. Chain ops between a and b may run on any candidate; the
fastest one's duration is used. Re-routed work that lands on g or h only
lengthens the span, so the bound holds whatever the placement.
"""

from __future__ import annotations

import heapq
import math

from schedc.instance import Instance
from schedc.opgraph import compute_kinds


def period_lower_bound(instance: Instance) -> int:
    """What a planner can prove before searching: the largest of `Instance.lower_bound` (work
    per stage, docs/architecture.md), `chain_bound` (a pipeline's round trip through its busiest stage)
    and `placement_bound` (the busiest GPU once whole microbatches are placed)."""
    return max(0, math.ceil(instance.lower_bound - 1e-9), chain_bound(instance),
               placement_bound(instance))


def placement_bound(instance: Instance) -> int:
    """Smallest possible busy time of the busiest GPU (microseconds): a lower bound on the period.

    Every iteration each live GPU runs all of its ops one at a time, so the
    period is at least any GPU's busy time. The per-stage work bound spreads a stage's work
    over its live GPUs as if it were fluid; here it moves in whole
    microbatches, under `candidate_executors`' rule: a live GPU at full speed
    keeps its own pipeline's M microbatches, a failed or slow GPU's M may go
    to any live GPU of the stage (the slow one included). Each such
    microbatch goes to the GPU that would finish it soonest: for identical
    jobs on machines of different speeds this earliest-completion rule gives
    the smallest largest load (the k-th job takes the k-th smallest of all
    completion slots, and each GPU's slots increase). Examples: 32
    microbatches on 3 live GPUs take 11 on one of them, not 10.67; a GPU at
    speed 0.5 among 3 at full speed cannot take exactly its share.
    """
    inst = instance
    kinds = compute_kinds(inst)
    M = inst.microbatches
    pool = [0] * inst.pp  # microbatches of stage s that may go to any live GPU of it
    slots: list[list[tuple[int, int, int]]] = [[] for _ in range(inst.pp)]
    for g in inst.gpus:
        # slots[s]: (load after one more microbatch, per-microbatch time, load now)
        s = g.pp
        if not g.live or g.speed < 1.0:
            pool[s] += M
        if not g.live:
            continue
        w = sum(inst.duration(k, s, g.rank) for k in kinds)
        load = inst.duration("O", s, g.rank) + (M * w if g.speed >= 1.0 else 0)
        slots[s].append((load + w, w, load))
    best = 0
    for s in range(inst.pp):
        heap = slots[s]
        if not heap:
            continue  # no live GPU: E301, no schedule at all
        heapq.heapify(heap)
        for _ in range(pool[s]):
            after, w, _ = heapq.heappop(heap)
            heapq.heappush(heap, (after + w, w, after))
        best = max(best, max(load for _, _, load in heap))
    return best


def chain_bound(instance: Instance) -> int:
    """Largest pipeline-chain lower bound (microseconds) on any schedule's iteration time.

    0 when no pipeline has a GPU whose work cannot move. Pipelines with the
    same forced GPUs and speeds have the same bound, so each pattern is
    computed once (thousands of pipelines at scale).
    """
    inst = instance
    S = inst.pp
    # An unforced (d, s) may run on any live GPU of stage s (candidate_executors: a failed
    # GPU's live peers, or a slow GPU and its peers), so the fastest of them bounds its chain.
    live = [inst.live_gpus(s) for s in range(S)]
    if not all(live):
        return 0
    fastest = [max(live[s], key=lambda g: g.speed).rank for s in range(S)]
    min_f = [inst.duration("F", s, fastest[s]) for s in range(S)]
    min_b = [inst.duration("B", s, fastest[s]) for s in range(S)]
    best = 0
    seen: set[tuple] = set()
    for d in range(inst.dp):
        # candidate_executors' rule, without its per-call scan of the stage: a live GPU at
        # full speed is the only candidate for its own work.
        own = [inst.gpu(d, s) for s in range(S)]
        forced = [g.rank if g.live and g.speed >= 1.0 else None for g in own]
        key = tuple(None if r is None else inst.gpus[r].speed for r in forced)
        if key in seen:
            continue
        seen.add(key)
        best = max(best, _pipeline_bound(inst, forced, min_f, min_b))
    return best


def _pipeline_bound(inst: Instance, forced: list[int | None], min_f: list[int],
                    min_b: list[int]) -> int:
    """Max over stage pairs a <= b, both forced, of g's round trip through h (module docstring)."""
    S, M = inst.pp, inst.microbatches
    tr = [inst.boundary_transfer(s) for s in range(S - 1)]
    best = 0
    for a in range(S):
        g = forced[a]
        if g is None:
            continue
        tail = inst.duration("O", a, g)
        if inst.decouple_backward:
            tail += inst.duration("W", a, g)
        fwd = back = 0
        for b in range(a, S):
            if b > a:
                fwd += min_f[b - 1] + tr[b - 1]
                back += tr[b - 1] + min_b[b - 1]
            h = forced[b]
            if h is None:
                continue
            queue = M * (inst.duration("F", b, h) + inst.duration("B", b, h))
            best = max(best, fwd + queue + back + tail)
            if not inst.stagger_optimizer:
                # The fill a global barrier forces (module docstring): h starts its iteration
                # `fwd` after g, runs all its work, then every O waits for the barrier.
                work = queue + (M * inst.duration("W", b, h) if inst.decouple_backward else 0)
                best = max(best, fwd + work + inst.duration("O", a, g))
    return best
