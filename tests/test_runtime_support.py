"""Helpers shared by the runtime, codegen and e2e tests (no tests here).

`schedule_for` uses the real solvers when they are importable and falls back
to `list_schedule`, a tiny GPipe-order list scheduler that is valid by
construction (unlimited memory), so these tests stay runnable while solvers
are missing.
"""

from __future__ import annotations

from schedc.instance import Instance
from schedc.schedule import Schedule, ScheduledOp, SolverInfo
from schedc.spec import ClusterSpec, GpuSpec, ModelSpec, ScheduleOptions, Spec, TrainSpec


def list_schedule(inst: Instance) -> Schedule:
    """Every F (microbatch order), then every B, then W, then O; as early as dependencies allow."""
    D, S, M = inst.dp, inst.pp, inst.microbatches
    free = {g.rank: 0 for g in inst.live_gpus()}
    ends: dict[tuple, int] = {}
    ops: list[ScheduledOp] = []

    def executor(d, m, s):
        g = inst.gpu(d, s)
        if g.live:
            return g.rank
        live = inst.live_gpus(s)
        return live[(d + m) % len(live)].rank

    def place(kind, d, m, s, rank, ready):
        start = max(free[rank], ready)
        end = start + inst.duration(kind, s, rank)
        free[rank] = end
        ends[(kind, d, m, s)] = end
        ops.append(ScheduledOp(rank, kind, d, s, m, start, end))

    for m in range(M):
        for d in range(D):
            for s in range(S):
                ready = ends[("F", d, m, s - 1)] + inst.boundary_transfer(s - 1) if s else 0
                place("F", d, m, s, executor(d, m, s), ready)
    for m in range(M):
        for d in range(D):
            for s in reversed(range(S)):
                ready = ends[("F", d, m, s)] if s == S - 1 else ends[("B", d, m, s + 1)] + inst.boundary_transfer(s)
                place("B", d, m, s, executor(d, m, s), ready)
    last = {}
    if inst.decouple_backward:
        for m in range(M):
            for d in range(D):
                for s in range(S):
                    place("W", d, m, s, executor(d, m, s), ends[("B", d, m, s)])
    kind = "W" if inst.decouple_backward else "B"
    for s in range(S):
        last[s] = max(e for (k, d, m, st), e in ends.items() if k == kind and st == s)
    for g in inst.live_gpus():
        ready = last[g.pp] if inst.stagger_optimizer else max(last.values())
        start = max(free[g.rank], ready)
        ops.append(ScheduledOp(g.rank, "O", g.dp, g.pp, None, start, start + inst.duration("O", g.pp, g.rank)))
    return Schedule(inst, tuple(ops), SolverInfo(name="test-list"))


def schedule_for(inst: Instance, solver: str) -> Schedule:
    """A schedule from `solver` (`"test-list"`: this module's own `list_schedule`)."""
    if solver == "test-list":
        return list_schedule(inst)
    from schedc.solvers import SolveOptions, get_solver

    return get_solver(solver)(inst, SolveOptions(time_limit=0.5))  # CP-SAT: feasible is enough here


def spec_for(inst: Instance, *, source: str | None = "schedc.models.mlp:build", data: str | None = None,
             optimizer: str = "sgd", lr: float = 0.01, iterations: int = 1,
             partition=None, name: str = "<test>") -> Spec:
    """A Spec matching `inst`, bound to a model, built without the parser."""
    cluster = ClusterSpec(dp=inst.dp, pp=inst.pp, gpus_per_node=8, placement="pipeline_major",
                          gpu=GpuSpec(memory=inst.gpu_memory), link=inst.link)
    return Spec(cluster=cluster, stages=inst.stages,
                train=TrainSpec(microbatches=inst.microbatches, optimizer=optimizer, lr=lr, iterations=iterations),
                schedule=ScheduleOptions(decouple_backward=inst.decouple_backward,
                                         stagger_optimizer=inst.stagger_optimizer),
                gpus=inst.gpus, model=ModelSpec(source=source, data=data), partition=partition,
                source_name=name)


def max_weight_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def report_precision(reached: list[tuple[str, float]], what: str, tolerance: float) -> None:
    """At the end of an exactness file (a module fixture's teardown, so whichever cases ran, in
    any order): print every case's difference (pytest -s shows them), and check the worst
    against `tolerance` (each case checks its own too)."""
    if not reached:
        return
    worst = max(d for _, d in reached)
    print(f"\n{what}: {len(reached)} cases, max abs weight difference {worst:.3g}")
    for case, diff in reached:
        print(f"  {case:70s} {diff:.3g}")
    assert worst <= tolerance


def batch_that_kills_its_rank(iteration: int, dp: int, microbatch: int):
    """`model.data` for the killed-peer test: the MLP's data, but the process asking for
    microbatch (1, 0) of iteration 1 kills itself with SIGKILL, as a crashed GPU host would."""
    import os
    import signal

    from schedc.models import mlp

    if (iteration, dp, microbatch) == (1, 1, 0):
        os.kill(os.getpid(), signal.SIGKILL)
    return mlp.batch(iteration, dp, microbatch)
