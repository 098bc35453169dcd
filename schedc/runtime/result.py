"""What a run reports, one rank's iteration aggregated and the whole run: the types `schedc run`
and `schedc train` share (`IterationRecord`, `RunResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from schedc.runtime.manifest import Manifest
    from schedc.runtime.placement import Placement

LOG_FORMAT = "schedc.trainlog/v1"


@dataclass(slots=True)
class IterationRecord:
    """One iteration, over every rank that ran it. (Slots: a live run keeps one per completion, a
    million of them in a long run: 364 bytes each at two ranks, 412 with a `__dict__`.)"""

    iteration: int
    generation: int  # the generation that completed it (0 in `schedc run`)
    loss: float | None  # mean loss over the D*M microbatches (None with --emulate in a live run)
    start: float  # earliest start over ranks
    end: float  # when the last rank finished it
    runs: int = 1  # > 1: it was rolled back and run again
    # rank -> measured compute speed against the plan's costs (1.0: as planned; ranks with no
    # compute this iteration are absent): what the fail-slow detector is fed, as log(speed).
    speeds: dict[int, float] = field(default_factory=dict)
    # rank -> the share of its measured compute its thread was on a CPU, not waiting for one (a CPU
    # rank on a loaded host; absent: it never waited): how `schedc.live.slowness` tells load from a slow GPU.
    on_cpu: dict[int, float] = field(default_factory=dict)


@dataclass
class RunResult:
    """What a run did, `schedc run` (recovery off) and `schedc train` alike; `state_dict` holds
    the final weights when they were asked for. The fields after `placement` are a live run's."""

    iterations: list[IterationRecord]
    wall_s: float
    state_dict: dict | None = None
    manifest: "Manifest | None" = None  # `schedc run`: the programs' manifest
    placement: "Placement | None" = None  # `schedc run`: devices and backend
    ok: bool = True
    out: str = ""
    events: list[dict] = field(default_factory=list)
    recoveries: list = field(default_factory=list)  # `schedc.live.result.Recovery`s
    generations: list = field(default_factory=list)  # `schedc.live.result.GenerationRecord`s
    options: dict = field(default_factory=dict)
    error: list[dict] | None = None  # diagnostics when the run failed
    checkpoints: list[str] = field(default_factory=list)
    history: list[IterationRecord] = field(default_factory=list)  # every completion, re-runs included
    switches: list = field(default_factory=list)  # `schedc.live.result.Switch`es
    decisions: list[dict] = field(default_factory=list)  # the slowdown ladder's, with reasons

    @property
    def losses(self) -> list[float | None]:
        return [r.loss for r in self.iterations]

    def iteration_time(self, last: int = 4) -> float:
        """Steady-state period in seconds: mean gap between the ends of the last `last`+1 iterations.

        With fewer iterations, the gap over those there are; with one, its duration.
        """
        ends = [it.end for it in self.iterations]
        if len(ends) < 2:
            return self.iterations[0].end - self.iterations[0].start
        k = min(last, len(ends) - 1)
        return (ends[-1] - ends[-1 - k]) / k

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LOG_FORMAT,
            "ok": self.ok,
            "out": self.out,
            "options": self.options,
            "wall_s": round(self.wall_s, 4),
            "iterations": [asdict(r) for r in self.iterations],
            "history": [asdict(r) for r in self.history],
            "events": self.events,
            "recoveries": [r.to_json() for r in self.recoveries],
            "switches": [s.to_json() for s in self.switches],
            "decisions": self.decisions,
            "generations": [asdict(g) for g in self.generations],
            "checkpoints": self.checkpoints,
            "error": self.error,
        }
