"""What the rollback copy costs: bytes held and time per optimizer step (CPU).

Before each optimizer step a live run copies the stage's weights and
optimizer state (`schedc.live.rollback.StepSnapshot`) so that survivors of a
failure can undo a step. This measures, for the stages of the shipped models
and for synthetic stages of 1M to 64M parameters (Linear layers), with Adam:
the bytes of the copy and the time of `take()` against the time of the
optimizer step itself (median of repeats, one thread).

    python bench/rollback_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schedc.live.rollback import StepSnapshot  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(name: str, module: torch.nn.Module, repeats: int = 15) -> dict:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # Adam's state exists from the first step on
    snap = StepSnapshot(module, opt)
    snap.take(1)  # the first take allocates the buffers
    take = _median_ms(lambda: snap.take(1), repeats)
    step = _median_ms(opt.step, repeats)
    restore = _median_ms(snap.restore, repeats)
    n = sum(p.numel() for p in params)
    return {"stage": name, "params": n, "copy_bytes": snap.nbytes, "take_ms": take, "step_ms": step,
            "restore_ms": restore}


def stages():
    from schedc.models import gpt, mlp

    for model, build, pp in (("gpt", gpt.build, 2), ("mlp", mlp.build, 2)):
        layers, _ = build()
        layers = list(layers)
        for s in range(pp):
            a, b = s * len(layers) // pp, (s + 1) * len(layers) // pp
            yield f"schedc.models.{model} stage {s} of {pp}", torch.nn.Sequential(*layers[a:b])
    for millions in (1, 16, 64):
        width = int((millions * 1e6 / 4) ** 0.5)
        yield f"4 x Linear({width}, {width})", torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def main() -> int:
    torch.set_num_threads(1)
    rows = [measure(name, module) for name, module in stages()]
    print("| stage | parameters | copy | take ms | optimizer step ms | take / step | restore ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['params']:,} | {r['copy_bytes'] / 2**20:.2f} MiB | {r['take_ms']:.3f} | "
              f"{r['step_ms']:.3f} | {r['take_ms'] / r['step_ms']:.2f} | {r['restore_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
