"""Single-process training on the same global batch: the yardstick of exactness.

One iteration sums ``loss_fn(model(x), y) / (D*M)`` over the D*M microbatches
``batch(iteration, d, m)`` and steps the same optimizer, so a correct run of
the generated programs, under any failure set, ends with the same weights.
"""

from __future__ import annotations

from torch import nn

from schedc.runtime.manifest import Manifest, build_model, call_with_model_args, data_ref, load_callable
from schedc.runtime.primitives import make_optimizer


def reference_train(manifest: Manifest, iterations: int, device: str = "cpu") -> tuple[dict, list[float]]:
    """(state_dict of the full nn.Sequential, in host memory; mean loss per iteration) after
    `iterations`, computed on `device`."""
    layers, loss_fn, _ = build_model(manifest)
    model = nn.Sequential(*layers).to(device)
    loss_fn = loss_fn.to(device) if isinstance(loss_fn, nn.Module) else loss_fn
    batch = load_callable(data_ref(manifest), "model.data", (manifest.spec_dir,))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(manifest.optimizer, params, manifest.lr)
    n = manifest.global_microbatches
    losses = []
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for d in range(manifest.dp):
            for m in range(manifest.microbatches):
                x, y = call_with_model_args(batch, manifest.model_args, it, d, m)
                x, y = x.to(device), y.to(device)
                loss = loss_fn(model(x), y) / n
                loss.backward()
                total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, losses
