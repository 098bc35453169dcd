"""Lower bounds on the steady-state period beyond `Instance.lower_bound`, for the CP-SAT planner.

Two bounds, each valid for every schedule of the instance:

- `chain_bound`: the round trip from a stage through the busiest GPU of a
  later stage and back (below);
- `placement_bound`: the busiest GPU once whole microbatches are placed
  (see its docstring).

Both rest on one fact: in the steady state every GPU runs one iteration's
ops between its first op and its O, and the next iteration starts after that
O, so the period is at least any GPU's span in one iteration.

The chain bound:

`Instance.lower_bound` (docs/architecture.md, the simulator) counts work per stage only. It misses
what limits most pipelines in practice: a GPU's iteration spans from its
first op to its O, and between those its stage's microbatches must travel
down the pipeline, queue through a downstream stage, and come back.

Take stages a <= b. Let T be the earliest first start of any live GPU of
stage a, and g a GPU that starts then. Every F of stage a runs on a GPU of
stage a, so it starts at or after T, and every F of stage b at or after
T + fwd(a -> b) (F durations and transfers, on the fastest live GPU of each
stage between). Stage b's GPUs then run every microbatch's F and B, each GPU
one op at a time, so some GPU h of stage b ends its last B at or after
T + fwd(a -> b) + load(h), where load(h) is its microbatches' F + B time.
Whatever the placement, the busiest GPU's load is at least the smallest
largest load over all placements (`_least_largest_load`: a live GPU at
full speed keeps its own pipeline's M microbatches; a failed or slow GPU's
may go to any live GPU of the stage). That microbatch's B reaches stage a
after back(b -> a), then its W runs, then g's O waits for every W of stage a
(with a staggered optimizer; every W of every stage without). So g's span,
and with it the period, is at least

    fwd(a -> b) + least largest F + B load at b + back(b -> a) + W_a + O_a.

With a global optimizer barrier (no staggering) every iteration also fills
and drains the pipeline: every op of stage b starts at or after
T + fwd(a -> b), h runs all its F, B (and W) before the barrier, and g's O
comes after it. So the period is also at least
fwd(a -> b) + least largest F + B + W load at b + O_a.
On the Zero Bubble grid (bench/zero_bubble_grid.py, p = 4, m = 8, F = B = W
= 1 ms, 10 us) it is 27.03 ms where the work bound says 24 ms, and greedy's
plan reaches it: proven optimal. Durations of a and b's neighbours, W_a and
O_a are the fastest live GPU's, so the bound holds whoever runs them.
With one GPU failed the busiest peer at stage b runs M + ceil(M / (D - 1))
microbatches of it, not M: on the bench's 4 x 4 x 8 explicit scenario with
GPU (1, 3) failed that is 43.452 ms (greedy's plan, now proven optimal)
where the pipeline's own round trip said 41.1 ms.

Fewer GPUs on the way. A full-speed live GPU keeps its own pipeline's M
microbatches, so each of the k full-speed GPUs of stage b has at least
q = M x (F_b + B_b) of work, all of it after its first F. Their first
microbatches are k distinct microbatches; at a stage c in [a, b) with
n_c < k live GPUs, each running one F at a time, the i-th of them starts
its F at or after T + fwd(a -> c) + (ceil(i / n_c) - 1) F_c. Their last
microbatches (the one of each GPU's last B) are k distinct microbatches
too; at a stage c in (a, b) their B run on n_c GPUs, and at stage a their
B and W (on the same GPU) before g's O. So the GPU whose first microbatch
came last ends its last B at or after T + fwd(a -> b) + (ceil(k / n_c) - 1)
F_c + q; and all k end theirs at or after T + fwd(a -> b) + q, after which
some GPU of stage c runs ceil(k / n_c) of their B (stage a: B + W pairs)
one after another. The round trip grows by the larger of these turns:

    fwd(a -> b) + q + back(b -> a) + W_a + O_a + max over c of
        (ceil(k / n_c) - 1) x (F_c, or B_c, or B_a + W_a at c = a).

On the bench's explicit 4 x 4 x 8 scenario with GPUs (1, 0) and (1, 2)
failed, three GPUs of stage 0 serve four of stage 3: two B + W turns, 36.552
ms where the round trip said 34.752, and CP-SAT's best plan is 36.552 ms:
proven optimal. Without staggering, also fwd(a -> b) + (ceil(k / n_c) - 1)
F_c + M x (F_b + B_b + W_b) + O_a.
"""

