"""Who executes each microbatch at each stage: the placement half of a solver's job.

An executor table is `executor[u][s]`, the rank that runs F, B (and W) of
microbatch u = d*M + m at stage s. Every function here gives each microbatch
a live GPU of its own stage (docs/architecture.md, executors).
"""

from __future__ import annotations

import heapq

from schedc.instance import Instance
from schedc.opgraph import compute_kinds

Executor = list[list[int]]


def microbatch_key(instance: Instance) -> list[int]:
    """Order microbatches by index, then pipeline: (0,0), (1,0), ..., (0,1), ..."""
    D, M = instance.dp, instance.microbatches
    return [(u % M) * D + u // M for u in range(D * M)]


def round_robin(instance: Instance) -> Executor:
    """Each failed GPU's microbatches dealt in turn to the live peers of its stage (rank order).

    One counter per stage runs across all failed GPUs of that stage, so two
    failures spread over the peers rather than both landing on the first.
    """
    D, S, M = instance.dp, instance.pp, instance.microbatches
    ex: Executor = [[instance.gpu(u // M, s).rank for s in range(S)] for u in range(D * M)]
    for s in range(S):
        peers = [g.rank for g in instance.live_gpus(s)]
        turn = 0
        for m in range(M):
            for d in range(D):
                if not instance.gpu(d, s).live:
                    ex[d * M + m][s] = peers[turn % len(peers)]
                    turn += 1
    return ex


def balanced_counts(instance: Instance, s: int) -> dict[int, int]:
    """Microbatches per live GPU of stage s, proportional to speed (water-filling).

    A full-speed GPU keeps its own M (it cannot give work away, only take
    it); a slow or failed GPU's work goes, one microbatch at a time, to the
    GPU that would finish it soonest: the smallest (n + 1) / speed, ties to
    the lower rank. This ignores O and per-op rounding, so on slow GPUs it
    can differ by one microbatch from the exact earliest-completion counts
    behind `cpsat_bound.placement_bound` (`completion_counts`); as the only
    rule those made greedy's plans 0.4 % faster to 1.4 % slower on the bench's
    slow-GPU scenarios, so greedy tries both.
    """
    M = instance.microbatches
    live = instance.live_gpus(s)
    count = {g.rank: (M if g.speed >= 1.0 else 0) for g in live}
    speed = {g.rank: g.speed for g in live}
    pool = instance.dp * M - sum(count.values())
    for _ in range(pool):
        r = min(count, key=lambda r: ((count[r] + 1) / speed[r], r))
        count[r] += 1
    return count


def earliest_completion(instance: Instance, s: int, kinds: tuple[str, ...],
                        optimizer: bool = True) -> list[tuple[int, int, int]]:
    """(rank, microbatches, busy time) of every live GPU of stage s when each movable microbatch
    (all of a failed or slow GPU's; a full-speed GPU keeps its own M) goes to the GPU that would
    finish it soonest, ties to the lower rank. Busy time counts the `kinds` ops at each GPU's
    speed and, with `optimizer`, its O. For identical jobs on GPUs of different speeds this gives
    the smallest possible busiest GPU: the k-th job takes the k-th smallest completion slot.

    Full-speed GPUs all start from the same slot, so with ties to the lower rank only the
    `pool` lowest-ranked of them can take anything: the others stay out of the heap (a stage of
    thousands with one failure costs a heap of M entries, not thousands)."""
    M = instance.microbatches
    w_full = sum(instance.base_duration(k, s) for k in kinds)
    o_full = instance.base_duration("O", s) if optimizer else 0
    live = instance.live_gpus(s)
    full = [g.rank for g in live if g.speed >= 1.0]
    pool = (instance.dp - len(full)) * M
    slots = [(o_full + (M + 1) * w_full, r, w_full, M) for r in full[:pool]]
    for g in live:  # slots: (busy after one more microbatch, rank, per microbatch, microbatches)
        if g.speed < 1.0:
            w = sum(instance.duration(k, s, g.rank) for k in kinds)
            slots.append(((instance.duration("O", s, g.rank) if optimizer else 0) + w, g.rank, w, 0))
    heapq.heapify(slots)
    for _ in range(pool if slots else 0):
        after, r, w, n = heapq.heappop(slots)
        heapq.heappush(slots, (after + w, r, w, n + 1))
    untouched = o_full + M * w_full
    return [(r, n, after - w) for after, r, w, n in slots] + [(r, M, untouched) for r in full[pool:]]


def completion_counts(instance: Instance, s: int) -> dict[int, int]:
    """Microbatches per live GPU of stage s by earliest completion, O and rounding included
    (`earliest_completion`): the counts behind `cpsat_bound.placement_bound`, which give the
    smallest possible busiest GPU."""
    return {r: n for r, n, _ in earliest_completion(instance, s, compute_kinds(instance))}


def balanced(instance: Instance, keep: str = "spread", counts=balanced_counts) -> Executor:
    """Speed-weighted placement: failed GPUs' microbatches and a slow GPU's surplus move to peers.

    A slow GPU keeps `counts(instance, s)` of its own microbatches: with `keep` "spread" evenly
    spaced over the iteration (so the peers' extra work is spread too), "first" its first ones
    (it gives away its last), "last" its last ones (it gives away its first, so it starts late:
    right when its optimizer step, slow too, would otherwise hold up the pipeline's next
    iteration). The moved microbatches, in (m, d) order, go to the GPUs with room left, in turns.
    """
    D, S, M = instance.dp, instance.pp, instance.microbatches
    ex: Executor = [[instance.gpu(u // M, s).rank for s in range(S)] for u in range(D * M)]
    for s in range(S):
        count = counts(instance, s)
        pool: list[tuple[int, int]] = []  # (m, d) of microbatches to move
        room = dict(count)
        for d in range(D):
            g = instance.gpu(d, s)
            if not g.live:
                pool.extend((m, d) for m in range(M))
                continue
            kept_n = min(M, count[g.rank])
            room[g.rank] -= kept_n
            if kept_n == M:
                continue
            if keep == "spread":
                kept = {int(i * M / kept_n) for i in range(kept_n)} if kept_n else set()
            elif keep == "first":
                kept = set(range(kept_n))
            else:
                kept = set(range(M - kept_n, M))
            pool.extend((m, d) for m in range(M) if m not in kept)
        pool.sort()
        takers = [r for r in sorted(room) if room[r] > 0]
        i = 0
        for m, d in pool:
            while room[takers[i % len(takers)]] == 0:
                i += 1
            r = takers[i % len(takers)]
            room[r] -= 1
            ex[d * M + m][s] = r
            i += 1
    return ex
