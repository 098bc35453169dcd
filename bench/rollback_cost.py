"""What the rollback copy costs: bytes held and time per optimizer step.

Before each optimizer step a live run keeps a copy of the stage's weights
and optimizer state (`schedc.live.rollback.StepSnapshot`) so that survivors
of a failure can undo a step. This measures, for the stages of the shipped
models and for synthetic stages of 1M to 64M parameters (Linear layers;
256M too with `--device cuda` without `--quick`), with Adam:

- on the CPU (default): the bytes of the copy and the time of `take()`
  against the time of the optimizer step itself (median of repeats, one
  thread);
- with `--device cuda`: the GPU time from just before the step to its end
  (CUDA events, median of repeats), measured after a stand-in for the
  iteration's forward and backward work (matrix products on the current
  stream: the "window"), for the step alone; for the step after the copy
  made on the step's path, as before the copy was overlapped (into
  pageable host memory, the host waiting for it; or into pinned host
  memory on the current stream); and for the step after the overlapped
  copy (`prefetch` as the iteration starts, `take` before the step: the
  step waits for what is left of it), with a window of 1.25 times the
  copy's own time and with no window (the copy fully exposed). Also the
  time of the copy alone and the host and GPU bytes of the overlapped copy
  (two sets of pinned host buffers).

    python bench/rollback_cost.py
    python bench/rollback_cost.py --device cuda --quick --json rollback.json
"""

from __future__ import annotations

import argparse
import json
import math
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


def _adam(module: torch.nn.Module) -> torch.optim.Adam:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # Adam's state exists from the first step on
    return opt


def measure(name: str, module: torch.nn.Module, repeats: int = 15) -> dict:
    opt = _adam(module)
    params = [p for p in module.parameters() if p.requires_grad]
    snap = StepSnapshot(module, opt)
    snap.take(1)  # the first take allocates the buffers
    take = _median_ms(lambda: snap.take(1), repeats)
    step = _median_ms(opt.step, repeats)
    restore = _median_ms(snap.restore, repeats)
    n = sum(p.numel() for p in params)
    return {"stage": name, "params": n, "copy_bytes": snap.nbytes, "take_ms": take, "step_ms": step,
            "restore_ms": restore}


class _Window:
    """A stand-in for an iteration's forward and backward work: matrix products queued on the
    current stream, as many as fill `ms` milliseconds of GPU time."""

    SIZE = 4096  # one product of two SIZE x SIZE fp32 matrices: long enough to time with events

    def __init__(self):
        self.a = torch.randn(self.SIZE, self.SIZE, device="cuda")
        self.out = torch.empty_like(self.a)
        for _ in range(3):
            torch.mm(self.a, self.a, out=self.out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.out)
        end.record()
        torch.cuda.synchronize()
        self.one_ms = start.elapsed_time(end) / 10

    def __call__(self, ms: float) -> None:
        for _ in range(math.ceil(ms / self.one_ms)):
            torch.mm(self.a, self.a, out=self.out)


