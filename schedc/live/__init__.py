"""Live training that survives failures: `schedc train` and `schedc.live.train`.

The layers, from the job down to a rank (docs/live.md):

- `schedc.live.supervisor`: the state machine of a run: detect, abort,
  fence, replan, announce a generation, wait for reconfiguration; falls
  back to checkpoints when a stage is lost. One per job.
- `schedc.live.agent`: one per host: starts, signals and watches that
  host's worker processes (torchrun's elastic agent, without the restarts).
- `schedc.live.membership`: the rendezvous store every role talks through:
  generations, heartbeats, report and command queues.
- `schedc.live.detect`: which ranks failed (exits, silent heartbeats,
  ranks stuck in compute); pure logic.
- `schedc.live.rollback`: the survivors' agreement on an iteration boundary
  and the copy of the state before each optimizer step.
- `schedc.live.checkpoint`: complete, atomic per-stage checkpoints.
- `schedc.live.inject`: the `--inject` language and its triggers.
- `schedc.live.worker`: a rank's process across generations; it drives
  `schedc.runtime`, the layer the generated programs call.
- `schedc.live.result`: what a run reports (the `--log` JSON).

Importing this package loads neither torch nor OR-Tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from schedc.live.result import TrainResult
    from schedc.live.supervisor import Supervisor, TrainError, TrainOptions, train

__all__ = ["train", "Supervisor", "TrainOptions", "TrainResult", "TrainError"]


def __getattr__(name: str):
    import importlib

    if name in ("train", "Supervisor", "TrainOptions", "TrainError"):
        return getattr(importlib.import_module("schedc.live.supervisor"), name)
    if name == "TrainResult":
        return getattr(importlib.import_module("schedc.live.result"), name)
    raise AttributeError(name)
