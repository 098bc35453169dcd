"""Rollback: make every survivor's state that of one iteration boundary.

With a staggered optimizer, stages step at different moments, so when a GPU
dies in iteration i some survivors may have applied iteration i's update and
others not. Before the survivors go on under a new plan they agree on the
boundary r = the smallest number of steps any survivor has applied (an
all-reduce MIN over the new generation's group) and each one that is one
step ahead goes back to the state it had before its last step. Iteration r
then runs again under the new plan; since a microbatch's data depends only
on (iteration, pipeline, microbatch), every update is applied exactly once
and the weights stay those of fault-free training.

Why no survivor is ever more than one step ahead: every op of iteration
r+1 on stage s needs an activation produced by stage s-1 in iteration r+1,
which that stage runs only after its own step r; so a GPU cannot finish
iteration r+1 (its step r+1 needs its stage's all-reduce with all its live
peers) before every stage has stepped r. Hence steps applied differ by at
most one across survivors (checked: `RollbackError` otherwise).

How the state before a step is kept: **a copy** (`StepSnapshot`), taken
once the stage's gradient all-reduce is done, just before the optimizer
step changes anything, of the stage's weights and optimizer state, in
preallocated buffers. (Not earlier: an all-reduce interrupted by a failure
may complete on some members and not on others, and a member whose copy
was already replaced for a step it never applied could not go back to the
step it did apply.) Restoring it is exact, whatever the optimizer. The
alternative, undoing the update from the kept gradient as SWIFT does (no
copy), was rejected: survivors of one stage can disagree (an all-reduce
that a dying peer interrupts may complete on some members and not on
others), and a member that completed it can run on into iteration r+1 and
overwrite the gradient it would need to undo; and the inverse of Adam's
update in floating point is not exact. The copy costs memory (weights and
optimizer state once more) and one copy per step (docs/live.md has the
figures). It is allocated beside the parameters; on a GPU machine it
belongs in host memory, written while the iteration computes, so that the
plan's GPU memory stays as planned (the runtime has no GPU path yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from schedc.diagnostics import RunError, error


class RollbackError(RunError):
    """Survivors' states cannot be brought to one iteration boundary (a bug, not a failure)."""


@dataclass
class StepSnapshot:
    """A stage's weights and optimizer state as they were before its latest optimizer step.

    `take()` copies them into buffers allocated at the first call (no
    allocation afterwards); `restore()` copies them back. With no module
    (--emulate) both do nothing.
    """

    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    steps: int | None = None  # steps applied when the copy was taken
    _params: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _state: dict = field(default_factory=dict)  # param -> {key: copy} (an absent key: no state yet)

    def take(self, steps_done: int) -> None:
        self.steps = steps_done
        if self.module is None:
            return
        with torch.no_grad():
            if not self._params:
                self._params = [(p, torch.empty_like(p)) for p in self.module.parameters()]
            for p, copy in self._params:
                copy.copy_(p)
            if self.optimizer is None:
                return
            for p, _ in self._params:
                state = self.optimizer.state.get(p)
                if not state:
                    self._state.pop(p, None)
                    continue
                kept = self._state.setdefault(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        if key not in kept or kept[key].shape != value.shape:
                            kept[key] = torch.empty_like(value)
                        kept[key].copy_(value)
                    else:
                        kept[key] = value

    def restore(self) -> None:
        if self.module is None:
            return
        with torch.no_grad():
            for p, copy in self._params:
                p.copy_(copy)
            if self.optimizer is None:
                return
            for p, _ in self._params:
                kept = self._state.get(p)
                if kept is None:
                    self.optimizer.state.pop(p, None)  # no state before the step: as if it never ran
                    continue
                state = self.optimizer.state[p]
                for key, value in kept.items():
                    if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                        state[key].copy_(value)
                    else:
                        state[key] = value.clone() if isinstance(value, torch.Tensor) else value

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds (weights plus optimizer state)."""
        n = sum(c.numel() * c.element_size() for _, c in self._params)
        n += sum(v.numel() * v.element_size() for kept in self._state.values() for v in kept.values()
                 if isinstance(v, torch.Tensor))
        return n


def rollback_target(steps: Iterable[int]) -> int:
    """The iteration boundary survivors resume from: the fewest steps any of them applied."""
    steps = list(steps)
    low, high = min(steps), max(steps)
    if high - low > 1:
        raise RollbackError([error("E552", f"survivors are {high - low} optimizer steps apart ({low} to {high}); "
                                           "a rollback goes back one step at most",
                                   hint="this is a bug in schedc's live runtime; please report it")])
    return low


def roll_back(steps_done: int, target: int, snapshot: StepSnapshot) -> bool:
    """Bring a rank with `steps_done` steps to `target`: True if its last step was undone."""
    if steps_done == target:
        return False
    if steps_done != target + 1 or snapshot.steps != target:
        kept = "no copy is kept" if snapshot.steps is None else f"the kept copy holds {snapshot.steps} steps"
        raise RollbackError([error("E552", f"cannot roll back from {steps_done} steps to {target}: {kept}",
                                   hint="this is a bug in schedc's live runtime; please report it")])
    snapshot.restore()
    return True
