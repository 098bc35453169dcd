"""What a live run records besides its iterations: recoveries, planned switches, generations
(`--log FILE`), and the log writer.

All times are seconds since the supervisor started (``t``), from one clock.
The result itself is `schedc.runtime.result.RunResult` (``TrainResult`` here),
whose `to_json()` is the ``schedc.trainlog/v1`` document that ``schedc train
--log FILE`` writes (docs/live.md describes every field).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from schedc.runtime.result import LOG_FORMAT, IterationRecord, RunResult

#: A live run's result is a `RunResult` (one result type for `schedc run` and `schedc train`).
TrainResult = RunResult
__all__ = ["LOG_FORMAT", "IterationRecord", "Recovery", "Switch", "GenerationRecord", "TrainResult", "write_log"]


@dataclass
class Recovery:
    """One reaction to a failure, from the failure to the first iteration under the new plan."""

    from_generation: int
    to_generation: int | None = None
    failed: list[int] = field(default_factory=list)  # schedule ranks
    causes: dict[str, str] = field(default_factory=dict)  # rank -> cause
    events: list[str] = field(default_factory=list)  # the replan events
    method: str = "reroute"  # reroute, drop-pipeline, restart, checkpoint (a stage was lost), repartition, grow-back,
    # retry (the plan that ran again: a generation late, or only a GPU coming back lost in its switch)
    t_fault: float | None = None  # when the fault was injected (None: not injected)
    t_detect: float = 0.0
    t_plan: float | None = None  # the new plan is ready
    t_announce: float | None = None
    t_ready: float | None = None  # every member reconfigured and rolled back
    t_first: float | None = None  # first iteration completed under the new plan
    t_last_complete: float | None = None  # end of the last iteration completed before the failure
    resumed_at: int | None = None  # iteration the new generation started from
    undone: int = 0  # ranks that undid their last optimizer step
    solver: dict = field(default_factory=dict)  # name, status, wall_s of the replan
    predicted_before_us: int | None = None
    predicted_after_us: int | None = None
    moved_bytes: int = 0  # layers moved between members in place, over every member (`schedc.live.move`)
    moved_max_bytes: int = 0  # the most one member received

    @property
    def start_word(self) -> str:
        """What its times count from, as the run's messages say it."""
        return "grow-back began" if self.method == "grow-back" else "failure"

    def durations(self) -> dict[str, float | None]:
        """Seconds from the fault (or its detection) to each milestone."""
        t0 = self.t_fault if self.t_fault is not None else self.t_detect

        def since(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 4)

        return {"detect": since(self.t_detect), "plan": since(self.t_plan), "announce": since(self.t_announce),
                "reconfigure": since(self.t_ready), "first_iteration": since(self.t_first)}

    def to_json(self) -> dict:
        out = asdict(self)
        out["durations_s"] = self.durations()
        return out


@dataclass
class Switch:
    """A planned switch to a new plan at an iteration boundary (rebalance, exclude, restore, rejoin)."""

    kind: str  # rebalance, exclude, restore, rejoin
    reason: str
    ranks: list[int]  # the GPUs it is about
    from_generation: int
    to_generation: int
    start_at: int  # the iteration the new plan starts at
    t_decide: float
    t_announce: float
    t_ready: float | None = None  # every member runs the new plan's groups
    t_first: float | None = None  # first iteration completed under it
    t_last_old: float | None = None  # last iteration completed under the old plan
    predicted_before_us: int | None = None
    predicted_after_us: int | None = None
    catch_up_s: float | None = None  # rejoin: from the session's start to caught up
    catch_up_bytes: int | None = None

    @property
    def stall_s(self) -> float | None:
        """What the survivors paid: the gap between the last iteration under the old plan and
        the first under the new one, less one period of the new plan."""
        if self.t_first is None or self.t_last_old is None or self.predicted_after_us is None:
            return None
        return self.t_first - self.t_last_old - self.predicted_after_us / 1e6

    def to_json(self) -> dict:
        out = asdict(self)
        out["stall_s"] = None if self.stall_s is None else round(self.stall_s, 4)
        return out


@dataclass
class GenerationRecord:
    number: int
    members: list[int]
    reason: str
    restore: str | None
    predicted_iteration_time_us: int
    plan_dir: str | None
    t_announce: float
    t_ready: float | None = None
    shadow: bool | None = None  # --shadow: whether its plan kept shadows (room for them); None without


def write_log(path: str | os.PathLike, result: RunResult) -> Path:
    """Write the run log atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path
