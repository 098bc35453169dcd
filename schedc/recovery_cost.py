"""One cost model for every recovery: price each way to go on, pick the cheapest.

After an event (GPUs lost, a stage lost, GPUs back), each candidate is an
`Option`: the iteration time of the plan it would run (from the planner:
compiled, verified and simulated) and the `transition` it costs before that
plan's first iteration:

* ``reroute``: the failed GPUs' work goes to their data-parallel peers
  (`schedc.replan`); nothing moves; the interrupted iteration is lost.
* ``drop-pipeline``: pipelines with a failed GPU leave; nothing moves.
* ``repartition``: the survivors are laid out anew (`schedc.repartition`);
  the layers a GPU did not hold move to it over the link.
* ``restart``: every process restarts from the latest checkpoint (the work
  since it is lost), on the whole pipelines the live GPUs hold.
* ``stay``: keep the current plan (only when GPUs came back: nothing is
  forced to change).

Every transition pays `Costs.reconfigure_s` (detect, agree, new process
groups); one that loses GPUs also loses the interrupted iteration; moved
state costs its largest per-GPU share over `link.bandwidth` (the moves run
in parallel); state that no live GPU holds any more (every replica of a
layer lost) comes back from the latest checkpoint: `Costs.restart_s` plus
the work since it, half a checkpoint interval on average.

**Shadows** (`schedc replay --shadow`, modelling `schedc train --shadow`):
the GPUs of stage s + 1 also hold an exact copy of stage s's state, kept up
to date by streaming its gradient every iteration (`schedc.layout.
shadow_overhead_us` prices that, `shadow_fits` says whether a layout has the
memory for it). When some stage has no live GPU of its own but every stage
still has a live holder (its own GPUs or its shadow's), nothing since the
checkpoint is lost: the survivors write their states to local disk and every
process restarts from them (a *local restore*: `Costs.restart_s` plus the
whole model's weights and optimizer state written and read at
`Costs.disk_bandwidth`, plus the interrupted iteration). Only a stage lost
with all its holders comes back from the checkpoint.

**Choosing after a loss**: the current plan cannot go on, so the option that
trains a horizon's worth of work soonest wins: ``transition + n x
iteration`` seconds for the ``n = horizon / fault-free iteration``
iterations the job would train by the next event without the failure. The
horizon is the expected time to the next event: the mean gap between the
events seen so far (`Horizon`), a default before the first. (Not "the most
iterations before the next event": a restore longer than the horizon would
then make stalling look as good as training, and the restore is only
postponed by stalling.)

**Risk**: a plan whose stages have few replicas may lose a stage's every
copy at the next event, and then restore from the checkpoint: each option
also carries that expected cost (`restore_risk_s`, from how hard losses hit
so far, `LossRate`), counted with its transition.

**Growing back** (GPUs returned, the current plan still runs): how long the
extra GPUs stay is unknown, so the ski-rental rule of the fail-slow ladder
(`schedc.live.mitigate`) decides: keep the current plan while the time lost
by not switching, ``(1 - new / current iteration time) x elapsed``, is below
the switch's cost; switch once it reaches it. Whatever the GPUs' stay, this
loses at most twice what the best choice in hindsight would.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

#: Methods, in the order ties are broken (the least disruptive first).
METHODS = ("stay", "reroute", "drop-pipeline", "repartition", "restart")


@dataclass(frozen=True)
class Costs:
    """What a transition costs besides moving state. Defaults, and where they come from:

    * `reconfigure_s` 1.0: detection, agreement and new process groups. `schedc train` goes from
      a SIGKILL to the next iteration in 0.26-0.31 s at 4-9 CPU ranks (docs/live.md); NCCL
      communicators on real GPUs take longer, so a second is assumed.
    * `restart_s` 30: a checkpoint restart's fixed part: new processes, imports, the checkpoint
      read. A torchrun restart of a tiny model took 22.8 s on a 2-core machine (docs/live.md).
    * `checkpoint_every_s` 1800: how often a checkpoint is written; a restart loses half of it.
    * `horizon_s` 900: the expected time to the next event before any gap was seen (the shared
      AWS trace's mean gap is 902 s).
    * `disk_bandwidth` 1 GB/s (bytes/s): how fast the survivors write their states to local disk
      and read them back in a local restore (shadows only). A local NVMe SSD sustains 2-3 GB/s
      sequential, a network block volume (EBS gp3) up to 1 GB/s, so 1 GB/s is the slower of the
      two; re-measure with ``dd if=/dev/zero of=FILE bs=1M count=8192 oflag=direct`` and the
      read back with ``iflag=direct``.
    """

    reconfigure_s: float = 1.0
    restart_s: float = 30.0
    checkpoint_every_s: float = 1800.0
    horizon_s: float = 900.0
    disk_bandwidth: float = 1e9

    @classmethod
    def of(cls, recovery=None, **overrides: float | None) -> "Costs":
        """The costs of a spec's `recovery` block (`RecoveryOptions`; None: the defaults), with the
        `overrides` that are not None (command-line options) on top."""
        base = cls() if recovery is None else cls(
            reconfigure_s=recovery.reconfigure_cost, restart_s=recovery.restart_cost,
            checkpoint_every_s=recovery.checkpoint_every, horizon_s=recovery.horizon)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def lost_work_s(self) -> float:
        """Work lost by a restore from the latest checkpoint, on average."""
        return self.checkpoint_every_s / 2

    def local_restore_s(self, state_bytes: int) -> float:
        """A local restore beside the interrupted iteration: the restart's fixed part, and
        `state_bytes` (the whole model's weights and optimizer state) written to local disk by
        the survivors and read back, at `disk_bandwidth`."""
        return self.restart_s + 2 * state_bytes / self.disk_bandwidth


@dataclass(frozen=True)
class Option:
    """One way to go on: `iteration_s` None means it cannot train at all (stalled)."""

    method: str
    iteration_s: float | None
    transition_s: float
    moved_bytes: int = 0  # the largest share one GPU receives
    detail: str = ""
    restore: bool = False  # the state comes back from the latest checkpoint
    local: bool = False  # it comes back from the survivors' own states and shadows (no work lost)
    shadows: bool = False  # the plan keeps shadows (`schedc replay --shadow`), their cost in `iteration_s`
    risk_s: float = 0.0  # expected cost of a restore the layout risks at the next event (`restore_risk_s`)
    plan: object = field(default=None, compare=False, repr=False)

    def time_to_train(self, iterations: float) -> float:
        """Seconds until `iterations` iterations are trained under this option, transition included
        (infinite for an option that cannot train)."""
        if self.iteration_s is None:
            return float("inf")
        return self.transition_s + self.risk_s + iterations * self.iteration_s

    def describe(self) -> str:
        it = "stalled" if self.iteration_s is None else f"{self.iteration_s * 1e3:.1f} ms/iteration"
        moved = f", moves {self.moved_bytes / 2**20:.0f} MiB" if self.moved_bytes else ""
        risk = f", restore risk {self.risk_s:.1f} s" if self.risk_s >= 0.05 else ""
        shadows = ", with shadows" if self.shadows else ""
        return f"{self.method}: {it}{shadows}, transition {self.transition_s:.2f} s{moved}{risk}"


def transition_s(costs: Costs, *, lost_gpus: bool, moved_bytes: int, bandwidth: int,
                 previous_iteration_s: float | None, restore: bool = False, planned: bool = False,
                 local_bytes: int | None = None) -> float:
    """The price of a switch before the new plan's first iteration (see the module docstring).
    `planned`: a restart nothing forced (GPUs came back): a checkpoint is written just before it,
    so no work is lost, only the restart's fixed part is paid. `local_bytes` (with `restore`): a
    local restore from the survivors' states and shadows, the whole model's `local_bytes` of
    weights and optimizer state written and read at `costs.disk_bandwidth` instead of the work
    since the checkpoint (`Costs.local_restore_s`)."""
    t = costs.reconfigure_s + moved_bytes / bandwidth
    if lost_gpus and previous_iteration_s is not None:
        t += previous_iteration_s  # the iteration that was running is rolled back
    if restore and local_bytes is not None:
        t += costs.local_restore_s(local_bytes)
    elif restore:
        t += costs.restart_s + (0.0 if planned else costs.lost_work_s)
    return t


def restore_risk_s(costs: Costs, replicas: Sequence[int], loss: "LossRate",
                   holders: Sequence[int] | None = None, local_bytes: int = 0) -> float:
    """Expected seconds of restore a plan risks at the next event: a stage (a group of units with
    the same holders) whose `k` replicas all go in one loss must come back from the checkpoint.
    Each GPU is taken with probability `loss.fraction` by a loss event (the events so far), so
    the stage is lost with ``fraction ** k``; the risk is ``loss.share x min(1, sum of those) x
    (restart + lost work)``. A layout whose stages have one GPU each (one pipeline, or a hole
    beside a single replica) pays it in full; two replicas make it about ``fraction`` as large.

    With shadows, `holders[i]` GPUs of the next stage also hold stage i: it comes back from the
    checkpoint only with all ``k + h`` gone (``fraction ** (k + h)``); losing its `k` alone
    (``fraction ** k - fraction ** (k + h)``) costs a local restore of `local_bytes` instead."""
    f = loss.fraction
    if holders is None:
        p = min(1.0, sum(f ** k for k in replicas if k > 0))
        return loss.share * p * (costs.restart_s + costs.lost_work_s)
    pairs = [(k, h) for k, h in zip(replicas, holders) if k > 0]
    p = min(1.0, sum(f ** (k + h) for k, h in pairs))
    local = min(1.0, sum(f ** k - f ** (k + h) for k, h in pairs))
    return loss.share * (p * (costs.restart_s + costs.lost_work_s) + local * costs.local_restore_s(local_bytes))


class LossRate:
    """How hard the losses hit, from the events so far: `fraction`, the mean share of the live
    GPUs one loss event takes (default 0.1), and `share`, the share of events that are losses
    (default 0.5). `burst_s`: a loss less than that after the start of the last one (both given
    their time) is part of it, as in `Horizon`: a burst found in several ticks, or decided twice
    (a dump first), is one event that took all of its GPUs. `plan` is the plan a loss was counted
    on (compared by identity): one of the same plan counts the GPUs lost since that plan, those
    counted already among them; one of a plan made since counts only new ones."""

    def __init__(self, fraction: float = 0.1, share: float = 0.5, burst_s: float = 0.0):
        self._default = (fraction, share)
        self.burst_s = burst_s
        self._fractions: list[float] = []
        self._events = 0
        # The last loss: (its time, GPUs live before it, GPUs lost, the plan it was counted on,
        # those of it lost before that plan).
        self._burst: tuple[float, int, int, object, int] | None = None

    def event(self, lost: int, live_before: int, t: float | None = None, plan: object = None) -> None:
        burst = self._burst
        if burst is not None and t is not None and lost and t - burst[0] < self.burst_s:
            start, first_live, counted, on, before = burst
            if plan is None or plan is not on:  # (a plan made since: its losses are new)
                before = counted
            total = min(first_live, before + lost)
            self._fractions[-1] = total / first_live
            self._burst = (start, first_live, max(counted, total), plan, before)
            return
        self._events += 1
        self._burst = None
        if lost and live_before:
            self._fractions.append(lost / live_before)
            if t is not None:
                self._burst = (t, live_before, lost, plan, 0)

    @property
    def fraction(self) -> float:
        return sum(self._fractions) / len(self._fractions) if self._fractions else self._default[0]

    @property
    def share(self) -> float:
        return len(self._fractions) / self._events if self._events >= 2 else self._default[1]


def choose(options: Sequence[Option], work_iterations: float) -> Option:
    """The option that trains `work_iterations` iterations soonest, transition included; ties: the
    shorter transition, then the least disruptive method (`METHODS`). Stalling is never chosen
    while an option can train: a restore it would avoid is only postponed."""
    def key(o: Option):
        return (o.time_to_train(work_iterations), o.transition_s + o.risk_s,
                METHODS.index(o.method) if o.method in METHODS else len(METHODS))
    return min(options, key=key)


def grow_delay_s(current_s: float, new: Option) -> float | None:
    """Ski rental for growing back: seconds to keep the current plan (iteration `current_s`)
    before switching to `new`; None if `new` is no faster. The rent is the share of time lost
    by not switching, ``1 - new / current``; the switch is bought once rent x time reaches its
    price, the transition."""
    if new.iteration_s is None or new.iteration_s >= current_s:
        return None
    rate = 1.0 - new.iteration_s / current_s
    return new.transition_s / rate


class Horizon:
    """The expected time to the next event: the mean gap between the events seen so far.
    `burst_s`: an event less than that after the start of the last one is part of it (a burst:
    several GPUs of one reclaim, found failed one after another), not an event of its own."""

    def __init__(self, default_s: float, burst_s: float = 0.0):
        self.default_s = default_s
        self.burst_s = burst_s
        self._first: float | None = None
        self._last: float | None = None
        self._gaps = 0

    def event(self, t: float) -> None:
        if self._first is None:
            self._first = t
        elif self._last is not None and t > self._last:
            if t - self._last < self.burst_s:
                return  # (the same burst)
            self._gaps += 1
        self._last = t

    @property
    def seconds(self) -> float:
        if not self._gaps or self._first is None or self._last is None:
            return self.default_s
        return (self._last - self._first) / self._gaps
