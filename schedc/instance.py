"""The scheduling problem every solver, the verifier and the simulator share.

An `Instance` holds exactly what `schedule.json` holds besides the ops
(docs/schedule-format.md): shape, options, memory limit, link, per-stage costs and the
GPUs with their state and speed. It is made from a `Spec` by `from_spec`, or
read back from a schedule file, so a hand-edited `schedule.json` can be
verified and simulated without the spec it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterable, Literal

from schedc.spec import Gpu, LinkSpec, Spec, StageCosts, scaled_duration

OpKind = Literal["F", "B", "W", "R", "O"]


@dataclass(frozen=True)
class Instance:
    dp: int
    pp: int
    microbatches: int
    decouple_backward: bool
    stagger_optimizer: bool
    gpu_memory: int
    link: LinkSpec
    stages: tuple[StageCosts, ...]
    gpus: tuple[Gpu, ...]  # rank order
    #: Bamboo's redundant computation (the `redundant` baseline, docs/baselines.md): each GPU
    #: (d, s) also holds stage s + 1's layers (the last stage: stage 0's) and runs their forward
    #: on every microbatch of its pipeline (an R op); a failed GPU's stage runs on its holder
    #: (d, s - 1). `stages[s].static` then already includes the copy's.
    redundant_forward: bool = False

    # -- lookups -----------------------------------------------------------

    @cached_property
    def _by_coords(self) -> dict[tuple[int, int], Gpu]:
        return {(g.dp, g.pp): g for g in self.gpus}

    def gpu(self, dp: int, pp: int) -> Gpu:
        return self._by_coords[(dp, pp)]

    @cached_property
    def rank_grid(self) -> tuple[tuple[int, ...], ...]:
        """rank_grid[d][s]: the rank of GPU (d, s), for loops over every GPU of a large cluster."""
        grid = [[0] * self.pp for _ in range(self.dp)]
        for g in self.gpus:
            grid[g.dp][g.pp] = g.rank
        return tuple(tuple(row) for row in grid)

    def gpu_of_rank(self, rank: int) -> Gpu:
        return self.gpus[rank]

    @cached_property
    def _live_by_stage(self) -> dict[int | None, tuple[Gpu, ...]]:
        # Asked for per op by solvers and the verifier: computed once per (frozen) instance.
        live = tuple(g for g in self.gpus if g.live)
        stages: list[list[Gpu]] = [[] for _ in range(self.pp)]
        for g in live:  # one pass, rank order kept within each stage
            stages[g.pp].append(g)
        by_stage: dict[int | None, tuple[Gpu, ...]] = {None: live}
        for s in range(self.pp):
            by_stage[s] = tuple(stages[s])
        return by_stage

    def live_gpus(self, pp: int | None = None) -> list[Gpu]:
        """Live GPUs, of one stage if `pp` is given, in rank order."""
        return list(self._live_by_stage.get(pp, ()))

    @property
    def failed_gpus(self) -> list[Gpu]:
        return [g for g in self.gpus if not g.live]

    @property
    def slow_gpus(self) -> list[Gpu]:
        return [g for g in self.gpus if g.live and g.speed < 1.0]

    @property
    def fault_free(self) -> bool:
        return all(g.live and g.speed >= 1.0 for g in self.gpus)

    # -- costs -------------------------------------------------------------

    def base_duration(self, kind: OpKind, pp: int) -> int:
        """Duration of an op at full speed. Without decoupling, B is the full backward."""
        c = self.stages[pp]
        if kind == "F":
            return c.forward
        if kind == "B":
            return c.backward_input if self.decouple_backward else c.backward_full
        if kind == "W":
            return c.backward_weight
        if kind == "O":
            return c.optimizer
        raise ValueError(f"unknown op kind {kind!r}")

    def duration(self, kind: OpKind, pp: int, rank: int) -> int:
        """Duration of an op of stage `pp` on GPU `rank`, at that GPU's speed."""
        if self.redundant_forward and kind in ("R", "O"):
            return scaled_duration(self._redundant_base(kind, pp, rank), self.gpus[rank].speed)
        return scaled_duration(self.base_duration(kind, pp), self.gpus[rank].speed)

    # -- redundant computation (Bamboo) ------------------------------------

    def shadowed(self, pp: int) -> int:
        """The stage whose copy the GPUs of stage `pp` hold: the next one (the last: stage 0)."""
        return (pp + 1) % self.pp

    def holder(self, dp: int, pp: int) -> Gpu:
        """The GPU that holds the copy of GPU (dp, pp)'s stage and takes it over if it fails."""
        return self.gpu(dp, (pp - 1) % self.pp)

    def runs_redundant(self, dp: int, pp: int) -> bool:
        """Whether GPU (dp, pp) runs R ops: it is live, and so is the GPU its copy stands for
        (if that one failed, this GPU runs the stage itself)."""
        return (self.redundant_forward and self.pp > 1 and self.gpu(dp, pp).live
                and self.gpu(dp, self.shadowed(pp)).live)

    def redundant_stages(self, rank: int) -> tuple[int, ...]:
        """The stages GPU `rank` runs with redundant computation: its own and, if the GPU its
        copy stands for failed, that one's too (it took the stage over)."""
        g = self.gpus[rank]
        nxt = self.gpu(g.dp, self.shadowed(g.pp))
        return (g.pp, nxt.pp) if self.pp > 1 and not nxt.live else (g.pp,)

    def _redundant_base(self, kind: OpKind, pp: int, rank: int) -> int:
        """R: the forward of the shadowed stage. O: the optimizer steps of every stage the GPU
        runs (a taken-over stage's layers now live here)."""
        if kind == "R":
            return self.stages[self.shadowed(pp)].forward
        return sum(self.stages[s].optimizer for s in self.redundant_stages(rank))

    def boundary_transfer(self, pp: int) -> int:
        """Transfer time across the boundary between stage `pp` and `pp + 1`.

        Stage `pp`'s `send` is its output activation; the gradient that B of
        stage `pp + 1` sends back has the same size, so both directions of
        that boundary take this long (latency + send / bandwidth).
        """
        return self.link.transfer_time(self.stages[pp].send)

    # -- bounds ------------------------------------------------------------

    def stage_lower_bound(self, pp: int) -> float:
        """(D*M*(f+b+w) + n*o) / sum(speeds) over the live GPUs of stage pp."""
        live = self.live_gpus(pp)
        if not live:
            return float("inf")
        c = self.stages[pp]
        work = self.dp * self.microbatches * (c.forward + c.backward_input + c.backward_weight)
        work += len(live) * c.optimizer
        return work / sum(g.speed for g in live)

    @cached_property
    def lower_bound(self) -> float:
        """No schedule's iteration time can be below this."""
        if self.redundant_forward:
            return float(max((self.redundant_load(g.rank) for g in self.live_gpus()), default=0))
        return max(self.stage_lower_bound(s) for s in range(self.pp))

    def redundant_load(self, rank: int) -> int:
        """With redundant computation no work moves between pipelines, so a GPU's busy time per
        iteration is fixed: its stage's F and B of every microbatch, those of the failed stage
        it took over, its R ops and its O (`duration` already counts both stages' steps)."""
        g = self.gpus[rank]
        M = self.microbatches
        load = sum(M * (self.duration("F", s, rank) + self.duration("B", s, rank))
                   for s in self.redundant_stages(rank))
        if self.runs_redundant(g.dp, g.pp):
            load += M * self.duration("R", g.pp, rank)
        return load + self.duration("O", g.pp, rank)

    def same_costs(self, other: "Instance") -> bool:
        """Whether `other` is the same job on as many stages (shape, options, memory, link, stage
        costs), whatever its number of pipelines and its GPUs' states."""
        return all(getattr(self, k) == getattr(other, k) for k in (
            "pp", "microbatches", "decouple_backward", "stagger_optimizer", "gpu_memory", "link", "stages",
            "redundant_forward"))

    def without_failures(self) -> "Instance":
        return replace(self, gpus=tuple(replace(g, state="live", speed=1.0) for g in self.gpus))


