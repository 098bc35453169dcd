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
update in floating point is not exact.

What the copy costs. On a CPU: the weights and optimizer state once more in
memory and one copy per step, on the step's path (docs/live.md has the
figures). With the parameters on a CUDA device the buffers are pinned host
memory, so the plan's GPU memory is unchanged (no GPU byte is allocated for
the copy), and the copy is overlapped with the iteration: between two
steps a stage's weights and optimizer state do not change, so the copy of
the state before step k can be written at any time during iteration k, as
long as it is complete before step k writes. `prefetch(k)`, called as the
iteration starts, issues it on a side stream (after the step k-1 queued on
the current stream); `take(k)`, just before step k, makes the current
stream wait for it (the host does not wait) and keeps it. The copy of the
state before step k-1 must stay valid meanwhile (a rank that applied step
k-1 and ran on into iteration k still goes back to it if a peer never
applied k-1), so the prefetch goes into a second, spare set of buffers and
`take` swaps the two: overlapped, the copy holds twice the weights and
optimizer state in host memory. A take that finds no prefetch of its
state (none was made, or it was of another state, or made before a restore
or a checkpoint load: `invalidate()`) copies then, on the current stream.
On a CPU the overlap gains nothing (the copy takes the same cores either
way), so it is off unless asked for (`overlap=True`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch

from schedc.diagnostics import RunError, error


class RollbackError(RunError):
    """Survivors' states cannot be brought to one iteration boundary (a bug, not a failure)."""


@dataclass(frozen=True)
class _Saved:
    """An optimizer-state tensor in a copy: the buffer that holds it and the device it goes back to."""

    buffer: torch.Tensor
    device: torch.device


@dataclass
class _Copy:
    """One set of buffers holding a stage's weights and optimizer state."""

    weights: list[torch.Tensor] = field(default_factory=list)  # one per parameter, in the module's order
    state: dict[int, dict] = field(default_factory=dict)  # param index -> {key: _Saved or value}; absent: no state
    buffers: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # state buffers, reused
    ready: object | None = None  # the torch.cuda.Event recorded after a side-stream write into this copy


@dataclass
class StepSnapshot:
    """A stage's weights and optimizer state as they were before its latest optimizer step.

    `take(k)` makes the kept copy that of the state with k steps applied,
    `restore()` copies it back. Buffers are allocated at the first call
    that fills them (no allocation afterwards); with parameters on a CUDA
    device they are pinned host memory. `overlap` (default: on when the
    parameters are on a CUDA device) keeps a second, spare set of buffers
    that `prefetch(k)` fills during the iteration (on a side stream on a
    GPU); `take(k)` then only flips the two. With no module (--emulate)
    nothing is copied.
    """

    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    overlap: bool | None = None  # None: on when the parameters are on a CUDA device
    steps: int | None = None  # steps applied when the kept copy was taken (None: no copy kept)
    _params: list[torch.Tensor] = field(default_factory=list)
    _copies: list[_Copy] = field(default_factory=list)  # [kept] or, overlapped, [kept, spare]
    _prefetched: int | None = None  # steps of the state the spare copy holds (None: nothing usable)
    _side: object | None = None  # the side torch.cuda.Stream (overlapped, on a GPU)
    _device: torch.device | None = None  # the parameters' CUDA device (None: on the CPU)

    def __post_init__(self) -> None:
        self._params = list(self.module.parameters()) if self.module is not None else []
        cuda = [p.device for p in self._params if p.is_cuda]
        self._device = cuda[0] if cuda else None
        if self.overlap is None:
            self.overlap = self._device is not None
        self.overlap = bool(self.overlap and self._params)
        self._copies = [_Copy() for _ in range(2 if self.overlap else 1)] if self._params else []

    # -- the two moments of an iteration ----------------------------------------------------

    def prefetch(self, steps_done: int) -> None:
        """Start copying the current state (`steps_done` steps applied) into the spare buffers.

        Called when an iteration starts: its step has not begun, so the weights and optimizer
        state stay as they are until `take(steps_done)`. On a GPU the copy runs on a side
        stream while the iteration computes; on a CPU it is done here. Without overlap: nothing.
        """
        if not self.overlap:
            return
        self._prefetched = None
        self._write(self._copies[1], side=True)
        self._prefetched = steps_done

    def take(self, steps_done: int) -> None:
        """The kept copy becomes that of the state with `steps_done` steps, just before the step
        changes it. A prefetch of exactly that state is used (the step then waits for its copy on
        the GPU, not the host); otherwise the state is copied here."""
        if self._params:
            if self.overlap:
                spare = self._copies[1]
                if self._prefetched != steps_done:
                    self._write(spare, side=False)
                elif spare.ready is not None:
                    torch.cuda.current_stream(self._device).wait_event(spare.ready)
                self._copies.reverse()  # the spare becomes the kept copy; the old one is the spare
                self._prefetched = None
            else:
                self._write(self._copies[0], side=False)
        self.steps = steps_done

    def restore(self) -> None:
        """Make the weights and optimizer state those of the kept copy (`steps` steps applied)."""
        if not self._params:
            return
        current = torch.cuda.current_stream(self._device) if self._device is not None else None
        if current is not None:  # a side-stream copy still in flight reads the weights or writes a copy
            for copy in self._copies:
                if copy.ready is not None:
                    current.wait_event(copy.ready)
        kept = self._copies[0]
        with torch.no_grad():
            for p, buf in zip(self._params, kept.weights):
                p.copy_(buf, non_blocking=True)
            if self.optimizer is not None:
                for i, p in enumerate(self._params):
                    saved = kept.state.get(i)
                    if saved is None:
                        self.optimizer.state.pop(p, None)  # no state before the step: as if it never ran
                        continue
                    state = self.optimizer.state[p]
                    for key, value in saved.items():
                        if not isinstance(value, _Saved):
                            state[key] = value
                        elif isinstance(state.get(key), torch.Tensor) and state[key].shape == value.buffer.shape:
                            state[key].copy_(value.buffer, non_blocking=True)
                        else:
                            state[key] = value.buffer.to(value.device, copy=True)
        if current is not None:
            current.synchronize()  # restored when this returns, whatever stream reads the weights next
        self._prefetched = None  # a prefetch was of the state just replaced

    def invalidate(self) -> None:
        """The weights were replaced by other means (a checkpoint loaded): neither the kept copy
        nor a prefetch describes the state any more."""
        self.steps = None
        self._prefetched = None

    # -- sizes ------------------------------------------------------------------------------

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the snapshot holds (both copies when overlapped)."""
        return [t for copy in self._copies for t in (*copy.weights, *copy.buffers.values())]

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory."""
        return sum(t.numel() * t.element_size() for t in self.buffers() if t.device.type == "cpu")

    @property
    def device_bytes(self) -> int:
        """Bytes held in accelerator memory (none: the copies live in host memory)."""
        return sum(t.numel() * t.element_size() for t in self.buffers() if t.device.type != "cpu")

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold (weights plus optimizer state, twice when overlapped)."""
        return self.host_bytes + self.device_bytes

    # -- copying ----------------------------------------------------------------------------

    def _write(self, copy: _Copy, *, side: bool) -> None:
        """Copy the weights and optimizer state into `copy`: on a GPU, on the side stream after
        the work queued so far (`side`) or on the current stream, so that the step queued next
        waits for it; on a CPU, here and now."""
        stream = None
        if self._device is not None:
            current = torch.cuda.current_stream(self._device)
            if side:
                if self._side is None:
                    self._side = torch.cuda.Stream(self._device)
                self._side.wait_stream(current)  # after the previous step (and any restore) queued there
                stream = self._side
            elif copy.ready is not None:
                current.wait_event(copy.ready)  # a side-stream write into these buffers may be in flight
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            if not copy.weights:
                copy.weights = [_host_buffer(p) for p in self._params]
            sources = []
            for p, buf in zip(self._params, copy.weights):
                buf.copy_(p, non_blocking=True)
                sources.append(p)
            copy.state = {}
            for i, p in enumerate(self._params):
                state = self.optimizer.state.get(p) if self.optimizer is not None else None
                if not state:
                    continue
                saved = {}
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        saved[key] = value
                        continue
                    buf = copy.buffers.get((i, key))
                    if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                        buf = copy.buffers[(i, key)] = _host_buffer(value)
                    buf.copy_(value, non_blocking=True)  # (a CPU tensor, Adam's step: copied here and now)
                    sources.append(value)
                    saved[key] = _Saved(buf, value.device)
                copy.state[i] = saved
            if stream is not None:
                for t in sources:
                    if t.is_cuda:
                        t.record_stream(stream)  # not reused by the allocator before the copy has read it
                copy.ready = torch.cuda.Event()
                copy.ready.record(stream)
            else:
                copy.ready = None


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for a copy of `like`: pinned when `like` is on a CUDA device."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)


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
