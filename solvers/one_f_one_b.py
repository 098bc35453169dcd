"""`1f1b`: the standard one-forward-one-backward schedule (docs/baselines.md).

Stage s of each pipeline runs a warm-up of S - s forwards, then alternates
one backward and one forward, then drains its backwards. The warm-up is
capped by what fits in memory. Run as the field runs it: full backward (no
W) and a global optimizer barrier, whatever the spec asks.
"""

from __future__ import annotations

import time

from schedc.instance import Instance
from schedc.schedule import OpId, Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import barrier_instance, check_memory, finish, require_no_failures
from schedc.solvers.static_programs import chain_programs, chain_warmups

NAME = "1f1b"


def template_programs(instance: Instance, style: str) -> dict[int, list[OpId]]:
    """One chain per pipeline, each over its own microbatches in order."""
    programs: dict[int, list[OpId]] = {}
    units_of = [[(d, m) for m in range(instance.microbatches)] for d in range(instance.dp)]
    for d in range(instance.dp):
        chain = [instance.gpu(d, s).rank for s in range(instance.pp)]
        programs.update(chain_programs(instance, chain, units_of[d], style))
    return programs


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """1F1B per pipeline; E311 with failed GPUs, E310 if one microbatch does not fit."""
    started = time.perf_counter()
    inst = barrier_instance(instance)
    require_no_failures(inst, solver=NAME)
    check_memory(inst, solver=NAME)
    programs = template_programs(inst, "1f1b")
    warm = chain_warmups(inst, [inst.gpu(0, s).rank for s in range(inst.pp)], inst.microbatches)
    capped = [s for s, k in enumerate(warm) if k < min(inst.pp - s, inst.microbatches)]
    detail = "warm-up S - s forwards per stage"
    if capped:
        detail += f"; capped by memory at stages {capped} (warm-up {warm})"
    return finish(inst, programs, NAME, started, detail=detail)
