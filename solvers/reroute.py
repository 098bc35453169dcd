"""`reroute-1f1b`: 1F1B with a failed GPU's microbatches re-routed to its peers (docs/baselines.md).

Each failed GPU's microbatches are dealt round-robin to the live GPUs of its
stage; the other stages of that pipeline keep running on their own GPUs.
Every GPU then runs 1F1B over all the microbatches it executes, ordered by
microbatch index then pipeline: forwards strictly in that order, at most
S - s in flight (fewer if memory says so), a ready backward before a
forward. As the field runs it: full backward, global optimizer barrier.
"""

from __future__ import annotations

import time

from schedc.instance import Instance
from schedc.schedule import OpId, Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.assign import microbatch_key, round_robin
from schedc.solvers.common import barrier_instance, check_memory, check_stages_live, finish, fits_in_flight
from schedc.solvers.listsched import Policy, list_schedule

NAME = "reroute-1f1b"
POLICY = Policy(name="1f1b", kinds=("W", "B", "F"), strict_forward=True)


def one_f_one_b_caps(instance: Instance) -> list[int]:
    """Per rank: the 1F1B warm-up S - s, capped by memory."""
    return [min(instance.pp - g.pp, fits_in_flight(instance, g.rank)) if g.live else 0
            for g in instance.gpus]


def reroute_programs(instance: Instance) -> tuple[dict[int, list[OpId]], bool]:
    """The compute programs of reroute-1f1b on `instance` (whatever its options say)."""
    res = list_schedule(instance, round_robin(instance), microbatch_key(instance),
                        one_f_one_b_caps(instance), POLICY)
    return res.programs, res.relaxed


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """Re-routed 1F1B; E315 if a stage has no live GPU, E310 if one microbatch does not fit."""
    started = time.perf_counter()
    inst = barrier_instance(instance)
    check_stages_live(inst, solver=NAME)
    check_memory(inst, solver=NAME)
    programs, relaxed = reroute_programs(inst)
    detail = f"{len(inst.failed_gpus)} failed GPU(s) re-routed round-robin to peers"
    if relaxed:
        detail += "; 1F1B order relaxed to avoid a deadlock"
    return finish(inst, programs, NAME, started, detail=detail)
