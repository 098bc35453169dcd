"""`schedc replay SPEC TRACE.csv`: replay an availability trace through the planner and the
recovery policies, in simulated time.

The job starts with every GPU up, in the user's layout (the spec's dp x pp,
fault-free). Each row of the trace is an event: the live GPUs become those
`schedc.trace.availability` picks (seeded). Each policy then decides what the
job runs until the next event, with the plans the planner makes for that
state (compiled, verified and simulated; cached by state) and the transition
costs of `schedc.recovery_cost`:

* ``reroute``: re-route the failed GPUs' work to their peers; stalled while a
  stage has no live GPU; a returning GPU is caught up from a peer at once.
* ``drop-pipeline``: only whole pipelines train; stalled with none left.
* ``repartition``: the best re-partitioned layout of the live GPUs; the
  user's layout whenever every GPU is up.
* ``restart``: every change restarts the job from the latest checkpoint, on
  as many whole pipelines of the user's shape as the live GPUs hold.
* ``auto``: after a loss, the option that trains the most over the horizon
  (`recovery_cost.choose`); when GPUs return, ski rental decides when to
  grow (`recovery_cost.grow_delay_s`).

State is tracked per GPU: which units (layers or stages) it holds up to date.
A GPU that returns holds nothing; a unit no live GPU holds comes back from
the latest checkpoint, which costs a restart and the work since it. The
figures per policy: samples trained as a fraction of what the user's
fault-free plan trains in the same time, hours stalled (no plan could run),
switches, and time spent in transitions.

With `shadow=True` (`schedc replay --shadow`, the model of `schedc train
--shadow`), every plan of more than one stage whose GPUs have the memory for
it (`layout.shadow_fits`; a plan that does not runs without shadows) also
keeps, on each GPU of stage s + 1, a shadow of stage s: its iterations are
longer by `layout.shadow_overhead_us`, and a unit counts as held by the GPUs
holding its shadow too. A unit held only as a shadow is restored locally
(`recovery_cost.Costs.local_restore_s`: no work lost). The fraction's
denominator stays the user's fault-free plan without shadows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from schedc.diagnostics import SchedcError, SpecError, error, did_you_mean
from schedc.recovery_cost import Costs, Horizon, LossRate, Option, choose, grow_delay_s, restore_risk_s, transition_s
from schedc.layout import (Layout, bytes_of, checkpoint_bytes, held_units, received_bytes, shadow_fits,
                           shadow_overhead_us, shadows_of, units_of)
from schedc.repartition import PLANNED_SHAPES, Shape, candidate_shapes, place, plan_layout
from schedc.spec import Failure, Spec
from schedc.trace import Trace, availability, check_fits

POLICIES = ("auto", "reroute", "drop-pipeline", "repartition", "restart")


@dataclass(frozen=True)
class Decision:
    """What a policy did at time `t`: the option it chose among those it priced."""

    t: float
    live: int
    chosen: Option
    options: tuple[Option, ...]
    reason: str

    def to_json(self) -> dict:
        return {"t": self.t, "live": self.live, "method": self.chosen.method, "reason": self.reason,
                "iteration_s": self.chosen.iteration_s, "transition_s": round(self.chosen.transition_s, 3),
                "moved_bytes": self.chosen.moved_bytes, "detail": self.chosen.detail,
                "restore": (("local" if self.chosen.local else "checkpoint") if self.chosen.restore
                            else "in place" if self.chosen.local else None),
                "shadows": self.chosen.shadows,
                "options": [{"method": o.method, "iteration_s": o.iteration_s,
                             "transition_s": round(o.transition_s, 3), "moved_bytes": o.moved_bytes}
                            for o in self.options]}


@dataclass
class PolicyReplay:
    """One policy's run through the trace."""

    policy: str
    samples: float = 0.0  # microbatches trained
    fault_free_samples: float = 0.0
    stalled_s: float = 0.0
    transition_s: float = 0.0
    switches: int = 0
    checkpoint_restarts: int = 0  # switches that restart from the latest checkpoint (a planned restart included)
    local_restores: int = 0  # switches that restart from the survivors' states and shadows (no work lost)
    in_place_moves: int = 0  # re-partitions whose lost stages move from the survivors' shadows, no restart
    decisions: list[Decision] = field(default_factory=list)
    #: (start s, end s, fraction of fault-free throughput) stretches, for the plot.
    segments: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def samples_fraction(self) -> float:
        return self.samples / self.fault_free_samples if self.fault_free_samples else 0.0

    def to_json(self, decisions: bool = False) -> dict:
        out = {"samples_fraction": round(self.samples_fraction, 6), "samples": round(self.samples, 1),
               "stalled_s": round(self.stalled_s, 1), "switches": self.switches,
               "transition_s": round(self.transition_s, 1), "checkpoint_restarts": self.checkpoint_restarts,
               "local_restores": self.local_restores, "in_place_moves": self.in_place_moves}
        if decisions:
            out["decisions"] = [d.to_json() for d in self.decisions]
        return out


