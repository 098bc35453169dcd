"""Backward split in two: B computes input gradients now, W computes weight gradients later.

A decoupled schedule runs B (the gradient a stage sends upstream) long
before W (its weight gradients), and plans that between the two a GPU holds
only the `stash`: what W needs, not the whole autograd graph. This module
makes the runtime hold exactly that. Every `nn.Linear` of a stage runs
through `_SplitLinear`, whose backward, while a `WeightGradStore` is
deferring, returns the input gradient and keeps the pair (layer input,
output gradient) instead of computing the weight gradient; B then frees the
graph, and W computes ``grad_W += g^T x`` and ``grad_b += sum(g)`` from the
kept pairs and drops them. Other parameters (layer norms, embeddings,
convolutions) get their gradients in B, as in Zero Bubble's implementation:
in a transformer nearly all weight-gradient FLOPs are in its linear layers.

When the store is not deferring (a backward that is not decoupled), the
linear layer computes its weight gradients at once, like `nn.Linear`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class WeightGradStore:
    """The (layer, input, output gradient) triples one B left for its W."""

    deferring: bool = False
    entries: list = field(default_factory=list)

    def take(self) -> list:
        """The entries kept so far, leaving the store empty (one B's worth)."""
        out, self.entries = self.entries, []
        return out


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, store):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.store.deferring:
            ctx.store.entries.append((ctx.layer, x, grad_out))
            return grad_in, None, None, None, None
        grad_w, grad_b = linear_weight_grads(ctx.layer, x, grad_out)
        return grad_in, grad_w, grad_b, None, None


def linear_weight_grads(layer: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor):
    """(grad of weight, grad of bias or None) of ``F.linear(x, weight, bias)`` for `grad_out`."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = g.t().mm(x.reshape(-1, x.shape[-1])) if layer.weight.requires_grad else None
    grad_b = g.sum(0) if layer.bias is not None and layer.bias.requires_grad else None
    return grad_w, grad_b


def split_linear_layers(module: nn.Module, store: WeightGradStore) -> int:
    """Route every `nn.Linear` (exactly that type) of `module` through the split backward;
    returns how many. Weights, state_dict keys and forward results are unchanged."""
    count = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.forward = _bound_forward(layer, store)
            count += 1
    return count


def _bound_forward(layer: nn.Linear, store: WeightGradStore):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, layer.weight, layer.bias)
        return _SplitLinear.apply(x, layer.weight, layer.bias, layer, store)

    return forward


def apply_weight_grads(entries: list) -> None:
    """W: accumulate the weight gradients of the kept entries into `.grad`."""
    for layer, x, grad_out in entries:
        grad_w, grad_b = linear_weight_grads(layer, x, grad_out)
        for param, grad in ((layer.weight, grad_w), (layer.bias, grad_b)):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)


def held_bytes(tensors, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once), leaving out
    storages whose data pointer is in `exclude` (the stage's parameters)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in exclude or ptr == 0:
            continue
        seen[ptr] = storage.nbytes()
    return sum(seen.values())
