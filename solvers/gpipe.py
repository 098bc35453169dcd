"""`gpipe`: every forward, then every backward, per pipeline (docs/baselines.md).

All M microbatches of a pipeline are in flight at once, so every GPU must
hold its weights plus M activations; otherwise E312 says how many fit and
suggests `1f1b`. Full backward and a global optimizer barrier, as the field
runs it.
"""

from __future__ import annotations

import time

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.schedule import Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import (barrier_instance, check_memory, finish, fits_in_flight, fmt_bytes,
                            gpu_name, require_no_failures)
from schedc.solvers.one_f_one_b import template_programs

NAME = "gpipe"


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """GPipe per pipeline; E311 with failed GPUs, E312 if M microbatches do not fit."""
    started = time.perf_counter()
    inst = barrier_instance(instance)
    require_no_failures(inst, solver=NAME)
    check_memory(inst, solver=NAME)
    M = inst.microbatches
    diags = []
    for s in range(inst.pp):
        rank = inst.gpu(0, s).rank  # fault-free: every GPU of a stage has the same memory need
        fit = fits_in_flight(inst, rank)
        if fit < M:
            st = inst.stages[s]
            need = st.static + M * st.activation
            diags.append(error(
                "E312",
                f"gpipe keeps all {M} microbatches in flight, but {gpu_name(inst, rank)} "
                f"(stage {s}) fits only {fit}: it needs static {fmt_bytes(st.static)} + "
                f"{M} x activation {fmt_bytes(st.activation)} = {fmt_bytes(need)}, "
                f"gpu.memory is {fmt_bytes(inst.gpu_memory)} (each microbatch more needs "
                f"{fmt_bytes(st.activation)})",
                hint=f"use `solver = 1f1b` (at most {inst.pp - s} in flight at stage {s}), "
                     f"use at most {fit} microbatches, or raise `gpu.memory`"))
    if diags:
        raise InfeasibleError(diags)
    return finish(inst, template_programs(inst, "gpipe"), NAME, started,
                  detail="all forwards, then all backwards")
