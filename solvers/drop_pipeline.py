"""`drop-pipeline`: pipelines with a failed GPU leave; the others split the global batch.

Oobleck / FT-HSDP style (docs/baselines.md). Every microbatch (d, m) of a
dropped pipeline is dealt, in (m, d) order and in turns, to one surviving
pipeline and runs on all of that pipeline's stages (it keeps its own
(d, m) identity; its executor at stage s is the surviving pipeline's GPU of
stage s). Each surviving pipeline runs 1F1B over its own and its adopted
microbatches in (m, d) order. The live GPUs of a dropped pipeline run only
their O: they stay in the stage's all-reduce and keep their weights in sync,
so the pipeline can rejoin as soon as its failed GPU is replaced. Full
backward, global optimizer barrier.
"""

from __future__ import annotations

import time

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.schedule import OpId, Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import barrier_instance, check_memory, finish
from schedc.solvers.static_programs import chain_programs

NAME = "drop-pipeline"


def surviving_pipelines(instance: Instance) -> list[int]:
    return [d for d in range(instance.dp)
            if all(instance.gpu(d, s).live for s in range(instance.pp))]


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """Drop pipelines with a failure, 1F1B on the rest; E313 if every pipeline has a failure."""
    started = time.perf_counter()
    inst = barrier_instance(instance)
    alive = surviving_pipelines(inst)
    if not alive:
        raise InfeasibleError([error(
            "E313", f"drop-pipeline: every one of the {inst.dp} pipelines has a failed GPU, "
                    "so none is left to run the batch",
            hint="use `solver = reroute-1f1b`, `greedy` or `cpsat`, which keep the live "
                 "GPUs of every pipeline working")])
    check_memory(inst, solver=NAME)
    M = inst.microbatches
    dropped = [d for d in range(inst.dp) if d not in alive]
    units: dict[int, list[tuple[int, int]]] = {d: [(d, m) for m in range(M)] for d in alive}
    turn = 0
    for m in range(M):
        for d in dropped:
            units[alive[turn % len(alive)]].append((d, m))
            turn += 1
    programs: dict[int, list[OpId]] = {}
    for d in alive:
        ordered = sorted(units[d], key=lambda u: (u[1], u[0]))
        chain = [inst.gpu(d, s).rank for s in range(inst.pp)]
        programs.update(chain_programs(inst, chain, ordered, "1f1b"))
    detail = (f"dropped pipelines {dropped}; {len(alive)} pipelines run "
              f"{inst.dp * M} microbatches; dropped pipelines' live GPUs run only O")
    return finish(inst, programs, NAME, started, detail=detail)
