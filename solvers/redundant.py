"""`redundant`: Bamboo-style redundant computation (Thorpe et al., NSDI 2023) (docs/baselines.md).

Each GPU (d, s) also holds a copy of the next stage's layers (the last stage:
stage 0's) and, every iteration, runs their forward on each of its
pipeline's microbatches: an R op (`Instance.redundant_forward`). R takes the
output of the GPU's own F (the last stage's copy takes the microbatch's
input), keeps the copy's activation until the microbatch's own B on this GPU
(what a holder needs to take over with the microbatch in flight), and must
end before that B. As in Bamboo, R runs eagerly in the pipeline's bubbles:
the list scheduler below starts one whenever its GPU has no F or B to run,
and only when a B is waiting for it does R delay real work. The copy costs
its weights and optimizer state in memory (`static` of the next stage); the
redundant backward is lazy (only after a failure), so it costs nothing here.

When GPU (d, s) fails, its holder (d, s - 1) runs stage s's F and B for
pipeline d itself, next to its own (it has the layers), and its optimizer
step covers both stages. Work never moves to another pipeline. If a failed
GPU's holder failed too, nothing holds its stage: E314. Full backward and a
global optimizer barrier, as Bamboo runs (on DeepSpeed's 1F1B pipeline).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import replace

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.opgraph import candidate_executors
from schedc.schedule import OpId, Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import barrier_instance, finish, fmt_bytes, gpu_name

NAME = "redundant"


def redundant_instance(instance: Instance) -> Instance:
    """The instance Bamboo runs (see the module docstring); E314 when a failed stage has no copy."""
    inst = barrier_instance(instance)
    S = inst.pp
    lost = [g for g in inst.failed_gpus if S == 1 or not inst.holder(g.dp, g.pp).live]
    if lost:
        diags = []
        for g in lost:
            if S == 1:
                msg = (f"redundant: GPU (dp={g.dp}, pp={g.pp}) failed and a one-stage pipeline "
                       "has no neighbour holding a copy of it")
            else:
                h = inst.holder(g.dp, g.pp)
                msg = (f"redundant: GPU (dp={g.dp}, pp={g.pp}) failed and so did its holder "
                       f"GPU (dp={h.dp}, pp={h.pp}), the only one with a copy of stage {g.pp}")
            diags.append(error("E314", msg, hint="use `solver = reroute-1f1b`, `greedy` or "
                               "`cpsat`, which move the stage's work to other pipelines"))
        raise InfeasibleError(diags)
    if S == 1:
        return inst
    stages = tuple(replace(c, static=c.static + inst.stages[(s + 1) % S].static)
                   for s, c in enumerate(inst.stages))
    return replace(inst, stages=stages, redundant_forward=True)


def _check_room(inst: Instance) -> dict[int, int]:
    """Bytes each live GPU has beside its static memory; E310 where one microbatch in flight
    through every stage it runs (a holder runs two) does not fit with its redundant forward's
    activation."""
    room: dict[int, int] = {}
    diags = []
    for g in inst.live_gpus():
        room[g.rank] = inst.gpu_memory - inst.stages[g.pp].static
        stages = inst.redundant_stages(g.rank)
        need = sum(_held(inst, g.dp, s) for s in stages)
        if need > room[g.rank]:
            static = inst.stages[g.pp].static
            which = " and ".join(map(str, sorted(stages)))
            diags.append(error(
                    "E310", f"redundant: {gpu_name(inst, g.rank)} cannot hold one microbatch of stage "
                            f"{which}: it needs static {fmt_bytes(static)} (its stage's and the copy's) + "
                            f"{fmt_bytes(need)} in flight (the activation and the redundant forward's) "
                            f"= {fmt_bytes(static + need)}, gpu.memory is {fmt_bytes(inst.gpu_memory)} "
                            f"({fmt_bytes(static + need - inst.gpu_memory)} short)",
                    hint="raise `gpu.memory`, or use a solver without redundant computation"))
    if diags:
        raise InfeasibleError(diags)
    return room


def _held(inst: Instance, d: int, s: int) -> int:
    """Bytes one microbatch of pipeline d holds at stage s from its F to its B: its activation
    and, where the GPU runs R, the copy's (reserved at F, so an R is never stuck for memory)."""
    extra = inst.stages[inst.shadowed(s)].activation if inst.runs_redundant(d, s) else 0
    return inst.stages[s].activation + extra