from __future__ import annotations

import math

from schedc.instance import Instance
from schedc.memo import IdentityCache
from schedc.opgraph import compute_kinds
from schedc.solvers.assign import earliest_completion


def period_lower_bound(instance: Instance) -> int:
    """What a planner can prove before searching: the largest of `Instance.lower_bound` (work
    per stage, docs/architecture.md), `chain_bound` (a pipeline's round trip through its busiest stage)
    and `placement_bound` (the busiest GPU once whole microbatches are placed). Kept per instance
    object: greedy and cpsat both ask for it in one replan (0.4 ms each at 64 GPUs)."""
    known = _BOUNDS.get(instance)
    if known is None:
        known = max(0, math.ceil(instance.lower_bound - 1e-9), chain_bound(instance),
                    placement_bound(instance))
        _BOUNDS.put(instance, known)
    return known


_BOUNDS = IdentityCache(size=4)


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
    return max((_least_largest_load(instance, s, compute_kinds(instance), optimizer=True)
                for s in range(instance.pp)), default=0)


def chain_bound(instance: Instance) -> int:
    """Largest round-trip lower bound (microseconds) on any schedule's iteration time: the
    module docstring's bound over every pair of stages a <= b."""
    inst = instance
    S = inst.pp
    live = [inst.live_gpus(s) for s in range(S)]
    if not all(live):
        return 0  # E301: no schedule at all

    quickest = [max(live[s], key=lambda g: g.speed).rank for s in range(S)]

    def fastest(kind: str, s: int) -> int:
        return inst.duration(kind, s, quickest[s])

    tr = [inst.boundary_transfer(s) for s in range(S - 1)]
    M = inst.microbatches
    # Per stage: how many live GPUs run at full speed (each keeps its own M microbatches) and
    # the F + B (and F + B + W) time of those M: every such GPU's load is at least that.
    full = [sum(1 for g in live[s] if g.speed >= 1.0) for s in range(S)]
    n_live = [len(live[s]) for s in range(S)]
    f_fast = [fastest("F", s) for s in range(S)]
    b_fast = [fastest("B", s) for s in range(S)]
    w_fast = [fastest("W", s) if inst.decouple_backward else 0 for s in range(S)]
    queue = [_least_largest_load(inst, s, ("F", "B")) for s in range(S)]
    own_queue = [M * (inst.base_duration("F", s) + inst.base_duration("B", s)) for s in range(S)]
    work = ([_least_largest_load(inst, s, compute_kinds(inst)) for s in range(S)]
            if not inst.stagger_optimizer else None)
    own_work = [M * sum(inst.base_duration(k, s) for k in compute_kinds(inst)) for s in range(S)]
    best = 0
    for a in range(S):
        tail = fastest("O", a) + w_fast[a]
        fwd = back = 0
        for b in range(a, S):
            if b > a:
                fwd += f_fast[b - 1] + tr[b - 1]
                back += tr[b - 1] + b_fast[b - 1]
            best = max(best, fwd + queue[b] + back + tail)
            if b > a and full[b] > 0:
                # Stage b's full-speed GPUs get their first microbatches through the stages
                # before it, and send their last ones back, in turns wherever a stage has
                # fewer live GPUs (module docstring, "fewer GPUs on the way").
                turns = [-(-full[b] // n_live[c]) - 1 for c in range(a, b)]
                head = max(t * f_fast[a + i] for i, t in enumerate(turns))
                extra = max(head, turns[0] * (b_fast[a] + w_fast[a]),
                            max((t * b_fast[a + i] for i, t in enumerate(turns) if i > 0), default=0))
                if extra:
                    best = max(best, fwd + own_queue[b] + back + tail + extra)
                if head and work is not None:
                    best = max(best, fwd + head + own_work[b] + fastest("O", a))
            if work is not None:
                best = max(best, fwd + work[b] + fastest("O", a))
    return best


def _least_largest_load(inst: Instance, s: int, kinds: tuple[str, ...], optimizer: bool = False) -> int:
    """The smallest possible largest time a live GPU of stage s spends on the `kinds` ops of its
    microbatches (and on its O with `optimizer`), over every placement `candidate_executors`
    allows: the earliest-completion placement's busiest GPU (`assign.earliest_completion`).
    0 when the stage has no live GPU (E301)."""
    return max((busy for _, _, busy in earliest_completion(inst, s, kinds, optimizer)), default=0)
