"""Live training that survives failures: `schedc train` and `schedc.live.train`.

The modules, from the job down to a rank (docs/live.md):

- `schedc.live.supervisor`: one per job: a loop over typed messages that
  moves the run through its phases and carries out what the policies decide.
- `schedc.live.transitions`: how it changes generation (announce, ready,
  switches, recoveries, deadlines and their escalation).
- `schedc.live.hosts`: its processes host by host (starts and signals
  through the agents, fencing, hosts gone or back, an agent registered anew).
- `schedc.live.relayout`: the survivors' state across a new layout
  (`--shadow`): re-partitioning in place (the survivors renamed as the new
  layout's ranks, an epoch, their processes kept), or a dump to disk before
  a restart;
  `schedc.live.move`: a member's part, the layers moved over gloo.
- `schedc.live.growth`: growing back onto GPUs that return after a
  re-partition (when: ski rental under `auto`; in place or by a restart).
- `schedc.live.world`: what it runs against (clock, store, processes): the
  real `LocalWorld`, or `schedc.live.sim`'s deterministic simulation.
- `schedc.live.options`: `TrainOptions`, the options' defaults and checks.
- `schedc.live.protocol`: the typed messages between supervisor, agents and
  workers (and `schedc run`'s ranks), the `Phase` enum, their encoding.
- `schedc.live.control`: the `Controller` seam the policies see the run through.
- `schedc.live.recovery`: the recovery policy (re-route, drop the pipeline,
  restore a checkpoint when a stage is lost, re-partition, restart everything).
- `schedc.live.layouts`: which layouts a re-partition weighs (holes included),
  and what growing onto one costs; pure functions of a spec.
- `schedc.live.slowness`: the fail-slow policy (measure, detect, price, switch).
- `schedc.live.rejoin`: the rejoin policy (catch-up, then a switch).
- `schedc.live.changepoint`: each GPU's speed and its change points; pure logic.
- `schedc.live.mitigate`: the ski-rental ladder that prices a slowdown; pure logic.
- `schedc.live.detect`: which ranks failed (exits, silent heartbeats,
  ranks stuck in compute); pure logic.
- `schedc.live.agent`: one per host: starts, signals and watches that
  host's worker processes (torchrun's elastic agent, without the restarts).
- `schedc.live.membership`: the rendezvous store every role talks through:
  generations, heartbeats, the message queues, blobs.
- `schedc.live.member`: a rank's process across generations; it drives
  `schedc.runtime`, the layer the generated programs call.
  `schedc.live.member_files`: its checkpoints, dump files and restores;
  `schedc.live.member_probe`: its speed probes while it computes nothing.
- `schedc.live.catchup`: a joiner's catch-up from a live donor of its stage.
- `schedc.live.transfer`: moving state between two ranks, direct (a two-rank
  gloo group) or through the store; catch-up's seam.
- `schedc.live.opclock`: how long a rank's computed ops take (the host's
  clock on a CPU, CUDA timing events on a GPU), for fail-slow detection.
- `schedc.live.rollback`: the survivors' agreement on an iteration boundary
  and the copy of the state before each optimizer step.
- `schedc.live.shadow`: `--shadow`, each stage's exact copy on the next
  stage's GPUs (gradient streaming), which a lost stage is restored from.
- `schedc.live.checkpoint`: complete, atomic per-stage checkpoints, and
  their assembly from the stages' reports; `schedc.live.reshard`: one
  stage's state for another split into stages (from a checkpoint, or from
  the survivors' states in an in-place re-partition).
- `schedc.live.ledger`: which iterations completed, from the members' reports.
- `schedc.live.stall`: how long a worker was held stopped or throttled (the
  stall clock fail-slow detection reads).
- `schedc.live.inject`: `--inject` injections checked against the plan, and their triggers;
  `schedc.live.inject_syntax`: the `--inject` language (a lark grammar).
- `schedc.live.result`: what a run records besides its iterations (the
  `--log` JSON's recoveries, switches, generations).

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