def from_spec(spec: Spec) -> Instance:
    """The scheduling problem a spec describes (the `expand` step of docs/architecture.md's data flow)."""
    return Instance(
        dp=spec.cluster.dp,
        pp=spec.cluster.pp,
        microbatches=spec.train.microbatches,
        decouple_backward=spec.schedule.decouple_backward,
        stagger_optimizer=spec.schedule.stagger_optimizer,
        gpu_memory=spec.cluster.gpu.memory,
        link=spec.cluster.link,
        stages=spec.stages,
        gpus=spec.gpus,
    )


def make_instance(
    dp: int,
    pp: int,
    microbatches: int,
    *,
    forward: int | Iterable[int] = 1000,
    backward_input: int | Iterable[int] = 1000,
    backward_weight: int | Iterable[int] = 1000,
    optimizer: int | Iterable[int] = 0,
    activation: int | Iterable[int] = 1 << 20,
    stash: int | Iterable[int] = 1 << 18,
    static: int | Iterable[int] = 0,
    send: int | Iterable[int] = 0,
    gpu_memory: int = 1 << 40,
    latency: int = 0,
    bandwidth: int = 25_000_000_000,
    decouple_backward: bool = True,
    stagger_optimizer: bool = True,
    failed: Iterable[tuple[int, int]] = (),
    slow: dict[tuple[int, int], float] | None = None,
    gpus_per_node: int = 8,
    placement: str = "pipeline_major",
) -> Instance:
    """Build an instance directly, without a spec: for tests, benchmarks and examples.

    Per-stage values may be given as one number (every stage) or one per stage.
    `failed` lists (dp, pp) of failed GPUs; `slow` maps (dp, pp) to a speed.
    """

    def per_stage(v: int | Iterable[int]) -> list[int]:
        if isinstance(v, int):
            return [v] * pp
        vals = list(v)
        if len(vals) != pp:
            raise ValueError(f"expected {pp} per-stage values, got {len(vals)}")
        return vals

    cols = {k: per_stage(v) for k, v in dict(
        forward=forward, backward_input=backward_input, backward_weight=backward_weight,
        optimizer=optimizer, activation=activation, stash=stash, static=static, send=send,
    ).items()}
    stages = tuple(StageCosts(pp=s, **{k: cols[k][s] for k in cols}) for s in range(pp))
    failed = set(failed)
    slow = dict(slow or {})
    gpus = []
    for rank in range(dp * pp):
        d, s = (rank % dp, rank // dp) if placement == "stage_major" else (rank // pp, rank % pp)
        state = "failed" if (d, s) in failed else "live"
        gpus.append(Gpu(rank=rank, dp=d, pp=s, node=rank // gpus_per_node, state=state,
                        speed=slow.get((d, s), 1.0)))
    return Instance(
        dp=dp, pp=pp, microbatches=microbatches, decouple_backward=decouple_backward,
        stagger_optimizer=stagger_optimizer, gpu_memory=gpu_memory,
        link=LinkSpec(latency=latency, bandwidth=bandwidth), stages=stages, gpus=tuple(gpus),
    )
