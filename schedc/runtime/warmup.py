"""Imported by the forkserver of `schedc run` so every rank forks warm.

torch pays seconds on the first backward and the first optimizer step of a
process (lazy imports behind autograd and torch.optim); doing one tiny step
here, once, before any rank is forked, saves each rank of each run from it.

On a torch built for GPUs the warm-up runs no backward and no optimizer step:
a backward starts autograd's per-device threads, after which a forked process
cannot run autograd at all ("Unable to handle autograd's threading in
combination with fork-based multiprocessing"), and Adam's step asks CUDA
whether a graph is being captured, which initialises CUDA, after which a
forked process cannot use it ("CUDA error: initialization error"). There the
ranks pay their first backward and step themselves.
"""

import torch

torch.set_num_threads(1)

#: Whether this torch was built for a GPU (asked without touching the GPU).
GPU_BUILD = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def _warm() -> None:
    layer = torch.nn.Linear(2, 2)
    for make in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = make(layer.parameters(), lr=1e-3)
        x = torch.ones(1, 2, requires_grad=not GPU_BUILD)
        out = layer(x).sum()
        if not GPU_BUILD:
            torch.autograd.grad(out, x, retain_graph=True)
            torch.autograd.backward(out, inputs=list(layer.parameters()))
            opt.step()
    torch.nn.functional.scaled_dot_product_attention(*(torch.ones(1, 1, 2, 2),) * 3, is_causal=True)


_warm()