def bamboo_programs(inst: Instance) -> dict[int, list[OpId]]:
    """The op order of every live GPU: 1F1B per pipeline with R in the bubbles.

    An event-driven list scheduler. An idle GPU starts, in this order of preference: a B whose
    gradient has arrived (its R first, if that has not run), an F whose input has arrived, while
    the pipeline's microbatches in flight at that stage stay within 1F1B's S - s and memory
    allows, and else an R whose F has run (the bubble). Ties go to the lower microbatch. Data
    crosses every stage boundary with its transfer time, even to the same GPU.
    """
    S, M = inst.pp, inst.microbatches
    room = _check_room(inst)
    exe = {(d, s): candidate_executors(inst, d, s)[0] for d in range(inst.dp) for s in range(S)}
    # Per GPU: the (pipeline, stage) pairs it runs (a holder: two).
    serves: dict[int, list[tuple[int, int]]] = {g.rank: [] for g in inst.live_gpus()}
    for (d, s), r in exe.items():
        serves[r].append((d, s))
    arrived: dict[OpId, int] = {}  # op -> time its input is there
    done: set[OpId] = set()
    next_f = {(d, s): 0 for (d, s) in exe}  # next microbatch to forward (in order)
    in_flight = {(d, s): 0 for (d, s) in exe}
    used = dict.fromkeys(room, 0)
    reserved: set[tuple[int, int, int]] = set()  # (d, s, m) whose bytes are counted in `used`
    free_at = dict.fromkeys(room, 0)
    programs: dict[int, list[OpId]] = {r: [] for r in room}
    # (time, seq, kind, d, s, m): an op of `kind` ends, or ("arrive") an input reaches (d, s)'s GPU
    events: list[tuple[int, int, str, int, int, int]] = []
    seq = 0
    for d in range(inst.dp):
        for m in range(M):
            arrived[OpId("F", d, 0, m)] = 0
            if inst.runs_redundant(d, S - 1):
                arrived[OpId("R", d, S - 1, m)] = 0
    remaining = len(exe) * M * 2 + sum(M for d, s in exe if inst.runs_redundant(d, s))  # F, B, R

    def ready(op: OpId, t: int) -> bool:
        return op not in done and arrived.get(op, t + 1) <= t

    def pick(r: int, t: int) -> OpId | None:
        best_r = None
        for d, s in serves[r]:
            for m in range(M):
                b = OpId("B", d, s, m)
                if ready(b, t):
                    rop = OpId("R", d, s, m)
                    if inst.runs_redundant(d, s) and rop not in done:
                        return rop if ready(rop, t) else None
                    return b
        for d, s in serves[r]:
            m = next_f[(d, s)]
            f = OpId("F", d, s, m) if m < M else None
            if (f is not None and ready(f, t) and in_flight[(d, s)] < max(1, S - s)
                    and fits(r, d, s, m)):
                return f
        for d, s in serves[r]:
            if not inst.runs_redundant(d, s):
                continue
            for m in range(M):
                rop = OpId("R", d, s, m)
                if ready(rop, t) and fits(r, d, s, m) and (best_r is None or m < best_r.mb):
                    best_r = rop
        return best_r

    def fits(r: int, d: int, s: int, m: int) -> bool:
        """Whether microbatch m may take its bytes at stage s on GPU r. A holder also keeps room
        for one microbatch of the later stage it runs, else its forwards at the earlier stage
        could fill its memory while that stage's work waits for room: a deadlock."""
        if (d, s, m) in reserved:
            return True
        later = sum(_held(inst, e, u) for e, u in serves[r] if e == d and u > s)
        return used[r] + _held(inst, d, s) + later <= room[r]

    def dispatch(r: int, t: int) -> None:
        nonlocal seq
        if free_at[r] > t:
            return
        op = pick(r, t)
        if op is None:
            return
        if op.kind == "F":
            next_f[(op.dp, op.pp)] += 1
            in_flight[(op.dp, op.pp)] += 1
        if op.kind in ("F", "R") and (op.dp, op.pp, op.mb) not in reserved:
            # The first of F and R (the last stage's R needs no F) reserves both activations.
            reserved.add((op.dp, op.pp, op.mb))
            used[r] += _held(inst, op.dp, op.pp)
        done.add(op)
        programs[r].append(op)
        end = t + inst.duration(op.kind, op.pp, r)
        free_at[r] = end
        seq += 1
        heapq.heappush(events, (end, seq, op.kind, op.dp, op.pp, op.mb))

    def arrive(op: OpId, when: int) -> None:
        """`op`'s input is there at `when`: wake its GPU then."""
        nonlocal seq
        arrived[op] = when
        seq += 1
        heapq.heappush(events, (when, seq, "arrive", op.dp, op.pp, -1))

    for r in sorted(room):
        dispatch(r, 0)
    while events:
        t, _, kind, d, s, m = heapq.heappop(events)
        r = exe[(d, s)]
        if kind == "arrive":
            dispatch(r, t)  # an input is there
            continue
        if kind == "F":
            remaining -= 1
            if s < S - 1:
                arrive(OpId("F", d, s + 1, m), t + inst.boundary_transfer(s))
            else:
                arrive(OpId("B", d, s, m), t)
            if inst.runs_redundant(d, s) and s < S - 1:
                arrive(OpId("R", d, s, m), t)
        elif kind == "B":
            remaining -= 1
            in_flight[(d, s)] -= 1
            used[r] -= _held(inst, d, s)
            reserved.discard((d, s, m))
            if s > 0:
                arrive(OpId("B", d, s - 1, m), t + inst.boundary_transfer(s - 1))
        elif kind == "R":
            remaining -= 1
        dispatch(r, t)  # the GPU is free (and, after a B, has memory back)
    if remaining:
        raise RuntimeError(f"redundant: the list scheduler stopped with {remaining} ops left")
    return programs


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """Bamboo's schedule (module docstring); E314 if a failed stage's copy is lost, E310 for
    memory."""
    started = time.perf_counter()
    inst = redundant_instance(instance)
    programs = bamboo_programs(inst)
    detail = ("every GPU also runs its successor stage's forward (the last stage: stage 0's) in "
              "its bubbles")
    if instance.failed_gpus:
        detail += "; each failed GPU's stage runs on its holder, the GPU before it in its pipeline"
    return finish(inst, programs, NAME, started, detail=detail)
