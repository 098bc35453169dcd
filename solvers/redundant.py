"""`redundant`: Bamboo-style redundant computation (Thorpe et al., NSDI 2023) (docs/baselines.md).

Every stage s also runs the forward of the stage it shadows, its successor
s + 1, in every iteration, and keeps that stage's weights; the last stage
shadows stage 0, so every stage has a copy. This is paid with or without
failures and is modelled by a transformed instance: forward_s += forward of
the shadowed stage, static_s += its static (the redundant forward keeps no
activation: it only has to be ready to take over).

When GPU (d, s) fails, its holder (d, s - 1) (for s = 0: (d, S-1)) takes
over stage s. The two stages then time-share one physical GPU; the
transformed instance models that as the failed GPU being live again and both
it and its holder running at half their speed (an approximation, stated in
`SolverInfo.detail`). If a failed GPU's holder failed too: E314. Then 1F1B
per pipeline; full backward, global optimizer barrier.
"""

from __future__ import annotations

import time
from dataclasses import replace

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.schedule import Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import barrier_instance, check_memory, finish
from schedc.solvers.one_f_one_b import template_programs

NAME = "redundant"
TIME_SHARE_SPEED = 0.5


def holder_of(instance: Instance, dp: int, pp: int) -> int:
    """Stage whose GPU in pipeline `dp` holds the redundant copy of stage `pp`."""
    return (pp - 1) % instance.pp


def redundant_instance(instance: Instance) -> Instance:
    """The instance Bamboo actually runs (see the module docstring); E314 when it cannot."""
    inst = barrier_instance(instance)
    S = inst.pp
    failed = inst.failed_gpus
    lost = [g for g in failed if S == 1 or not inst.gpu(g.dp, holder_of(inst, g.dp, g.pp)).live]
    if lost:
        diags = []
        for g in lost:
            if S == 1:
                msg = (f"redundant: GPU (dp={g.dp}, pp={g.pp}) failed and a one-stage pipeline "
                       "has no neighbour holding a copy of it")
            else:
                h = holder_of(inst, g.dp, g.pp)
                msg = (f"redundant: GPU (dp={g.dp}, pp={g.pp}) failed and so did its holder "
                       f"GPU (dp={g.dp}, pp={h}), the only one with a copy of stage {g.pp}")
            diags.append(error("E314", msg, hint="use `solver = reroute-1f1b`, `greedy` or "
                               "`cpsat`, which move the stage's work to other pipelines"))
        raise InfeasibleError(diags)
    if S > 1:
        stages = tuple(replace(c, forward=c.forward + inst.stages[(s + 1) % S].forward,
                               static=c.static + inst.stages[(s + 1) % S].static)
                       for s, c in enumerate(inst.stages))
    else:
        stages = inst.stages
    gpus = list(inst.gpus)
    for g in failed:
        holder = inst.gpu(g.dp, holder_of(inst, g.dp, g.pp))
        shared = holder.speed * TIME_SHARE_SPEED
        gpus[g.rank] = replace(g, state="live", speed=shared)
        gpus[holder.rank] = replace(holder, speed=shared)
    return replace(inst, stages=stages, gpus=tuple(gpus))


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """1F1B on the redundant instance; E314 if a failed stage's copy is lost, E310 for memory."""
    started = time.perf_counter()
    inst = redundant_instance(instance)
    check_memory(inst, solver=NAME)
    detail = "every stage also runs its successor's forward (the last stage: stage 0's)"
    if instance.failed_gpus:
        detail += ("; each failed GPU's stage is taken over by its holder, modelled as both "
                   f"running at speed {TIME_SHARE_SPEED} (time-sharing, an approximation)")
    return finish(inst, template_programs(inst, "1f1b"), NAME, started, detail=detail)
