"""The primitives a generated program calls, one per op of its schedule.

A rank's program is a straight line of calls in schedule order::

    rt.forward(d=1, stage=2, mb=5, recv_from=4, send_to=6, us=1000)
    rt.backward_input(d=1, stage=2, mb=5, recv_from=6, send_to=4, us=1000)
    rt.backward_weight(d=1, stage=2, mb=5, us=800)
    rt.optimizer_step(us=400)

Ranks are *schedule* ranks (``d*S + s`` by default). Why this cannot
deadlock for a verified schedule: every send is an ``isend`` (never blocks)
posted as soon as its value exists, and the only blocking calls are receives
and the stage all-reduce, which the schedule orders exactly as the simulator
does; so the programs run as the simulator runs them, and the simulator
finding no deadlock is part of verification. The messages and their
timeouts are `schedc.runtime.transport`'s.

Exactness: each microbatch's loss is divided by D*M and the
stage all-reduce sums, so the weights after an iteration do not depend on
which GPU ran which microbatch, nor on how many GPUs a stage has left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from schedc.diagnostics import RunError, error
from schedc.runtime.channels import ACTIVATION, GRADIENT, SHADOW_GRADIENT
from schedc.runtime.manifest import (Manifest, build_model, call_with_model_args, data_ref, load_callable,
                                     stage_layer_keys)
from schedc.runtime.stagework import StageWork, run_layers
from schedc.runtime.transport import EMULATED_MESSAGE, Message, Transport


@dataclass
class _Stash:
    """What one microbatch holds at this stage: from F to B its input, output and (through the
    output) autograd graph; from B to W only what W needs (`weight_grads`, the stash)."""

    inp: torch.Tensor | None
    out: torch.Tensor | None
    grad_out: torch.Tensor | None = None
    backward_done: bool = False
    weight_grads: list = field(default_factory=list)

    def keep_only_weight_grads(self) -> None:
        self.inp = self.out = self.grad_out = None


class OpObserver(Protocol):
    """Told of every op a `Runtime` runs (a live supervisor's worker: injection, progress, timing).

    `op_ready` is called once the op's inputs are there, before it computes or
    sends anything (for O: before the all-reduce); `op_done` after its sends
    are posted (for O: after the step). `kind` is F, B, W or O; `d` and `mb`
    name the microbatch (O: the GPU's own pipeline and None).
    """

    def op_ready(self, kind: str, d: int, mb: int | None) -> None: ...

    def op_done(self, kind: str, d: int, mb: int | None, us: int) -> None:
        """`us`: the op's planned duration (the schedule's, at the GPU's planned speed)."""

    def step_starts(self, steps_done: int) -> None:
        """The optimizer step is about to change the weights (its all-reduce is done): nothing
        can interrupt it any more. `steps_done`: the steps applied before it."""


@dataclass
class Runtime:
    """One rank's state: its stage module, optimizer, stashes; the ops its program calls.

    `emulate` replaces every compute op by ``time.sleep`` of its scheduled
    duration (the ``us=`` of the call); communication stays real (small
    tensors, since no model is built). `steps_done` counts optimizer steps
    applied to this rank's weights (a live run rolls back to a step count).
    """

    manifest: Manifest
    rank: int
    transport: Transport
    emulate: bool = False
    device: str = "cpu"
    observer: OpObserver | None = None
    iteration: int = 0
    steps_done: int = 0
    # this iteration's sum of (loss / D*M) over the microbatches ending here (`loss_sum`); a tensor
    # on the rank's device, so that a GPU rank does not wait for its GPU after every microbatch
    _loss: torch.Tensor | float = 0.0
    # With `reduce_loss`, the last stage also sums `loss_sum` over its GPUs in its optimizer op,
    # before stepping, so each of them knows the iteration's whole loss (`iteration_loss`) once
    # the stage has stepped: a live run knows the loss of an iteration even if another last-stage
    # GPU died right after its step.
    reduce_loss: bool = False
    iteration_loss: float | None = None
    # Fault injection: every op takes this many times longer (emulated ops sleep longer, computed
    # ops spin on this rank's thread afterwards, on a GPU queue a sleep kernel: `slow_down`), as on a
    # GPU gone slow. Below 1 (emulated only): a GPU faster than its plan assumes.
    slowdown: float = 1.0
    # With `keep_step_grad`, `last_step_grad` is the summed gradient of the last optimizer step
    # (flat, in `params` order): what a live run streams to a rejoining GPU of this stage.
    keep_step_grad: bool = False
    last_step_grad: torch.Tensor | None = None
    # Live shadows (`schedc.live.shadow`): the holders this rank streams its stage's summed
    # gradient to after each all-reduce; the copy of the previous stage it holds (a
    # `ShadowStage`), and the rank that streams that stage's gradient to it in this plan.
    shadow_to: tuple[int, ...] = ()
    shadow: object | None = None
    shadow_from: int | None = None
    _stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)

    def __post_init__(self):
        self.stage = self.manifest.coords[self.rank][1]
        self.last = self.stage == self.manifest.pp - 1
        # The split of the model into stages as this run resolves it (the even split when the
        # spec gives none), and the number of layers: what a checkpoint records to be re-sharded.
        self.partition: tuple[tuple[int, int], ...] | None = None
        self.model_layers: int | None = None
        if self.emulate:
            self.module = None
            self.shapes = [((EMULATED_MESSAGE,), torch.float32)] * self.manifest.pp
            return
        layers, loss_fn, partition = build_model(self.manifest)
        self.partition = tuple(tuple(p) for p in partition)
        self.model_layers = len(layers)
        data = load_callable(data_ref(self.manifest), "model.data", (self.manifest.spec_dir,))
        self.data = lambda it, d, mb: call_with_model_args(data, self.manifest.model_args, it, d, mb)
        self.shapes = _boundary_shapes(layers, partition, self.data(0, 0, 0)[0])
        a, b = partition[self.stage]
        self.work = StageWork(layers[a:b], loss_fn if self.last else None,
                              global_microbatches=self.manifest.global_microbatches, device=self.device,
                              first_layer=a)
        self.module, self.params = self.work.module, self.work.params
        self.state_keys = stage_layer_keys(layers, partition, self.stage)
        self.optimizer = make_optimizer(self.manifest.optimizer, self.params, self.manifest.lr)
        for p in self.params:
            p.grad = torch.zeros_like(p)

    # -- the ops -------------------------------------------------------------

    def forward(self, *, d: int, stage: int, mb: int, recv_from: int | None, send_to: int | None,
                us: int = 0) -> None:
        """F(d, mb, stage): receive the input (or load data), run the stage, send the output."""
        op = f"d{d}:{stage}F{mb}"
        self._check_stage(stage, op)
        inp = None
        if recv_from is not None:
            shape, dtype = self.shapes[stage - 1]
            inp = self.transport.recv(shape, dtype, recv_from, self._message(ACTIVATION, d, mb, stage - 1),
                                      f"the activation of {op}")
        ready = time.perf_counter()
        if self.observer is not None:
            self.observer.op_ready("F", d, mb)
        if self.emulate:
            self.run_emulated(us, ready)
            out = torch.zeros(self.shapes[stage][0])
        else:
            received = inp is not None
            if inp is None:
                inp = self.batch(self.iteration, d, mb)[0]
            target = self.batch(self.iteration, d, mb)[1] if self.last else None
            out = self.work.forward(inp, target, received=received)
            if self.last:
                self._loss = self._loss + out.detach()
            self.slow_down(ready, us)
        if send_to is not None:
            self.transport.send(out.detach(), send_to, self._message(ACTIVATION, d, mb, stage),
                                f"the activation of {op}")
        self._stash[(d, mb)] = _Stash(inp=inp, out=out)
        if self.observer is not None:
            self.observer.op_done("F", d, mb, us)

    def backward_input(self, *, d: int, stage: int, mb: int, recv_from: int | None, send_to: int | None,
                       us: int = 0) -> None:
        """B(d, mb, stage), decoupled: the gradient w.r.t. the stage input (and those of parameters
        outside linear layers); frees the graph, keeping only what W needs (`schedc.runtime.weightgrad`)."""
        st = self._backward_start(d, stage, mb, recv_from, "B")
        ready = time.perf_counter()
        grad_in = None
        if self.emulate:
            grad_in = self._emulated_backward(us, ready, stage, send_to)
        else:
            grad_in, st.weight_grads = self.work.backward(st.out, st.inp, st.grad_out, wants_input=send_to is not None,
                                                          defer_weights=True)
            self.slow_down(ready, us)
        self._backward_send(grad_in, d, stage, mb, send_to, "B")
        st.keep_only_weight_grads()
        st.backward_done = True
        if self.observer is not None:
            self.observer.op_done("B", d, mb, us)

    def backward_weight(self, *, d: int, stage: int, mb: int, us: int = 0) -> None:
        """W(d, mb, stage): accumulate the weight gradients, then free the stash."""
        ready = time.perf_counter()
        st = self._stash.pop((d, mb), None)
        if st is None or not st.backward_done:
            raise RunError([error("E540", f"rank {self.rank} runs d{d}:{stage}W{mb} before its B",
                                  hint="the program does not follow a verified schedule; recompile")])
        if self.observer is not None:
            self.observer.op_ready("W", d, mb)
        if self.emulate:
            self.run_emulated(us, ready)
        else:
            self.work.weight(st.weight_grads)
            self.slow_down(ready, us)
        if self.observer is not None:
            self.observer.op_done("W", d, mb, us)

    def backward(self, *, d: int, stage: int, mb: int, recv_from: int | None, send_to: int | None,
                 us: int = 0) -> None:
        """B(d, mb, stage) without decoupling: input and weight gradients at once; frees the stash."""
        st = self._backward_start(d, stage, mb, recv_from, "B")
        ready = time.perf_counter()
        grad_in = None
        if self.emulate:
            grad_in = self._emulated_backward(us, ready, stage, send_to)
        else:
            grad_in, _ = self.work.backward(st.out, st.inp, st.grad_out, wants_input=send_to is not None,
                                            defer_weights=False)
            self.slow_down(ready, us)
        self._backward_send(grad_in, d, stage, mb, send_to, "B")
        del self._stash[(d, mb)]
        if self.observer is not None:
            self.observer.op_done("B", d, mb, us)

    def _emulated_backward(self, us: int, ready: float, stage: int, send_to: int | None):
        """--emulate: sleep for the op's cost; a placeholder gradient (of the emulated size) to send."""
        self.run_emulated(us, ready)
        return torch.zeros(self.shapes[stage - 1][0]) if send_to is not None else None

    def optimizer_step(self, *, us: int = 0) -> None:
        """O: sum the gradients over the live GPUs of this stage, then step the optimizer.

        Without staggering, every rank first waits for every other (a global
        barrier), as the schedule's O follows every stage's last W.
        """
        if self._stash:
            left = ", ".join(f"d{d}:{self.stage}?{m}" for d, m in sorted(self._stash))
            raise RunError([error("E541", f"rank {self.rank} reaches its optimizer step with microbatches "
                                          f"still in flight: {left}",
                                  hint="the program does not follow a verified schedule; recompile")])
        own_dp = self.manifest.coords[self.rank][0]
        if self.observer is not None:
            self.observer.op_ready("O", own_dp, None)
        if not self.manifest.stagger_optimizer:
            self.transport.barrier(f"every rank to finish its backward work of iteration {self.iteration}")
        if self.reduce_loss and self.last and not self.emulate:
            total = torch.tensor([self.loss_sum], dtype=torch.float64, device=self.device)
            self.transport.all_reduce_stage(self.stage, total)
            self.iteration_loss = float(total[0])
        if self.emulate:
            self.transport.all_reduce_stage(self.stage, torch.zeros(1))
            self.run_emulated(us, time.perf_counter())
            if self.observer is not None:
                self.observer.step_starts(self.steps_done)
            self._step_shadow(None)
            self.steps_done += 1
            self._post_shadow_gradient()
        else:
            started = time.perf_counter()
            self._all_reduce_and_step()
            self.slow_down(started, us)
        if self.observer is not None:
            self.observer.op_done("O", own_dp, None, us)

    def _all_reduce_and_step(self) -> None:
        """Sum the gradients over the stage, step, count the step. Nothing that can fail or be
        interrupted comes between the step and its count: a live run rolls back by that count."""
        flat = None
        if self.params:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            self.transport.all_reduce_stage(self.stage, flat)
            for holder in self.shadow_to:  # (sent as it is: nothing writes to `flat` afterwards)
                self.transport.send(flat, holder, self._message(SHADOW_GRADIENT, 0, 0, self.stage),
                                    f"the summed gradient of stage {self.stage}")
        held = self._shadow_gradient()
        if not self.params and self.shadow is None:
            self.steps_done += 1
            return
        if self.observer is not None:
            self.observer.step_starts(self.steps_done)
        if self.keep_step_grad and flat is not None:
            self.last_step_grad = flat  # a fresh tensor every step: nothing writes to it afterwards
        self._step_shadow(held)
        if flat is None:
            self.steps_done += 1
        else:
            self.apply_step(flat)
        self._post_shadow_gradient()

    # A shadow lags its holder by one step (`schedc.live.shadow`): the gradient of step k comes
    # while the holder computes iteration k + 1, and is applied in that iteration's optimizer op,
    # just before the holder's own step k + 1. Nothing then waits for the shadowed stage's
    # all-reduce, and the transfer overlaps the next iteration.

    def _shadow_gradient(self) -> tuple[int, torch.Tensor] | None:
        """The last step's summed gradient of the stage this rank shadows (waited for, if it has not
        come yet), with the step count it brings the shadow to."""
        copy = self.shadow
        if copy is None or copy.pending is None:
            return None
        steps, work, buf = copy.pending
        got = self.transport.wait_posted(work, buf, self.shadow_from,
                                         f"the summed gradient of stage {copy.stage} (its shadow)")
        copy.pending = None  # (only now: a wait that failed leaves it to `ShadowStage.settle`)
        return steps, got

    def _step_shadow(self, held: tuple[int, torch.Tensor] | None) -> None:
        """Bring the shadow to this rank's step count, just before this rank's own step. A shadow
        that cannot be (a gradient missed, none streamed in this plan) is stale from here on."""
        copy = self.shadow
        if copy is None:
            return
        if not copy.streams:  # (no state: it only counts)
            copy.steps = self.steps_done + 1
            return
        if held is not None and held[0] == copy.steps + 1:
            copy.apply(held[1])
        if copy.steps != self.steps_done:
            copy.valid = False

    def _post_shadow_gradient(self) -> None:
        """Post the receive of the step just taken's gradient of the shadowed stage (see above)."""
        copy = self.shadow
        if copy is None or not copy.streams:
            return
        if self.shadow_from is None:
            copy.valid = False
            return
        work, buf = self.transport.post_recv((copy.numel,), copy.params[0].dtype, self.shadow_from,
                                             self._message(SHADOW_GRADIENT, 0, 0, copy.stage),
                                             f"the summed gradient of stage {copy.stage} (its shadow)")
        copy.pending = (self.steps_done, work, buf)

    def apply_step(self, flat: torch.Tensor | None) -> None:
        """One optimizer step with the stage's summed gradient `flat`, counted. A GPU that catches
        up replays its donor's steps with this: the same code on the same state, so the same bits."""
        if self.emulate or not self.params:
            self.steps_done += 1
            return
        step_with(self.params, self.optimizer, flat)
        self.steps_done += 1

    # -- iteration bookkeeping --------------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        self.transport.begin_iteration()
        self.iteration = iteration
        self._loss = 0.0
        self.iteration_loss = None

    @property
    def loss_sum(self) -> float:
        """This iteration's sum of loss/(D*M) over the microbatches that ended at this rank."""
        return float(self._loss)

    def batch(self, iteration: int, d: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch (d, mb) of `iteration` from `model.data`, on this rank's device (the job's
        microbatch it stands for, in a plan laid out anew: `Manifest.data_index`)."""
        x, y = self.data(iteration, *self.manifest.data_index(d, mb))
        return x.to(self.device), y.to(self.device)

    def abandon_iteration(self) -> None:
        """Forget the interrupted iteration's work: stashes, accumulated gradients, loss."""
        self._stash.clear()
        if not self.emulate:
            self.work.forget()
        self._loss = 0.0
        if not self.emulate:
            for p in self.params:
                p.grad.zero_()

    def retarget(self, manifest: Manifest, transport: Transport) -> None:
        """Run the programs of another plan of the same job (a new generation of a live run):
        the same stage, weights and optimizer; new peers and process groups."""
        if manifest.coords.get(self.rank, (None, self.stage))[1] != self.stage:
            raise RunError([error("E540", f"rank {self.rank} holds stage {self.stage}; the new plan "
                                          "gives it another stage")])
        self.abandon_iteration()
        self.manifest = manifest
        self.transport = transport

    def stage_state(self) -> dict:
        """Everything needed to resume this stage elsewhere: weights, optimizer state, steps, and
        `params`, the module's key of each parameter the optimizer state indexes, in its order
        (what re-sharding onto another split needs, `schedc.live.reshard`). Tensors are copies
        (safe to save from another thread while training goes on)."""
        if self.emulate:
            return {"steps": self.steps_done, "model": {}, "optimizer": None, "params": []}
        optimizer = to_host(self.optimizer.state_dict()) if self.optimizer is not None else None
        model = to_host(self.module.state_dict())
        return {"steps": self.steps_done, "model": model, "optimizer": optimizer,
                "params": optimized_names(self.module)}

    def load_stage_state(self, state: dict) -> None:
        """Make this stage's weights, optimizer state and step count those of `state`."""
        self.abandon_iteration()
        self.steps_done = int(state["steps"])
        if self.emulate:
            return
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def initial_stage_state(self, stage: int | None = None) -> dict:
        """The stage (this rank's, or `stage`) as `model.source` builds it, before any step
        (what a run starts from)."""
        if self.emulate:
            return {"steps": 0, "model": {}, "optimizer": None}
        layers, _, partition = build_model(self.manifest)
        a, b = partition[self.stage if stage is None else stage]
        fresh = nn.Sequential(*layers[a:b])
        params = [p for p in fresh.parameters() if p.requires_grad]
        optimizer = make_optimizer(self.manifest.optimizer, params, self.manifest.lr)
        return {"steps": 0, "model": fresh.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the keys of the full nn.Sequential of `model.source`."""
        local = self.module.state_dict()
        return {full: local[key].detach().to("cpu", copy=True) for key, full in self.state_keys}

    # -- helpers ------------------------------------------------------------------

    def run_emulated(self, us: float, ready: float) -> None:
        _sleep_us(us * self.slowdown, ready)

    def slow_down(self, ready: float, us: float = 0) -> None:  # (no-op unless slowdown > 1)
        """An injected slowdown of a computed op: busy this rank's thread (slowdown - 1) times as long.
        On a GPU the op's kernels run after their launch returns, so a busy host thread would not
        slow them: queue a sleep kernel of (slowdown - 1) x the op's planned time `us` instead."""
        if self.slowdown > 1.0 and str(self.device).startswith("cuda"):
            from schedc.runtime import gpusleep

            gpusleep.sleep(self.device, (self.slowdown - 1.0) * us)
        elif self.slowdown > 1.0:
            until = ready + (time.perf_counter() - ready) * self.slowdown
            while time.perf_counter() < until:
                pass

    def _check_stage(self, stage: int, op: str) -> None:
        if stage != self.stage:
            raise RunError([error("E540", f"rank {self.rank} holds stage {self.stage} but its program runs {op}",
                                  hint="the program does not follow a verified schedule; recompile")])

    def _message(self, kind: int, d: int, mb: int, boundary: int) -> Message:
        return Message(self.iteration, kind, d, mb, boundary)

    def _backward_start(self, d: int, stage: int, mb: int, recv_from: int | None, kind: str) -> _Stash:
        op = f"d{d}:{stage}{kind}{mb}"
        self._check_stage(stage, op)
        st = self._stash.get((d, mb))
        if st is None:
            raise RunError([error("E540", f"rank {self.rank} runs {op} before its F",
                                  hint="the program does not follow a verified schedule; recompile")])
        if recv_from is not None:
            shape, dtype = self.shapes[stage]
            st.grad_out = self.transport.recv(shape, dtype, recv_from, self._message(GRADIENT, d, mb, stage),
                                              f"the output gradient of {op}")
        if self.observer is not None:
            self.observer.op_ready("B", d, mb)
        return st

    def _backward_send(self, grad_in, d: int, stage: int, mb: int, send_to: int | None, kind: str) -> None:
        if send_to is None:
            return
        if grad_in is None:  # the input does not depend on anything trainable: send zeros
            shape, dtype = self.shapes[stage - 1]
            grad_in = torch.zeros(shape, dtype=dtype, device=self.device)
        self.transport.send(grad_in.detach(), send_to, self._message(GRADIENT, d, mb, stage - 1),
                            f"the input gradient of d{d}:{stage}{kind}{mb}")


def to_host(value):
    """A copy of `value` (an optimizer's state_dict) with every tensor copied to host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value  # numbers, strings, None: immutable


def step_with(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, flat: torch.Tensor) -> None:
    """One optimizer step of `params` with their summed gradient `flat` (in `params` order); the
    gradients are zero again afterwards. The one code a stage's step runs, wherever it runs (its
    own GPUs, a GPU that catches up, a shadow's holder): the same state and gradient, the same bits."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n
    optimizer.step()
    for p in params:
        p.grad.zero_()


def optimized_names(module: nn.Module) -> list[str]:
    """The key of each parameter a stage's optimizer steps, in the optimizer's order: entry i
    names the parameter that its state_dict's ``state[i]`` belongs to (the order of `params`
    in `Runtime` and `initial_stage_state`)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise RunError([error("E514", f"unknown optimizer `{name}`", hint="use sgd, adam or adamw")])


def _boundary_shapes(layers, partition, sample) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each stage's output, from one forward of a sample (assumed fixed)."""
    shapes = []
    x = sample
    with torch.no_grad():
        for a, b in partition:
            x = run_layers(layers[a:b], x, a)
            shapes.append((tuple(x.shape), x.dtype))
    return shapes


def _sleep_us(us: int, ready: float) -> None:
    """Sleep until `us` microseconds after `ready` (when the op's inputs were there).

    Counting from `ready`, not from now, folds the runtime's own per-op
    overhead into the op's duration, as a real kernel's launch cost would be.
    Pure sleep: spinning would steal the CPU other ranks need.
    """
    left = ready + us / 1e6 - time.perf_counter()
    if left > 0:
        time.sleep(left)
