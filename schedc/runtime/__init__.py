"""What generated per-rank programs call, and how `schedc run` starts them.

- `schedc.runtime.manifest`: `programs.json` (what the programs share: live
  ranks, stage groups, partition, model/data binding, optimizer) and the
  binding of `model.source` / `model.data` to real code.
- `schedc.runtime.primitives`: `Runtime`, the primitives one rank's program
  calls in schedule order (`forward`, `backward_input`, `backward_weight`,
  `backward`, `optimizer_step`).
- `schedc.runtime.transport`: `Transport`, a rank's messages and stage
  collectives with timeouts (`Interrupted` when a live run aborts them).
- `schedc.runtime.channels`: the receive order NCCL needs (messages matched
  by the sender's program order).
- `schedc.runtime.stagework`: running a stage's layers on a microbatch.
- `schedc.runtime.weightgrad`: the weight gradient of a decoupled W op.
- `schedc.runtime.program`: loading a rank's program (from its file or its
  text), a class program bound to its rank.
- `schedc.runtime.rank`: one rank's process of `schedc run` (process groups,
  the iteration loop, progress reports); `torchrun_main` for `torchrun OUT/main.py`.
- `schedc.runtime.processes`: the rank processes of one host (start from the
  warm forkserver, signal, watch, stop), for `schedc run` and live agents.
- `schedc.runtime.watched`: a forkserver child watched by its own pidfd (its
  exit seen even when the forkserver is gone); a start's wait for the
  forkserver's answer bounded.
- `schedc.runtime.launcher`: `launch(out_dir, ...) -> RunResult`, every live
  rank as a local process (gloo), what `schedc run` uses.
- `schedc.runtime.result`: `IterationRecord` and `RunResult`, what `schedc
  run` and `schedc train` report.
- `schedc.runtime.rendezvous`: the TCPStore a job's processes meet at.
- `schedc.runtime.placement`: devices and backend per rank (`--device`, `--backend`).
- `schedc.runtime.threads`: every rank as a thread of one process (a fast
  check of a plan's programs without processes).
- `schedc.runtime.warmup`: what the forkserver does once before forking ranks.
- `schedc.runtime.gpusleep`: an injected slowdown on a GPU, a calibrated sleep kernel.
- `schedc.runtime.reference`: single-process training on the same global
  batch, the yardstick of exactness.

Import torch lazily: `import schedc.runtime` alone does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from schedc.runtime.launcher import RunResult, launch
    from schedc.runtime.manifest import Manifest, load_manifest

__all__ = ["launch", "RunResult", "Manifest", "load_manifest", "reference_train"]


def __getattr__(name: str):
    if name in ("launch", "RunResult"):
        import importlib

        return getattr(importlib.import_module("schedc.runtime.launcher"), name)
    if name in ("Manifest", "load_manifest"):
        import importlib

        return getattr(importlib.import_module("schedc.runtime.manifest"), name)
    if name == "reference_train":
        from schedc.runtime.reference import reference_train
        return reference_train
    raise AttributeError(name)
