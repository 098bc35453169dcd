"""Live shadows (`schedc train --shadow`): every stage's state also lives on the next stage.

Re-routing needs a live replica of every stage. When a burst takes every GPU
of one stage, the stage's weights and optimizer state are gone, and without
a shadow the job restores the latest checkpoint: everything trained since it
is lost. With shadows, every live GPU of stage (s + 1) mod S holds an exact
copy of stage s (its *shadow*), kept exact by streaming gradients rather than
state: after stage s's gradient all-reduce, a live GPU of stage s (its
*source*) sends the summed gradient, one flat tensor, to each holder
assigned to it, and the holder applies the same optimizer step to its copy
with the same code (`schedc.runtime.primitives.step_with`): the same bits.
A stage is then lost for good only when its every GPU and every GPU of the
next stage are lost together.

A shadow lags its holder by one step: the gradient of step k is received
while the holder computes iteration k + 1 and applied in that iteration's
optimizer op, just before the holder's own step k + 1. Nothing waits for the
shadowed stage's all-reduce, the transfer overlaps an iteration, and the
shadow is never ahead of its holder: a rollback never has to undo it. After
a failure, the gradient that arrived before the generation ended brings it
to the step count the survivors agree on (`catch_up`); one that did not
arrive leaves it stale.

Costs (per GPU): the previous stage's weights, a gradient buffer and its
optimizer state in memory; per iteration, one optimizer step of the previous
stage and receiving its gradient.

How a loss uses them (`schedc.live.relayout`): when the run re-partitions
around the lost stage, the survivors keep their processes and move the layers
among themselves, the lost stage's from its copies (`schedc.live.move`). When
every process is to restart anyway (replacement processes, `--recovery
restart`), they first run a *dump* generation: they agree on a step count as
any generation does, lowered to the steps the lost stage's copies hold
(undoing one step where needed), then the lowest survivor of each stage
writes it, and for a stage with no survivor the first holder with a valid
shadow writes that, as a checkpoint of the run. Every process then restarts
from that checkpoint on the new plan, as from any checkpoint. A holder's
shadow is invalid once its own state was replaced without it (a catch-up
from a donor); it says so when it reports ready.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schedc.runtime.manifest import Manifest


def shadowed_stage(stage: int, stages: int) -> int | None:
    """The stage whose shadow a GPU of `stage` holds (None with a single stage)."""
    return None if stages < 2 else (stage - 1) % stages


def assignment(manifest: Manifest) -> dict[int, tuple[int, int]]:
    """Every holder of the plan -> (the stage it shadows, the rank that sends it that stage's
    gradient): the live GPUs of stage s + 1 take the live GPUs of stage s as sources in turn."""
    stages = manifest.pp
    if stages < 2:
        return {}
    out: dict[int, tuple[int, int]] = {}
    for s in range(stages):
        sources = sorted(manifest.stage_groups[s])
        holders = sorted(manifest.stage_groups[(s + 1) % stages])
        if not sources:
            continue
        for j, h in enumerate(holders):
            out[h] = (s, sources[j % len(sources)])
    return out


@dataclass(frozen=True)
class ShadowLink:
    """A rank's part in one generation's streaming: who it sends its stage's summed gradient to,
    and whom it receives its shadow's from (None: it holds no shadow in this plan)."""

    sends_to: tuple[int, ...]
    source: int | None

    @classmethod
    def of(cls, manifest: Manifest, rank: int) -> "ShadowLink":
        plan = assignment(manifest)
        sends = tuple(h for h, (_, src) in sorted(plan.items()) if src == rank)
        mine = plan.get(rank)
        return cls(sends, None if mine is None else mine[1])


