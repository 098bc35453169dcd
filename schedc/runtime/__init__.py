"""What generated per-rank programs call, and how `schedc run` starts them.

- `schedc.runtime.manifest`: `programs.json` (what the programs share: live
  ranks, stage groups, partition, model/data binding, optimizer) and the
  binding of `model.source` / `model.data` to real code.
- `schedc.runtime.runtime`: `Runtime`, the primitives one rank's program
  calls in schedule order (`forward`, `backward_input`, `backward_weight`,
  `backward`, `optimizer_step`).
- `schedc.runtime.worker`: one rank's process (process groups, the iteration
  loop, progress reports); `torchrun_main` for `torchrun OUT/main.py`.
- `schedc.runtime.launcher`: `launch(out_dir, ...) -> RunResult`, every live
  rank as a local process (gloo), what `schedc run` uses.
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