@dataclass(frozen=True)
class ReplayResult:
    spec: str
    trace: str
    seed: int
    gpus: int
    per_instance: int
    duration_s: float
    events: int
    fault_free_iteration_s: float
    global_microbatches: int
    horizon: str
    costs: Costs
    policies: Mapping[str, PolicyReplay]
    live: tuple[tuple[float, int], ...]  # (time, live GPUs) at each event
    shadow: bool = False  # shadows modelled (`replay(shadow=True)`)
    #: With shadows: seconds they add to an iteration of the user's layout (None: it has one stage, or
    #: its GPUs lack the memory), and the bytes a local restore writes and reads.
    shadow_overhead_s: float | None = None
    checkpoint_bytes: int = 0

    def to_json(self, decisions: bool = False) -> dict:
        costs = {"reconfigure_s": self.costs.reconfigure_s, "restart_s": self.costs.restart_s,
                 "checkpoint_every_s": self.costs.checkpoint_every_s, "default_horizon_s": self.costs.horizon_s}
        out = {"spec": self.spec, "trace": self.trace, "seed": self.seed, "gpus": self.gpus,
               "gpus_per_instance": self.per_instance, "duration_s": self.duration_s, "events": self.events,
               "fault_free_iteration_s": self.fault_free_iteration_s,
               "global_microbatches": self.global_microbatches, "horizon": self.horizon, "costs": costs,
               "shadow": self.shadow}
        if self.shadow:
            costs["disk_bandwidth"] = self.costs.disk_bandwidth
            out["shadow_overhead_s"] = self.shadow_overhead_s
            out["checkpoint_bytes"] = self.checkpoint_bytes
        out["policies"] = {name: p.to_json(decisions) for name, p in self.policies.items()}
        return out


def check_policies(names: Sequence[str]) -> tuple[str, ...]:
    """The policy names, checked (E645 for one that does not exist, with "did you mean")."""
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise SpecError([error("E645", f"unknown recovery policy `{n}`",
                               hint=did_you_mean(n, POLICIES) or f"choose from {', '.join(POLICIES)}")
                         for n in bad])
    return tuple(dict.fromkeys(names))


