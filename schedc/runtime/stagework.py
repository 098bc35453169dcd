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

    def __init__(self, layers: list[nn.Module], loss_fn, *, global_microbatches: int,
                 device: str | torch.device = "cpu", first_layer: int = 0):
        self.device = torch.device(device)
        self.first_layer = first_layer  # index of layers[0] in the list `model.source` returns
        self.module = nn.Sequential(*layers).to(self.device)
        # An nn.Module loss (which may hold buffers) goes to the device; a plain function as it is.
        self.loss_fn = loss_fn.to(self.device) if isinstance(loss_fn, nn.Module) else loss_fn
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
        out = run_layers(self.module, inp, self.first_layer)
        if self.loss_fn is not None:
            try:
                out = self.loss_fn(out, target)
            except Exception as exc:
                raise _layer_error(None, self.loss_fn, out, exc) from exc
            out = out / self.global_microbatches
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


def run_layers(layers, x, first_layer: int = 0):
    """`x` through `layers` in turn; a layer's error becomes E515 naming that layer."""
    for i, layer in enumerate(layers):
        try:
            x = layer(x)
        except Exception as exc:
            raise _layer_error(first_layer + i, layer, x, exc) from exc
    return x


def _layer_error(index: int | None, layer: nn.Module, inp, exc: Exception) -> Exception:
    """A model's own error, said at the layer it happened in (not only deep inside torch)."""
    from schedc.diagnostics import RunError, error, exception_site

    shape = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
    what = f"layer {index} of model.source" if index is not None else "the loss of model.source"
    text = repr(layer).splitlines()[0]
    text = text if len(text) <= 80 else text[:77] + "..."
    site = exception_site(exc, outside_schedc=True)
    return RunError([error("E515", f"{what} (`{text}`) failed on an input of shape {shape}: "
                                   f"{type(exc).__name__}: {exc}" + (f" (at {site})" if site else ""),
                           hint="the model's layers do not fit together (or with model.data); "
                                "train it in one process first")])
