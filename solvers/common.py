"""Pieces every scheduler in this package shares: memory arithmetic, errors, finishing.

A solver here chooses, for every microbatch and stage, an executor, and for
every rank an order of its ops; `schedc.simulate_engine` turns that order into times.
This module holds what is the same for all of them:

- how many microbatches fit in flight on a GPU (`fits_in_flight`) and the
  E310 error when not even one does (`check_memory`);
- the peak memory of a program, walked in order (`program_peak`), the same
  rule the verifier applies (docs/architecture.md, memory);
- the instance the field's baselines run on (`barrier_instance`: full
  backward, global optimizer barrier) and the E311 refusal of fault-free
  templates (`require_no_failures`);
- turning programs of compute ops into a `Schedule` (`finish`), and the
  steady-state iteration time of programs (`steady_iteration_time`).

Error codes raised by solvers (docs/baselines.md): E310 memory, E311 a
fault-free template given failed GPUs, E312 GPipe cannot hold every
microbatch, E313 drop-pipeline has no pipeline left, E314 redundant: a failed
stage's copy is lost too, E315 a stage has no live GPU.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

from schedc.diagnostics import InfeasibleError, error
from schedc.instance import Instance
from schedc.schedule import OpId, Schedule, SolverInfo
from schedc.simulate_engine import STEADY_ITERATIONS, STEADY_WINDOW, program_graph, schedule_from_programs
from schedc.verify import memory_profile


# A cap standing for "as many as there are" when a stage allocates no activation memory.
UNBOUNDED = 1 << 30


def fmt_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number readable."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"


def gpu_name(instance: Instance, rank: int) -> str:
    g = instance.gpus[rank]
    return f"GPU (dp={g.dp}, pp={g.pp}) (rank {rank})"


def fits_in_flight(instance: Instance, rank: int) -> int:
    """How many microbatches the GPU `rank` can hold in flight (F started, B not ended).

    Counts the whole activation of each one: a safe cap for any order, since
    a microbatch never holds more than its activation.
    """
    stage = instance.stages[instance.gpus[rank].pp]
    free = instance.gpu_memory - stage.static
    if free < 0:
        return 0
    if stage.activation <= 0:
        return UNBOUNDED
    return free // stage.activation


def check_memory(instance: Instance, ranks: Iterable[int] | None = None, *, solver: str) -> None:
    """Raise E310 for every GPU that cannot hold its weights and one microbatch."""
    diags = []
    for rank in (ranks if ranks is not None else [g.rank for g in instance.live_gpus()]):
        if fits_in_flight(instance, rank) >= 1:
            continue
        stage = instance.stages[instance.gpus[rank].pp]
        need = stage.static + stage.activation
        diags.append(error(
            "E310",
            f"{solver}: {gpu_name(instance, rank)} cannot hold one microbatch of stage "
            f"{stage.pp}: it needs static {fmt_bytes(stage.static)} + activation "
            f"{fmt_bytes(stage.activation)} = {fmt_bytes(need)}, gpu.memory is "
            f"{fmt_bytes(instance.gpu_memory)} ({fmt_bytes(need - instance.gpu_memory)} short)",
            hint="raise `gpu.memory`, or shrink the stage: fewer layers per stage (more "
                 "stages), a smaller microbatch, or less optimizer state"))
    if diags:
        raise InfeasibleError(diags)


def check_stages_live(instance: Instance, *, solver: str) -> None:
    """Raise E315 if some stage has no live GPU (no solver can place its ops)."""
    diags = [error("E315", f"{solver}: stage {s} has no live GPU: every replica of it failed",
                   hint="no schedule can run a stage without a live GPU; remove a `fail` "
                        "statement or add pipelines (`cluster.dp`)")
             for s in range(instance.pp) if not instance.live_gpus(s)]
    if diags:
        raise InfeasibleError(diags)


def require_no_failures(instance: Instance, *, solver: str) -> None:
    """Fault-free templates refuse failed GPUs with E311 (slow GPUs just run slower)."""
    failed = instance.failed_gpus
    if failed:
        names = ", ".join(f"(dp={g.dp}, pp={g.pp})" for g in failed[:6])
        more = f" and {len(failed) - 6} more" if len(failed) > 6 else ""
        raise InfeasibleError([error(
            "E311", f"{solver} is a fault-free template, but GPU {names}{more} failed",
            hint="use `solver = reroute-1f1b`, `greedy` or `cpsat`, which move a failed "
                 "GPU's microbatches to live peers of its stage")])


def barrier_instance(instance: Instance) -> Instance:
    """The instance the field's baselines run: full backward (no W), a global optimizer barrier."""
    if not instance.decouple_backward and not instance.stagger_optimizer:
        return instance
    return replace(instance, decouple_backward=False, stagger_optimizer=False)


def program_peak(instance: Instance, rank: int, program: Sequence[OpId]) -> int:
    """Peak memory (bytes, static included) of a program run in order (docs/architecture.md, memory).

    The rule itself lives in the verifier (`memory_profile`): one definition,
    so a solver can never plan with memory the verifier would reject.
    """
    return memory_profile(instance, rank, program).peak


def with_optimizer(instance: Instance, programs: Mapping[int, Sequence[OpId]]) -> dict[int, list[OpId]]:
    """Every live rank's program with its O appended (O is the last op of a program)."""
    out: dict[int, list[OpId]] = {}
    for g in instance.live_gpus():
        prog = [op for op in programs.get(g.rank, ()) if op.kind != "O"]
        prog.append(OpId("O", g.dp, g.pp))
        out[g.rank] = prog
    return out


def steady_iteration_time(instance: Instance, programs: Mapping[int, Sequence[OpId]],
                          iterations: int = STEADY_ITERATIONS, window: int = STEADY_WINDOW) -> int:
    """Steady-state period of programs run back to back (docs/architecture.md, the simulator), O included."""
    return program_graph(instance, programs).period(iterations, window)


def finish(instance: Instance, programs: Mapping[int, Sequence[OpId]], name: str, started: float,
           detail: str = "", objective: float | None = None) -> Schedule:
    """Time the programs (O appended) and wrap them as the solver's Schedule."""
    progs = with_optimizer(instance, programs)
    sched = schedule_from_programs(instance, progs, SolverInfo(name=name))
    info = SolverInfo(name=name, status="feasible", objective=objective,
                      wall_s=time.perf_counter() - started, detail=detail)
    return replace(sched, solver=info)


def decoupled_programs(programs: Mapping[int, Sequence[OpId]]) -> dict[int, list[OpId]]:
    """Programs made for full backward, run with decoupled B/W: each B followed at once by its W.

    Never slower than the original on the decoupled instance (B ends earlier,
    W ends when the full B did) and never more memory.
    """
    out: dict[int, list[OpId]] = {}
    for rank, prog in programs.items():
        new: list[OpId] = []
        for op in prog:
            new.append(op)
            if op.kind == "B":
                new.append(OpId("W", op.dp, op.pp, op.mb))
        out[rank] = new
    return out
