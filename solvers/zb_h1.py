"""`zb-h1`: Zero Bubble's H1 schedule (Qi et al., ICLR 2024) (docs/baselines.md).

1F1B's warm-up and in-flight limit, with B and W decoupled: stage s issues
the W of its i-th backward only after its (i + s)-th backward, so the later
stages, which finish their backwards first, fill the cool-down with W
(torch.distributed.pipelining builds the same order in `_get_1f1b_rank_ops`
with `enable_zero_bubble`). When F = B = W its bubble is about a third of
1F1B's. Decoupled backward, global optimizer barrier.
"""

from __future__ import annotations

import time
from dataclasses import replace

from schedc.instance import Instance
from schedc.schedule import Schedule
from schedc.solvers import SolveOptions
from schedc.solvers.common import check_memory, finish, require_no_failures
from schedc.solvers.one_f_one_b import template_programs

NAME = "zb-h1"


def zb_instance(instance: Instance) -> Instance:
    """ZB-H1 as published: decoupled backward, global optimizer barrier."""
    return replace(instance, decouple_backward=True, stagger_optimizer=False)


def solve(instance: Instance, options: SolveOptions) -> Schedule:
    """ZB-H1 per pipeline; E311 with failed GPUs, E310 if one microbatch does not fit."""
    started = time.perf_counter()
    inst = zb_instance(instance)
    require_no_failures(inst, solver=NAME)
    check_memory(inst, solver=NAME)
    return finish(inst, template_programs(inst, "zb-h1"), NAME, started,
                  detail="1F1B warm-up; W of stage s deferred by s backwards (shortened to fit memory)")