class Planner:
    """The plans of every state a replay meets, cached: iteration seconds per method and state."""

    def __init__(self, spec: Spec, *, solver: str = "greedy", time_limit: float = 0.05, seed: int = 0,
                 shadow: bool = False):
        from schedc.plan import compile as compile_plan

        self.spec = spec.without_failures()
        self.solver, self.time_limit, self.seed = solver, time_limit, seed
        self.shadow = shadow
        self.base = compile_plan(self.spec, solver=solver, time_limit=time_limit, seed=seed)
        self.fault_free_s = self.base.metrics.iteration_time / 1e6
        self.units = units_of(self.spec)
        self.user_held = held_units(self.spec)
        self.all = frozenset(range(self.spec.dp * self.spec.pp))
        self.checkpoint_bytes = checkpoint_bytes(self.units)
        self._replans: dict[tuple[str, frozenset[int]], float | None] = {}
        self._layouts: dict[tuple, float | None] = {}
        self._shadows: dict[tuple, float | None] = {}
        grid: list[list[int | None]] = [[None] * self.spec.pp for _ in range(self.spec.dp)]
        for g in self.spec.gpus:
            grid[g.dp][g.pp] = g.rank
        self._user_ranks = tuple(tuple(row) for row in grid)

    def user_layout(self, live: frozenset[int]) -> Layout:
        """The user's layout with the GPUs not in `live` as holes (re-routed to their peers)."""
        slices = self.spec.partition if self.units.kind == "layer" else tuple((s, s + 1) for s in range(self.spec.pp))
        ranks = tuple(tuple(r if r in live else None for r in row) for row in self._user_ranks)
        return Layout(self.spec.dp, self.spec.pp, self.spec.microbatches,
                      tuple(slices), ranks)  # type: ignore[arg-type]

    def shadow_s(self, layout: Layout, iteration_s: float) -> float | None:
        """Seconds shadows add to an iteration of `layout` that takes `iteration_s` without them
        (`shadow_overhead_us`); None when it runs without them: shadows off, one stage, or a GPU
        without the memory for its shadow (`shadow_fits`)."""
        if not self.shadow or layout.pp <= 1:
            return None
        counts = tuple(sum(row[s] is not None for row in layout.ranks) for s in range(layout.pp))
        speeds = tuple(None if r is None else self.spec.gpus[r].speed for row in layout.ranks for r in row)
        key = (layout.dp, layout.pp, layout.microbatches, layout.slices, counts, speeds, round(iteration_s * 1e6))
        if key not in self._shadows:
            fits = shadow_fits(self.units, layout, self.spec.cluster.gpu.memory)
            speed = {g.rank: g.speed for g in self.spec.gpus}
            self._shadows[key] = (shadow_overhead_us(self.units, layout, self.spec.cluster.link, speed,
                                                     iteration_us=round(iteration_s * 1e6)) / 1e6
                                  if fits else None)
        return self._shadows[key]

    def _stage_of(self, rank: int) -> int:
        return self.spec.gpus[rank].pp

    def replanned(self, method: str, failed: frozenset[int]) -> float | None:
        """Iteration seconds of `reroute` or `drop-pipeline` with `failed` down; None if it cannot run."""
        from schedc.replan import replan

        if not failed:
            return self.fault_free_s
        key = (method, failed)
        if key not in self._replans:
            events = [Failure("fail_gpu", dp=self.spec.gpus[r].dp, pp=self.spec.gpus[r].pp) for r in sorted(failed)]
            try:
                plan = replan(self.base, events, deadline=5.0, solver="drop-pipeline" if method == "drop-pipeline"
                              else self.solver, seed=self.seed)
                self._replans[key] = plan.metrics.iteration_time / 1e6
            except SchedcError:  # a stage lost every GPU, no pipeline left, nothing fits
                self._replans[key] = None
        return self._replans[key]

    def layout_s(self, layout: Layout) -> float | None:
        """Iteration seconds of a layout's plan (None if the solver finds it does not fit)."""
        speeds = tuple(None if r is None else self.spec.gpus[r].speed for row in layout.ranks for r in row)
        key = (layout.dp, layout.pp, layout.microbatches, layout.slices, speeds)
        if key not in self._layouts:
            try:
                plan = plan_layout(self.spec, layout, self.solver, time_limit=self.time_limit, seed=self.seed)
                self._layouts[key] = plan.metrics.iteration_time / 1e6
            except SchedcError:
                self._layouts[key] = None
        return self._layouts[key]

    def shapes(self, live: int) -> tuple[Shape, ...]:
        return candidate_shapes(self.spec, live)

    def restart_shape(self, live: int) -> Shape | None:
        """Whole pipelines of the user's shape on `live` GPUs, the global batch kept (pipelines divide it)."""
        g = self.spec.dp * self.spec.microbatches
        d = max((d for d in range(1, self.spec.dp + 1) if g % d == 0 and d * self.spec.pp <= live), default=0)
        if not d:
            return None
        slices = self.spec.partition if self.units.kind == "layer" else tuple((s, s + 1) for s in range(self.spec.pp))
        return Shape(d, self.spec.pp, g // d, tuple(slices), 0)  # type: ignore[arg-type]


class _Run:
    """One policy's state while the trace is replayed."""

    def __init__(self, name: str, planner: Planner, costs: Costs, loss: LossRate):
        self.name = name
        self.loss = loss
        self.p = planner
        self.costs = costs
        self.result = PolicyReplay(name)
        self.live: frozenset[int] = planner.all
        self.held: dict[int, frozenset[int]] = dict(planner.user_held)
        user = planner.user_layout(planner.all)
        overhead = planner.shadow_s(user, planner.fault_free_s)
        # GPU -> the units of the shadow it holds up to date (none without shadows).
        self.shadow: dict[int, frozenset[int]] = shadows_of(user) if overhead is not None else {}
        self.shadows_on = overhead is not None  # the current plan keeps shadows
        self.used: frozenset[int] = planner.all  # GPUs the current plan runs on
        self.layout: Layout | None = None  # None: the user's layout (re-routed or dropped)
        self.method = "reroute"
        self.iteration_s: float | None = planner.fault_free_s + (overhead or 0.0)
        self.pending: tuple[float, Option] | None = None  # a grow decided by ski rental: when, to what
        self.transition_left = 0.0  # seconds of the current transition still to pay
        self.restoring = False  # the current transition restarts from a checkpoint (or the local states)

    # -- the options ------------------------------------------------------------------------------

    def _state_lost(self) -> bool:
        """Whether some unit has no up-to-date copy of its own on a live GPU (it must be restored)."""
        have = frozenset().union(*[self.held.get(r, frozenset()) for r in self.live])
        return len(have) < self.p.units.count

    def _restore(self) -> str | None:
        """How lost state comes back: None (nothing lost), "local" (every unit still has a live
        holder counting shadows: the survivors' states, no work lost) or "checkpoint"."""
        if not self._state_lost():
            return None
        have = frozenset().union(*[self.held.get(r, frozenset()) | self.shadow.get(r, frozenset())
                                   for r in self.live])
        return "local" if len(have) == self.p.units.count else "checkpoint"

    def _transition(self, restore: str | None, lost_gpus: bool, moved: int) -> float:
        return transition_s(self.costs, lost_gpus=lost_gpus, moved_bytes=0 if restore else moved,
                            bandwidth=self.p.spec.cluster.link.bandwidth, previous_iteration_s=self.iteration_s,
                            restore=restore is not None,
                            local_bytes=self.p.checkpoint_bytes if restore == "local" else None)

    def _risk(self, replicas: list[int], shadows: bool) -> float:
        """`restore_risk_s` of a plan with `replicas[s]` GPUs in stage s (the holders of stage s's
        shadow are stage s + 1's)."""
        holders = [replicas[(s + 1) % len(replicas)] for s in range(len(replicas))] if shadows else None
        return restore_risk_s(self.costs, replicas, self.loss, holders, self.p.checkpoint_bytes)

    @staticmethod
    def _restore_detail(restore: str | None) -> str:
        return {None: "", "checkpoint": "; lost state restored from the checkpoint",
                "local": "; lost stage(s) restarted from the survivors' shadows on local disk",
                "in place": "; lost stage(s) moved in place from the survivors' shadows"}[restore]

    def _user_layout_option(self, method: str, lost_gpus: bool) -> Option:
        failed = self.p.all - self.live
        it = self.p.replanned(method, failed)
        if it is None:
            return Option(method, None, 0.0, detail="cannot run")
        overhead = self.p.shadow_s(self.p.user_layout(self.live), it)
        moved = max((bytes_of(self.p.units, self.p.user_held[r] - self.held.get(r, frozenset())) for r in self.live),
                    default=0)
        restore = self._restore()
        t = self._transition(restore, lost_gpus, moved)
        detail = f"{len(failed)} GPU(s) down" + self._restore_detail(restore)
        replicas = [sum(1 for r in self.live if self.p.spec.gpus[r].pp == st) for st in range(self.p.spec.pp)]
        return Option(method, it + (overhead or 0.0), t, 0 if restore else moved, detail,
                      restore=restore is not None, local=restore == "local", shadows=overhead is not None,
                      risk_s=self._risk(replicas, overhead is not None))

    def _repartition_options(self, lost_gpus: bool) -> list[Option]:
        if self.live == self.p.all:
            return [replace(self._user_layout_option("reroute", lost_gpus), method="repartition",
                            detail="every GPU up: the user's layout")]
        out = []
        live = sorted(self.live)
        for shape in self.p.shapes(len(live))[:PLANNED_SHAPES]:
            layout = place(self.p.spec, shape, live, self.held)
            it = self.p.layout_s(layout)
            if it is None:
                continue
            overhead = self.p.shadow_s(layout, it)
            restore = self._restore()
            if restore == "local":
                # `schedc train --shadow` re-partitions in place: no restart, no disk; a lost stage's
                # layers move from the GPUs holding its shadow, as any layer moves.
                held = {r: self.held.get(r, frozenset()) | self.shadow.get(r, frozenset()) for r in self.live}
                moved = max(received_bytes(self.p.units, layout, held).values(), default=0)
                t = self._transition(None, lost_gpus, moved)
            else:
                moved = 0 if restore else max(received_bytes(self.p.units, layout, self.held).values(), default=0)
                t = self._transition(restore, lost_gpus, moved)
            replicas = [sum(1 for row in layout.ranks if row[st] is not None) for st in range(layout.pp)]
            out.append(Option("repartition", it + (overhead or 0.0), t, moved,
                              layout.describe(self.p.units.kind)
                              + self._restore_detail("in place" if restore == "local" else restore),
                              restore=restore == "checkpoint", local=restore == "local",
                              shadows=overhead is not None, risk_s=self._risk(replicas, overhead is not None),
                              plan=layout))
        return out or [Option("repartition", None, 0.0, detail="no layout fits the live GPUs")]

    def _restart_option(self, lost_gpus: bool) -> Option:
        shape = self.p.restart_shape(len(self.live))
        if shape is None:
            return Option("restart", None, 0.0, detail="fewer live GPUs than one pipeline")
        layout = place(self.p.spec, shape, sorted(self.live), self.p.user_held)
        it = self.p.layout_s(layout)
        overhead = self.p.shadow_s(layout, it) if it is not None else None
        local = self._restore() == "local"
        if local:
            # A stage lost with a live holder of its shadow: the survivors' states on local disk.
            t = transition_s(self.costs, lost_gpus=lost_gpus, moved_bytes=0, bandwidth=1,
                             previous_iteration_s=self.iteration_s, restore=True,
                             local_bytes=self.p.checkpoint_bytes)
        else:
            # Forced by a loss, the work since the last checkpoint is lost; a restart to grow writes one first.
            planned = not lost_gpus and self.iteration_s is not None and not self._state_lost()
            t = transition_s(self.costs, lost_gpus=False, moved_bytes=0, bandwidth=1, previous_iteration_s=None,
                             restore=True, planned=planned)
        return Option("restart", None if it is None else it + (overhead or 0.0), t, 0,
                      f"{shape.dp} pipeline(s) of the user's shape" + (self._restore_detail("local") if local else ""),
                      restore=True, local=local, shadows=overhead is not None,
                      risk_s=self._risk([shape.dp] * shape.pp, overhead is not None), plan=layout)

    def options(self, lost_gpus: bool) -> list[Option]:
        if self.name == "reroute":
            return [self._user_layout_option("reroute", lost_gpus)]
        if self.name == "drop-pipeline":
            return [self._user_layout_option("drop-pipeline", lost_gpus)]
        if self.name == "repartition":
            return self._repartition_options(lost_gpus)
        if self.name == "restart":
            return [self._restart_option(lost_gpus)]
        return ([self._user_layout_option("reroute", lost_gpus), self._user_layout_option("drop-pipeline", lost_gpus)]
                + self._repartition_options(lost_gpus) + [self._restart_option(lost_gpus)])

    # -- events -----------------------------------------------------------------------------------

    def event(self, t: float, live: frozenset[int], horizon_s: float) -> None:
        lost = self.live - live
        self.live = live
        self.pending = None
        for r in lost:
            self.held.pop(r, None)
            self.shadow.pop(r, None)
        for r in live - set(self.held):
            self.held[r] = frozenset()  # a returning GPU comes back empty
        touched = bool(lost & self.used)
        if live == self.p.all and self.layout is not None and self.name in ("auto", "repartition"):
            # Nothing is missing: the job goes back to the user's shape.
            back = replace(self._user_layout_option("reroute", lost_gpus=False), method="repartition",
                           detail="every GPU up: the user's layout")
            return self._switch(t, back, (back,), "every GPU is up: back to the user's layout")
        if self.iteration_s is not None and not touched:
            # The current plan still runs. Fixed policies (but repartition's spare GPUs) grow back at once;
            # auto asks ski rental.
            if self.name in ("auto", "repartition") and not (live - self.used):
                return self._note_unchanged(t, live, "the lost GPUs ran nothing")
            opts = self.options(lost_gpus=False)
            best = choose(opts, horizon_s / self.p.fault_free_s)
            if self.name != "auto":
                if best.iteration_s is None or best.iteration_s >= self.iteration_s:
                    return self._note_unchanged(t, live, "no faster plan with the GPUs back")
                return self._switch(t, best, opts, "GPUs back: grow at once")
            delay = grow_delay_s(self.iteration_s, best)
            if delay is None:
                return self._note_unchanged(t, live, "no option is faster than the current plan")
            self.pending = (t + delay, best)
            self.result.decisions.append(Decision(t, len(live), best, tuple(opts),
                                                  f"GPUs back: grow after {delay:.1f} s unless another event "
                                                  "comes first (ski rental)"))
            return None
        opts = self.options(lost_gpus=touched)
        best = choose(opts, horizon_s / self.p.fault_free_s)
        why = (f"{len(lost)} GPU(s) lost" if lost else "GPUs back") + (
            f", horizon {horizon_s:.0f} s" if self.name == "auto" else "")
        self._switch(t, best, opts, why)

    def _note_unchanged(self, t: float, live: frozenset[int], why: str) -> None:
        cur = Option(self.method, self.iteration_s, 0.0, detail="unchanged", shadows=self.shadows_on)
        self.result.decisions.append(Decision(t, len(live), cur, (), why))

    def _switch(self, t: float, best: Option, opts: Sequence[Option], why: str) -> None:
        self.result.decisions.append(Decision(t, len(self.live), best, tuple(opts), why))
        self.method = best.method
        self.iteration_s = best.iteration_s
        self.shadows_on = best.shadows
        # A restore under way is not cut short by a switch: its state is still on its way (and
        # the work since the checkpoint is lost whatever runs next).
        carried = self.transition_left if self.restoring else 0.0
        if best.iteration_s is None:
            self.transition_left = carried
        elif best.restore:
            self.transition_left = max(best.transition_s, carried)
        else:
            self.transition_left = carried + best.transition_s
        self.restoring = best.restore or carried > 0
        if best.iteration_s is not None:
            self.result.switches += 1
            if best.restore and best.local:
                self.result.local_restores += 1
            elif best.local:
                self.result.in_place_moves += 1
            elif best.restore:
                self.result.checkpoint_restarts += 1
        layout = best.plan if isinstance(best.plan, Layout) else None
        self.layout = layout
        if best.iteration_s is None:
            self.used = frozenset()
            return
        if layout is not None:
            self.used = layout.gpus
            new_held = layout.held()
        else:
            self.used = self.live
            new_held = {r: self.p.user_held[r] for r in self.live}
        # GPUs in the plan hold their units (and shadows) up to date; the others' state goes stale.
        new_shadow = shadows_of(layout or self.p.user_layout(self.live)) if best.shadows else {}
        self.held = {r: new_held.get(r, frozenset()) for r in self.live}
        self.shadow = {r: new_shadow.get(r, frozenset()) for r in self.live}

    def advance(self, start: float, end: float) -> None:
        """Train from `start` to `end` (seconds) under the current plan."""
        t = start
        while t < end:
            if self.pending is not None and self.pending[0] <= t:
                _, opt = self.pending
                self.pending = None
                self._switch(t, opt, (), "ski rental: the rent reached the switch's price")
                continue
            stop = min(end, self.pending[0]) if self.pending is not None else end
            span = stop - t
            if self.iteration_s is None:
                self.result.stalled_s += span
                self.result.segments.append((t, stop, 0.0))
            else:
                tr = min(span, self.transition_left)
                self.transition_left -= tr
                if self.transition_left <= 0:
                    self.restoring = False
                self.result.transition_s += tr
                if tr:
                    self.result.segments.append((t, t + tr, 0.0))
                if span > tr:
                    self.result.samples += (span - tr) / self.iteration_s * self.p.spec.dp * self.p.spec.microbatches
                    self.result.segments.append((t + tr, stop, self.p.fault_free_s / self.iteration_s))
            t = stop


def replay(spec: Spec, trace: Trace, *, seed: int = 0, per_instance: int = 1,
           policies: Sequence[str] = POLICIES, costs: Costs | None = None, solver: str = "greedy",
           time_limit: float = 0.05, shadow: bool = False) -> ReplayResult:
    """Replay `trace` on `spec`'s job under each of `policies` (see the module docstring); `shadow`:
    model `schedc train --shadow` (stage s's state also on stage s + 1's GPUs)."""
    policies = check_policies(policies)
    costs = costs or Costs()
    gpus = spec.dp * spec.pp
    check_fits(trace, gpus, per_instance, spec.source_name)
    states = availability(trace, gpus, seed=seed, per_instance=per_instance)
    # Rows at one time are one event: the last of them says what the job has from then on.
    states = [st for i, st in enumerate(states) if i + 1 == len(states) or states[i + 1][0] != st[0]]
    planner = Planner(spec, solver=solver, time_limit=time_limit, seed=seed, shadow=shadow)
    loss = LossRate()
    runs = [_Run(name, planner, costs, loss) for name in policies]
    horizon = Horizon(costs.horizon_s)
    start = states[0][0]
    prev_t, last = start, planner.all
    events = 0
    for t, live in states:
        for run in runs:
            run.advance(prev_t, t)
        prev_t = t
        if live == last:
            continue
        loss.event(len(last - live), len(last))
        last = live
        events += 1
        horizon.event(t)
        for run in runs:
            run.event(t, live, horizon.seconds)
    g = spec.dp * spec.microbatches
    duration = states[-1][0] - start
    for run in runs:
        run.result.fault_free_samples = duration / planner.fault_free_s * g
    return ReplayResult(
        spec=spec.source_name, trace=trace.name, seed=seed, gpus=gpus, per_instance=per_instance,
        duration_s=duration, events=events, fault_free_iteration_s=planner.fault_free_s, global_microbatches=g,
        horizon=f"mean gap between events so far ({costs.horizon_s:.0f} s before the second event)",
        costs=costs, policies={r.name: r.result for r in runs},
        live=tuple((t, len(live)) for t, live in states), shadow=shadow,
        shadow_overhead_s=planner.shadow_s(planner.user_layout(planner.all), planner.fault_free_s),
        checkpoint_bytes=planner.checkpoint_bytes)
