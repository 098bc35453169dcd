"""What to do about a slow GPU, by cost: FALCON/Greyhound's ladder with a ski-rental rule.

When the detector (`schedc.live.changepoint`) reports that a GPU's speed
changed, the supervisor prices the options with the planner and the
simulator, each as the steady period of a plan at the GPU's measured speed:

* **keep**: the current programs, re-timed at that speed (what doing nothing costs);
* **rebalance**: `schedc.replan(plan, "slow gpu(...) speed = x")`: its
  peers take part of its work (or, back at full speed, `recover gpu(...)`);
* **exclude**: `schedc.replan(plan, "fail gpu(...)")`: it gets no work at
  all, as if failed; it stays up, and is taken back (caught up) once its
  probes say it is healthy again.

The best option saves `gain` per iteration over keeping. If that is under
`min_gain` of the period, the change is ignored ("not worth a switch").
Otherwise the ladder does not know how long the slowdown will last, and a
switch costs `cost` (the survivors' stall: the pipeline drains, new process
groups; measured on every switch, a default before the first). It follows
the deterministic **ski-rental rule**: keep paying while the time lost to
the slowdown so far, gain x iterations since it began, is below the cost of
a switch; switch once it reaches it. Whatever the slowdown lasts, this pays
at most twice what the best choice in hindsight would have (never switching
for a blip, switching at once for a long slowdown). A slowdown that ends
first is a blip: nothing was switched, at most `cost` was lost. Every
decision carries its reason and predicted gain, for the terminal and the log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

Action = Literal["keep", "rebalance", "exclude", "restore"]


@dataclass(frozen=True)
class Option:
    action: Action
    period_us: int  # steady period, as the simulator predicts it at the measured speed
    plan: object | None = None  # the `Plan` to switch to (None: keep the current one)


@dataclass(frozen=True)
class Decision:
    rank: int
    verdict: Literal["ignore", "wait", "switch", "blip"]
    action: Action  # what a "switch" switches to (or the best option found)
    reason: str
    speed: float
    since: int
    gain_us: int  # predicted saving per iteration of `action` over keeping
    lost_s: float  # time lost to the slowdown so far (ski rental's rent)
    cost_s: float  # what a switch costs (ski rental's price)
    plan: object | None = None

    def to_json(self) -> dict:
        return {"rank": self.rank, "verdict": self.verdict, "action": self.action, "reason": self.reason,
                "speed": round(self.speed, 4), "since": self.since, "gain_us": self.gain_us,
                "lost_s": round(self.lost_s, 4), "cost_s": round(self.cost_s, 4)}


@dataclass
class _Episode:
    rank: int
    speed: float
    since: int
    best: Option
    keep_us: int


class Ladder:
    """Open episodes (one per GPU whose speed differs from its plan), decided by cost."""

    def __init__(self, *, cost_s: float, min_gain: float = 0.02):
        self.cost_s = cost_s
        self.min_gain = min_gain
        self._open: dict[int, _Episode] = {}

    def open(self, rank: int, speed: float, since: int, options: Sequence[Option], iteration: int) -> Decision:
        """A new speed for `rank`, measured since iteration `since`: price the options."""
        keep = next(o for o in options if o.action == "keep")
        best = min(options, key=lambda o: (o.period_us, o.action != "keep"))
        gain = keep.period_us - best.period_us
        self._open.pop(rank, None)
        if best.action == "keep" or gain < self.min_gain * keep.period_us:
            why = (f"the current plan is as good at speed {speed:.2f}" if best.action == "keep" else
                   f"{best.action} would save only {gain / 1e3:.1f} ms per {keep.period_us / 1e3:.1f} ms iteration")
            return Decision(rank, "ignore", best.action, f"not worth a switch: {why}", speed, since, gain, 0.0,
                            self.cost_s)
        episode = _Episode(rank, speed, since, best, keep.period_us)
        self._open[rank] = episode
        return self._judge(episode, iteration) or Decision(
            rank, "wait", best.action, self._waiting(episode, iteration), speed, since, gain,
            self._lost(episode, iteration), self.cost_s, best.plan)

    def tick(self, iteration: int) -> list[Decision]:
        """An iteration ended: the episodes whose rent now covers a switch."""
        out = []
        for episode in list(self._open.values()):
            d = self._judge(episode, iteration)
            if d is not None:
                out.append(d)
        return out

    def close(self, rank: int, iteration: int, why: str) -> Decision | None:
        """The speed went back before any switch: a blip (None if no episode was open)."""
        episode = self._open.pop(rank, None)
        if episode is None:
            return None
        lost = self._lost(episode, iteration)
        return Decision(rank, "blip", episode.best.action, f"{why} after {iteration - episode.since} iteration(s); "
                        f"lost {lost:.2f} s, less than a switch ({self.cost_s:.2f} s)", episode.speed, episode.since,
                        episode.keep_us - episode.best.period_us, lost, self.cost_s)

    def cancel(self, rank: int) -> None:
        self._open.pop(rank, None)

    def cancel_all(self) -> list[int]:
        """Drop every open episode (their plans were priced against a plan that changed); their ranks."""
        ranks = sorted(self._open)
        self._open.clear()
        return ranks

    def measured(self, cost_s: float) -> None:
        """A switch was made and cost this much: the next decisions use it."""
        self.cost_s = cost_s

    def is_open(self, rank: int) -> bool:
        return rank in self._open

    def _lost(self, episode: _Episode, iteration: int) -> float:
        gain = episode.keep_us - episode.best.period_us
        return gain / 1e6 * max(0, iteration - episode.since)

    def _judge(self, episode: _Episode, iteration: int) -> Decision | None:
        lost = self._lost(episode, iteration)
        if lost < self.cost_s:
            return None
        del self._open[episode.rank]
        gain = episode.keep_us - episode.best.period_us
        return Decision(episode.rank, "switch", episode.best.action,
                        f"lost {lost:.2f} s since iteration {episode.since}, as much as a switch costs "
                        f"({self.cost_s:.2f} s): {episode.best.action} saves {gain / 1e3:.1f} ms per iteration "
                        f"({episode.keep_us / 1e3:.1f} -> {episode.best.period_us / 1e3:.1f} ms)",
                        episode.speed, episode.since, gain, lost, self.cost_s, episode.best.plan)

    def _waiting(self, episode: _Episode, iteration: int) -> str:
        gain = episode.keep_us - episode.best.period_us
        left = max(0.0, self.cost_s - self._lost(episode, iteration))
        more = math.ceil(left / (gain / 1e6))
        return (f"{episode.best.action} would save {gain / 1e3:.1f} ms per iteration; waiting until the time "
                f"lost reaches a switch's cost ({self.cost_s:.2f} s, {more} more iteration{'s' * (more != 1)})")