class ShadowStage:
    """A holder's copy of the previous stage: its module, parameters and optimizer, built as the
    stage's own GPUs build theirs, stepped with the gradient its source streams."""

    def __init__(self, manifest: Manifest, stage: int, *, emulate: bool, device: str = "cpu"):
        from schedc.runtime.primitives import make_optimizer
        from schedc.runtime.manifest import build_model
        from schedc.runtime.stagework import StageWork

        self.stage = stage
        self.steps = 0
        self.valid = True
        # The receive of the last step's gradient, posted in this generation: (the steps it brings
        # the copy to, its work, its buffer); `received` once a generation ended with it there.
        self.pending: tuple[int, object, torch.Tensor] | None = None
        self.received: tuple[int, torch.Tensor] | None = None
        self.emulate = emulate
        self.module = None
        self.params: list[torch.Tensor] = []
        self.optimizer = None
        self.layers: tuple[int, int] | None = None
        self.model_layers: int | None = None
        self.partition = None
        if emulate:
            return
        layers, _, partition = build_model(manifest)
        a, b = partition[stage]
        self.partition = tuple(tuple(p) for p in partition)
        self.layers, self.model_layers = (a, b), len(layers)
        work = StageWork(layers[a:b], None, global_microbatches=manifest.global_microbatches, device=device,
                         first_layer=a)
        self.module, self.params = work.module, work.params
        self.optimizer = make_optimizer(manifest.optimizer, self.params, manifest.lr)
        for p in self.params:
            p.grad = torch.zeros_like(p)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def streams(self) -> bool:
        """Whether a gradient comes for it each step (a stage without trainable parameters: none)."""
        return bool(self.params) and not self.emulate

    def apply(self, flat: torch.Tensor | None) -> None:
        """One optimizer step with the stage's summed gradient, as its own GPUs take it."""
        from schedc.runtime.primitives import step_with

        if self.streams:
            step_with(self.params, self.optimizer, flat)
        self.steps += 1

    def state(self) -> dict:
        """The stage's state as its own GPU's `Runtime.stage_state` gives it (what a checkpoint holds)."""
        from schedc.runtime.primitives import optimized_names, to_host

        if self.emulate:
            return {"steps": self.steps, "model": {}, "optimizer": None, "params": []}
        return {"steps": self.steps, "model": to_host(self.module.state_dict()),
                "optimizer": to_host(self.optimizer.state_dict()) if self.optimizer is not None else None,
                "params": optimized_names(self.module)}

    def settle(self, transport, *, wait: bool) -> None:
        """A generation ends: keep the gradient its posted receive brings, waited for (`wait`: an
        orderly end, the sender has sent it) or only if it is there already (an abort)."""
        if self.pending is None:
            return
        steps, work, buf = self.pending
        if wait:
            self.received = (steps, transport.wait_posted(work, buf, None, "the last gradient of a shadow"))
        elif transport.landed(work):
            self.received = (steps, buf.to(self.params[0].device))
        self.pending = None

    def reachable(self) -> int:
        """The steps `catch_up` can bring the copy to (its own, or one more with a kept gradient)."""
        got = self.received
        return self.steps + (1 if got is not None and got[0] == self.steps + 1 else 0)

    def steps_to_keep(self, low: int, high: int) -> int:
        """The steps the survivors may go on from when this copy's stage is lost (members hold
        `low` to `high` steps): no more than the copy can reach, unless that would take a member
        back more than one step, when the copy is given up (invalid) instead."""
        if not (self.streams and self.valid):
            return low
        reach = self.reachable()
        if reach >= high - 1:
            return min(low, reach)
        self.valid = False
        return low

    def catch_up(self, target: int) -> None:
        """After a generation's members agreed on `target` steps: bring the copy there with the
        gradient kept at the end of the last generation (it lags one step), else it is stale."""
        got, self.received = self.received, None
        if not self.streams:
            self.steps = target
            return
        if got is not None and got[0] == self.steps + 1 == target:
            self.apply(got[1])
        if self.steps != target:
            self.valid = False

    def load(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.valid = True
        self.pending = self.received = None
        if self.emulate:
            return
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for p in self.params:
            p.grad.zero_()


def room_problem(plan) -> tuple[str, str] | None:
    """Why `plan` cannot keep shadows, as (message, hint), or None when it can: a single stage, or
    a GPU whose planned peak memory plus the previous stage's weights, gradients and optimizer
    state (the spec's `static` of that stage) passes its memory limit. A re-routed plan raises
    the peak of the GPUs that take work, and a re-partitioned one holds more layers per GPU, so
    the supervisor asks again for every plan it announces."""
    from schedc.printer import human_bytes

    spec = plan.spec
    if spec.pp < 2:
        return ("--shadow keeps each stage's state on the next stage, and this job has a single stage",
                "leave out --shadow")
    costs = {st.pp: st for st in spec.stages}
    limit = plan.metrics.memory_limit
    worst = None
    for rank, peak in sorted(plan.metrics.peak_memory.items()):
        stage = next(g.pp for g in spec.gpus if g.rank == rank)
        need = peak + costs[shadowed_stage(stage, spec.pp)].static
        if need > limit and (worst is None or need > worst[1]):
            worst = (rank, need, peak, stage)
    if worst is None:
        return None
    rank, need, peak, stage = worst
    return (f"--shadow needs {human_bytes(need)} on rank {rank} (stage {stage}): its planned peak "
            f"{human_bytes(peak)} plus stage {shadowed_stage(stage, spec.pp)}'s shadow, over the GPUs' "
            f"{human_bytes(limit)}",
            "leave out --shadow, or give the GPUs more memory (or use more stages: each stage's state is "
            "then smaller)")


def check_memory(plan) -> None:
    """E555 when the job's own plan cannot keep shadows (`room_problem`)."""
    from schedc.diagnostics import RunError, error

    problem = room_problem(plan)
    if problem is not None:
        raise RunError([error("E555", problem[0], hint=problem[1])])
