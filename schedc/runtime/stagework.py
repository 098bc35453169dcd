"""The compute of one pipeline stage: F, B and W of a microbatch, and nothing else.

`Runtime` (a rank of a generated program) and `schedc.profile` (timing a
model's stages) both run a stage through this class, so what the profiler
measures is the autograd work the runtime does, call for call.
"""

from __future__ import annotations

import torch
from torch import nn

from schedc.runtime.weightgrad import WeightGradStore, apply_weight_grads, split_linear_layers


class StageWork:
    """A stage's module (on `device`, its linear layers split for W), and the loss on the last."""

    def __init__(self, layers: list[nn.Module], loss_fn: nn.Module | None, *, global_microbatches: int,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.module = nn.Sequential(*layers).to(self.device)
        self.loss_fn = None if loss_fn is None else loss_fn.to(self.device)
        self.global_microbatches = global_microbatches
        self.store = WeightGradStore()
        self.split_layers = split_linear_layers(self.module, self.store)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, inp: torch.Tensor, target: torch.Tensor | None = None, *,
                received: bool = False) -> torch.Tensor:
        """The stage's output; on the last stage (a `loss_fn`), the loss divided by D*M. A
        `received` floating-point input is made to require its gradient (B sends it upstream)."""
        if received and inp.is_floating_point():
            inp.requires_grad_(True)
        out = self.module(inp)
        if self.loss_fn is not None:
            out = self.loss_fn(out, target) / self.global_microbatches
        return out

    def backward(self, out: torch.Tensor, inp: torch.Tensor | None, grad_out: torch.Tensor | None, *,
                 wants_input: bool, defer_weights: bool) -> tuple[torch.Tensor | None, list]:
        """Backward of one microbatch through the stage, freeing its graph: (the gradient w.r.t.
        `inp` when `wants_input`, the entries W still has to compute when `defer_weights`)."""
        if out.grad_fn is None:  # nothing trainable on the way: no graph to run
            return None, []
        self.store.deferring = defer_weights
        try:
            torch.autograd.backward(out, grad_out)
        finally:
            self.store.deferring = False
        wants_input = wants_input and inp is not None and inp.requires_grad
        return (inp.grad if wants_input else None), self.store.take()

    @staticmethod
    def weight(entries: list) -> None:
        """W: the weight gradients `backward(..., defer_weights=True)` left, into `.grad`."""
        apply_weight_grads(entries)

    def forget(self) -> None:
        """Drop entries of a backward that was interrupted."""
        self.store.take()
