"""The op graph of an instance: every op, its dependencies, who may run it (docs/architecture.md, the meaning of a schedule).

For each microbatch (d, m) and stage s there is an F, a B and (with
`decouple_backward`) a W; each live GPU has one O. Dependencies carry the
delay that must pass between the end of the predecessor and the start of the
op (a transfer across a stage boundary, or 0). The optimizer's dependencies
(every W/B of its stage, or of every stage) are expressed through one
*barrier* per stage group rather than D*M edges per O, so the graph stays
linear in the number of ops.

Candidate executors: an op's own GPU if it is live and at full speed; if its
GPU failed, every live GPU of its stage; if its GPU is slow, its own GPU and
every live peer of its stage (work may move off a slow GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from schedc.instance import Instance
from schedc.schedule import OpId


@dataclass(frozen=True)
class Dep:
    """`op` must end `delay` microseconds before the dependent op starts."""

    op: OpId
    delay: int


def compute_kinds(instance: Instance) -> tuple[str, ...]:
    """The kinds every microbatch has at every stage: F, B and (decoupled) W. R ops, Bamboo's
    redundant forward, exist only on the GPUs that run them (`redundant_ops`)."""
    return ("F", "B", "W") if instance.decouple_backward else ("F", "B")


def last_backward_kind(instance: Instance) -> str:
    """The op after which a microbatch holds no memory at a stage: W, or B without decoupling."""
    return "W" if instance.decouple_backward else "B"


def data_deps(instance: Instance, op: OpId) -> tuple[Dep, ...]:
    """Dependencies of an F, B or W op on other F/B/W ops of the same microbatch."""
    d, m, s = op.dp, op.mb, op.pp
    last = instance.pp - 1
    if op.kind == "F":
        return (Dep(OpId("F", d, s - 1, m), instance.boundary_transfer(s - 1)),) if s > 0 else ()
    if op.kind == "B":
        if s == last:
            deps: tuple[Dep, ...] = (Dep(OpId("F", d, s, m), 0),)
        else:
            deps = (Dep(OpId("B", d, s + 1, m), instance.boundary_transfer(s)),)
        if instance.redundant_forward and instance.runs_redundant(d, s):
            # The copy's forward must be done before the microbatch's backward passes: it is
            # what the holder would need to take over with this microbatch in flight.
            deps += (Dep(OpId("R", d, s, m), 0),)
        return deps
    if op.kind == "W":
        return (Dep(OpId("B", d, s, m), 0),)
    if op.kind == "R":
        # The copy's forward takes the output of this GPU's own forward; the last stage's copy
        # (of stage 0) takes the microbatch's input, which is there from the start.
        return (Dep(OpId("F", d, s, m), 0),) if s < last else ()
    raise ValueError(f"{op} has no data dependencies (optimizer ops wait on a barrier)")


def redundant_ops(instance: Instance) -> tuple[OpId, ...]:
    """Every R op (Bamboo's redundant forward): one per microbatch on each GPU that runs them."""
    if not instance.redundant_forward:
        return ()
    return tuple(OpId("R", d, s, m) for s in range(instance.pp) for d in range(instance.dp)
                 if instance.runs_redundant(d, s) for m in range(instance.microbatches))


def optimizer_waits_for(instance: Instance, pp: int) -> tuple[int, ...]:
    """Stages whose every W (or B) must end before an O of stage `pp` may start."""
    return (pp,) if instance.stagger_optimizer else tuple(range(instance.pp))


def candidate_executors(instance: Instance, dp: int, pp: int) -> tuple[int, ...]:
    """Ranks that may execute the F/B/W ops of pipeline `dp` at stage `pp`.

    With redundant computation (Bamboo) work never moves to another pipeline: a live GPU runs
    its own, and a failed GPU's stage runs on its holder, GPU (dp, pp - 1), which keeps a copy."""
    own = instance.gpu(dp, pp)
    if instance.redundant_forward:
        if own.live:
            return (own.rank,)
        holder = instance.holder(dp, pp)
        return (holder.rank,) if holder.live and instance.pp > 1 else ()
    peers = [g.rank for g in instance.live_gpus(pp) if g.dp != dp]
    if not own.live:
        return tuple(peers)
    if own.speed < 1.0:
        return (own.rank, *peers)
    return (own.rank,)


@dataclass(frozen=True)
class OpGraph:
    instance: Instance

    @cached_property
    def compute_ops(self) -> tuple[OpId, ...]:
        """Every F/B/W op, ordered by stage, pipeline, microbatch, kind."""
        inst = self.instance
        return tuple(
            OpId(k, d, s, m)
            for s in range(inst.pp)
            for d in range(inst.dp)
            for m in range(inst.microbatches)
            for k in compute_kinds(inst)
        )

    @cached_property
    def optimizer_ops(self) -> tuple[OpId, ...]:
        return tuple(OpId("O", g.dp, g.pp) for g in self.instance.live_gpus())

    @cached_property
    def redundant_ops(self) -> tuple[OpId, ...]:
        return redundant_ops(self.instance)

    @property
    def ops(self) -> tuple[OpId, ...]:
        return self.compute_ops + self.redundant_ops + self.optimizer_ops

    def deps(self, op: OpId) -> tuple[Dep, ...]:
        if op.kind == "O":
            kind = last_backward_kind(self.instance)
            return tuple(
                Dep(OpId(kind, d, s, m), 0)
                for s in optimizer_waits_for(self.instance, op.pp)
                for d in range(self.instance.dp)
                for m in range(self.instance.microbatches)
            )
        return data_deps(self.instance, op)

    def candidates(self, op: OpId) -> tuple[int, ...]:
        if op.kind in ("O", "R"):
            return (self.instance.gpu(op.dp, op.pp).rank,)
        return candidate_executors(self.instance, op.dp, op.pp)


def build_op_graph(instance: Instance) -> OpGraph:
    return OpGraph(instance)
