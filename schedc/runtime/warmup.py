"""Imported by the forkserver of `schedc run` so every rank forks warm.

torch pays seconds on the first backward and the first optimizer step of a
process (lazy imports behind autograd and torch.optim); doing one tiny step
here, once, before any rank is forked, saves each rank of each run from it.
"""

import torch

torch.set_num_threads(1)


def _warm() -> None:
    layer = torch.nn.Linear(2, 2)
    for make in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = make(layer.parameters(), lr=1e-3)
        x = torch.ones(1, 2, requires_grad=True)
        out = layer(x).sum()
        torch.autograd.grad(out, x, retain_graph=True)
        torch.autograd.backward(out, inputs=list(layer.parameters()))
        opt.step()
    torch.nn.functional.scaled_dot_product_attention(*(torch.ones(1, 1, 2, 2),) * 3, is_causal=True)


_warm()