def measure_cuda(name: str, module: torch.nn.Module, window: _Window, repeats: int) -> dict:
    module = module.to("cuda")
    opt = _adam(module)
    params = [p for p in module.parameters() if p.requires_grad]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step_ms(before_iteration, before_step, window_ms: float) -> float:
        """GPU milliseconds from just before the step (after the window) to its end."""
        times = []
        for k in range(repeats + 1):  # (the first: warm-up)
            torch.cuda.synchronize()
            before_iteration(k)
            window(window_ms)
            start.record()
            before_step(k)
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])

    def nothing(k: int) -> None:
        pass

    # The copy on the step's path, as before it was overlapped.
    tensors = params + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    pageable = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]

    def to_pageable(k: int) -> None:
        for buf, t in zip(pageable, tensors):
            buf.copy_(t)  # (pageable: the host waits for each copy)

    pinned = StepSnapshot(module, opt, overlap=False)
    pinned.take(0)
    torch.cuda.synchronize()
    copy_alone = _median_ms(lambda: (pinned.take(0), torch.cuda.synchronize()), repeats)

    snap = StepSnapshot(module, opt)  # overlapped: the default on a GPU
    allocated = torch.cuda.memory_allocated()
    for k in range(2):  # both sets of buffers allocated
        snap.prefetch(k)
        snap.take(k)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated, "the overlapped copy allocated GPU memory"
    prefetch_alone = _median_ms(lambda: (snap.prefetch(0), torch.cuda.synchronize()), repeats)
    window_ms = 1.25 * prefetch_alone

    row = {"stage": name, "params": sum(p.numel() for p in params), "host_bytes": snap.host_bytes,
           "device_bytes": snap.device_bytes, "copy_ms": copy_alone, "prefetch_ms": prefetch_alone,
           "window_ms": window_ms}
    row["step_ms"] = step_ms(nothing, nothing, window_ms)
    row["pageable_ms"] = step_ms(nothing, to_pageable, window_ms)
    row["pinned_ms"] = step_ms(nothing, pinned.take, window_ms)
    row["overlapped_ms"] = step_ms(snap.prefetch, snap.take, window_ms)
    row["exposed_ms"] = step_ms(snap.prefetch, snap.take, 0.0)
    return row


def stages(sizes=(1, 16, 64)):
    from schedc.models import gpt, mlp

    for model, build, pp in (("gpt", gpt.build, 2), ("mlp", mlp.build, 2)):
        layers, _ = build()
        layers = list(layers)
        for s in range(pp):
            a, b = s * len(layers) // pp, (s + 1) * len(layers) // pp
            yield f"schedc.models.{model} stage {s} of {pp}", torch.nn.Sequential(*layers[a:b])
    for millions in sizes:
        width = int((millions * 1e6 / 4) ** 0.5)
        yield f"4 x Linear({width}, {width})", torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def _cpu(args) -> list[dict]:
    torch.set_num_threads(1)
    rows = [measure(name, module, repeats=5 if args.quick else 15) for name, module in stages()]
    print("| stage | parameters | copy | take ms | optimizer step ms | take / step | restore ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['params']:,} | {r['copy_bytes'] / 2**20:.2f} MiB | {r['take_ms']:.3f} | "
              f"{r['step_ms']:.3f} | {r['take_ms'] / r['step_ms']:.2f} | {r['restore_ms']:.3f} |")
    return rows


def _cuda(args) -> list[dict]:
    if not torch.cuda.is_available():
        print("--device cuda: this torch sees no CUDA GPU", file=sys.stderr)
        sys.exit(2)
    torch.backends.cuda.matmul.allow_tf32 = False  # (the window's products: a fixed, known cost)
    window = _Window()
    repeats = 5 if args.quick else 15
    sizes = (1, 16, 64) if args.quick else (1, 16, 64, 256)
    rows = []
    for name, module in stages(sizes):
        rows.append(measure_cuda(name, module, window, repeats))
        del module
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU ms from just before the optimizer "
          "step to its end, after a window of forward/backward stand-in work")
    print("| stage | parameters | host bytes (2 copies) | GPU bytes | copy alone ms | window ms | step ms | "
          "+ copy to pageable | + copy to pinned | + overlapped copy | + overlapped, no window |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['params']:,} | {r['host_bytes'] / 2**20:.1f} MiB | {r['device_bytes']} | "
              f"{r['prefetch_ms']:.2f} | {r['window_ms']:.2f} | {r['step_ms']:.3f} | {r['pageable_ms']:.3f} | "
              f"{r['pinned_ms']:.3f} | {r['overlapped_ms']:.3f} | {r['exposed_ms']:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (and no 256M stage on a GPU)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = parser.parse_args(argv)
    rows = _cuda(args) if args.device == "cuda" else _cpu(args)
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
