"""The recovery policy: which plan a live run goes on with after GPUs fail.

Given the ranks that just failed, `RecoveryPolicy.decide` returns a `Change`
for the supervisor to carry out:

* ``auto`` (the default): the cheapest of ``reroute`` and ``drop-pipeline``
  by `schedc.recovery_cost` (the plan that trains the expected time to the
  next event's work soonest, transition included), ``checkpoint`` when a
  stage lost every GPU (``repartition`` when the host of a GPU to replace is
  gone: its agent no longer answers); every decision is noted with its numbers;
* ``reroute``: `schedc.replan` the survivors (SlipStream/ReCycle:
  a failed GPU's work goes to its data-parallel peers);
* ``drop-pipeline`` (FT-HSDP/torchft): a pipeline with a failed GPU leaves;
* ``checkpoint``: a stage lost every GPU, so re-routing is impossible: the
  latest complete checkpoint (or the initial weights) is restored with
  replacement processes for that stage's GPUs, at most `max_restarts` times;
* ``repartition``: as ``auto`` while a stage keeps a live GPU; when a stage
  lost every GPU, no replacement process is started: the survivors are laid
  out anew with the same data-parallel width and fewer stages
  (`schedc.repartition.partition_units`), every process restarts on that plan
  and restores the latest checkpoint (or the initial weights) re-sharded onto
  its new split (`schedc.live.reshard`). Exact; the state comes from disk,
  not over torch.distributed (at most `max_restarts` times). Once every GPU
  the job lost is asked back, the supervisor grows back onto the spec's plan
  at the next complete checkpoint the same way (`schedc.live.growth`; onto
  part of them, under ``auto``, once ski rental says the growth has paid
  for itself: `growth_option` prices it);
* ``restart`` (torchelastic): every process restarts from the latest
  checkpoint, the failed GPUs replaced.

The policy talks to the run only through its `Controller`; it never waits
and never touches processes.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from schedc.diagnostics import LostStageError, RunError, SchedcError, error
from schedc.live.control import Controller
from schedc.live.layouts import covers, holding, layout_candidates
from schedc.recovery_cost import Costs, Horizon, LossRate, Option, choose, restore_risk_s, transition_s
from schedc.spec import Failure

if TYPE_CHECKING:  # pragma: no cover
    from schedc.live.checkpoint import Checkpoint
    from schedc.plan import Plan


@dataclass(frozen=True)
class Change:
    """What the run does next: announce `plan` as the next generation."""

    plan: "Plan"
    events: tuple[str, ...]  # what happened, as replan event text (for the record)
    method: str  # reroute, drop-pipeline, checkpoint, restart
    restore: str | None = None  # a checkpoint's path, "initial", or None: roll back in memory
    replacements: tuple[int, ...] = ()  # ranks that get a fresh process (their stage was lost)
    restart_all: bool = False  # every survivor is stopped first (recovery "restart")
    # A re-partition: `ranks[d][s]` is the GPU (a rank of the plan it was decided from) that runs
    # stage s of pipeline d, rank d * pp + s of the new plan.
    ranks: tuple[tuple[int, ...], ...] | None = None
    # A re-partition that also takes spare GPUs of the job (left unused by an earlier one): each
    # rank of the new plan -> the job's GPU that runs it, named as the job's spec names it. The
    # survivors among them keep their processes; the spare ones get fresh processes.
    physical: tuple[tuple[int, int], ...] | None = None


def lost_stages(spec, lost: set[int]) -> list[int]:
    """The stages of `spec` with no live GPU outside `lost`."""
    return [s for s in range(spec.pp) if not [g for g in spec.gpus if g.pp == s and g.live and g.rank not in lost]]


def failure_events(spec, failed: Sequence[int]) -> list[Failure]:
    """Replan events for ranks that died: a whole node as `fail node N` when every GPU of it died
    now, else one GPU each. A node one of whose GPUs had failed before is its other GPUs: `fail
    node N` named GPUs this failure did not take (the `replan:` line said `fail node 0` when only
    GPU (dp=0, pp=1) had died)."""
    per = spec.cluster.gpus_per_node
    world = spec.dp * spec.pp
    out, covered = [], set()
    for node in sorted({spec.cluster.node_of(r) for r in failed}):
        ranks = range(node * per, min((node + 1) * per, world))
        if len(ranks) > 1 and all(r in failed for r in ranks):
            out.append(Failure("fail_node", node=node))
            covered.update(ranks)
    for r in failed:
        if r not in covered:
            g = spec.gpus[r]
            out.append(Failure("fail_gpu", dp=g.dp, pp=g.pp))
    return out


def replan_solver(spec) -> str:
    """The solver a live replan of a plan compiled from `spec` uses: the spec's when it can
    re-route (templates cannot), else cpsat."""
    chosen = spec.schedule.solver
    return chosen if chosen in ("cpsat", "greedy") else "cpsat"


def resume_hint(out: str | Path, found: "Checkpoint | None", iterations: int | None) -> str:
    """How to go on from the latest complete checkpoint `found` (what a user types), and where the run's record is."""
    if found is None:
        return "no complete checkpoint was written (train with --checkpoint-every K to have one to resume)"
    return (f"the latest complete checkpoint is `{found.path}` (after {found.iteration} steps): resume with "
            f"`{resume_command(out, found, iterations)}`; the --log file holds the run's events")


def resume_command(out: str | Path, found: "Checkpoint", iterations: int | None = None) -> str:
    """The command that resumes this run from checkpoint `found` (E553's hint): its checkpoint
    folder when it is not OUT's default one, --emulate when the checkpoint was written so
    (resuming checks both), and the run's --iterations when known (without it the resumed run
    ends at the spec's count)."""
    words = ["schedc", "train", str(out), "--resume"]
    root = Path(found.path).parent
    if root.resolve() != (Path(out) / "checkpoints").resolve():
        words += ["--checkpoint-dir", str(root)]
    if found.meta.get("emulate"):
        words.append("--emulate")
    if iterations is not None:
        words += ["--iterations", str(iterations)]
    return shlex.join(words)


def describe(events: Sequence[Failure]) -> list[str]:
    from schedc.events import describe_events

    return [describe_events([e]) for e in events]


#: Failures less than this many seconds after the start of the last event count as part of it
#: (`Horizon`'s burst): GPUs of one reclaim are found failed one after another within seconds, and
#: the horizon, the mean gap between events, must not read those as events a second apart.
BURST_S = 60.0
#: Share of the replan deadline that planning a re-partition's candidate layouts may take, by
#: their predicted planning time (`RecoveryPolicy.laid_out`; greedy, a 0.05 s work budget each).
LAYOUT_SHARE = 0.6
#: How long (seconds) an answer to "whose hosts are gone" is reused within one recovery
#: (`RecoveryPolicy._unreachable`): well under an agent's timeout, so a host lost since is asked
#: about again, and longer than a decision takes between the two questions (a replan).
ASKED_FRESH_S = 1.0


class RecoveryPolicy:
    """Chooses the `Change` after a failure (see the module docstring)."""

    def __init__(self, ctl: Controller, *, method: str, max_restarts: int, initial_plan: "Plan",
                 latest_checkpoint: Callable[[], "Checkpoint | None"], out: str | Path = "OUT",
                 costs: Costs | None = None, clock: Callable[[], float] = time.monotonic,
                 iterations: int | None = None, shadow: bool = False, deadline_s: float = 0.5):
        self.ctl = ctl
        self.costs = costs or Costs()
        self.horizon = Horizon(self.costs.horizon_s, burst_s=BURST_S)
        self.loss = LossRate(burst_s=BURST_S)  # how hard losses hit so far: the restore a layout risks (`laid_out`)
        self.shadow = shadow  # --shadow: a layout with room for them keeps each stage on the next one's GPUs
        self.deadline_s = deadline_s  # what planning a decision's layouts may take (`laid_out`)
        self.clock = clock
        self.out = out
        self.method = method
        self.max_restarts = max_restarts
        self.initial_plan = initial_plan
        self.latest_checkpoint = latest_checkpoint
        self.restarts = 0
        self._in_place = ""
        self._keep: Sequence[Sequence[int]] = ()  # (an in-place move's holders: `survivor_layout`)
        # The last answer to "whose hosts are gone" (`_unreachable`): (when, the ranks asked, the answer).
        self._asked: tuple[float, frozenset[int], dict[int, list[int]]] | None = None
        self.iterations = iterations  # the run's total (E553's resume command); None: not known here
        self.refused: list[SchedcError] = []  # why the planner refused layouts of the last re-partition

    def repartitions(self, plan: "Plan", lost: set[int]) -> bool:
        """Whether `decide` lays the survivors out anew: a stage of `plan` lost every GPU, and the
        policy is ``repartition``, or ``auto`` with the host of a GPU to replace gone."""
        spec = plan.spec
        stages = lost_stages(spec, lost)
        if not stages or self.method not in ("repartition", "auto"):
            return False
        if self.method == "repartition":
            return True
        return bool(self._unreachable(self._replacements(spec, stages, lost)))

    def _replacements(self, spec, stages: Sequence[int], lost: set[int]) -> list[int]:
        """The ranks of `stages` a restore with replacement processes starts: those lost, and those
        the plan leaves without a process that have a GPU of the job (not the holes of a
        re-partitioned layout: `Controller.physical` has no GPU for them)."""
        physical = self.ctl.physical()
        return [g.rank for g in spec.gpus if g.pp in stages and g.rank in physical
                and (g.rank in lost or not g.live)]

    def _unreachable(self, ranks: Sequence[int]) -> dict[int, list[int]]:
        """`Controller.unreachable`, asked once per recovery: asking a live host's agent waits for
        two of its beats (0.1-0.2 s), and a lost stage asks twice for the same ranks (`repartitions`,
        then `_from_checkpoint`). An answer for the same ranks younger than `ASKED_FRESH_S` is
        reused; any other question is asked afresh."""
        key, now = frozenset(ranks), self.clock()
        if self._asked is not None and self._asked[1] == key and now - self._asked[0] <= ASKED_FRESH_S:
            return self._asked[2]
        answer = self.ctl.unreachable(sorted(key))
        self._asked = (self.clock(), key, answer)
        return answer

    def decide(self, plan: "Plan", failed: Sequence[int], lost: set[int], *, in_place: str = "",
               keep: Sequence[Sequence[int]] = ()) -> Change:
        """The change after `failed` failed, from `plan` (the last plan that ran); `lost` holds
        every rank lost for good so far, `failed` included. Raises `RunError` when the run cannot
        go on. `in_place`: a re-partition keeps the survivors' processes instead of restarting
        them (`schedc.live.relayout`), which move their state among themselves ("move": `keep`
        holds each stage) or restore the latest checkpoint, re-sharded ("restore"): said so, and
        no restart is counted."""
        try:
            return self._decide(plan, failed, lost, in_place, keep)
        finally:
            self._asked = None  # (asked once per recovery: the next one asks afresh)

    def _decide(self, plan: "Plan", failed: Sequence[int], lost: set[int], in_place: str,
                keep: Sequence[Sequence[int]]) -> Change:
        self._in_place, self._keep = in_place, keep
        live_before = sum(1 for g in plan.spec.gpus if g.live and (g.rank not in lost or g.rank in failed))
        self.loss.event(len(failed), live_before, self.clock(), plan=plan)
        if self.method == "restart":
            found = self.latest_checkpoint()
            restore = str(found.path) if found else "initial"
            return Change(self.initial_plan, (f"restart from {found.path.name if found else 'the initial weights'}",),
                          "restart", restore=restore, restart_all=True)
        events = failure_events(plan.spec, failed)
        if self.method in ("auto", "repartition"):
            return self._cheapest(plan, events, lost)
        solver = "drop-pipeline" if self.method == "drop-pipeline" else None
        try:
            return Change(self.ctl.replan(plan, events, solver=solver), tuple(describe(events)), self.method)
        except LostStageError as exc:
            return self._from_checkpoint(plan, events, lost, exc)
        except SchedcError as exc:  # e.g. no plan fits in memory any more
            raise RunError([error("E553", f"no plan can continue after {', '.join(describe(events))}",
                                  hint="see the reason below")] + list(exc.diagnostics)) from None

    def laid_out(self, spec, gpus: Sequence[int], keep: Sequence[Sequence[int]] = (), *, cover: bool,
                 price: Callable, work_iterations: float,
                 share: float = LAYOUT_SHARE) -> tuple[Option, list[Option]] | None:
        """The re-partition of `gpus` (ranks of `spec`) that trains `work_iterations` iterations
        soonest (`recovery_cost.choose`, as `schedc replay` chooses), and every option weighed:
        each of `layout_candidates`, planned (greedy), priced by its predicted iteration time,
        ``price(layout) -> (transition seconds, largest share one GPU receives)``, and the restore
        its stages' replicas risk at the next loss (`restore_risk_s`, from `loss`: a layout of one
        pipeline loses a stage at any loss; with `shadow`, in a layout with room for them, a stage
        whose GPUs are all lost comes back from its shadows on the next stage's GPUs, and the
        iteration pays what they add, `shadow_overhead_us`). `cover`: only layouts that run one
        GPU of each group of `keep` (an in-place move). The chosen option's `plan` is ``(layout, plan)``; None when
        no layout fits. Which layouts are planned is decided by their predicted planning time
        (`repartition._S_PER_OP`), not the clock, so the choice is the same on every run: those
        that fit `share` of `deadline_s` together, in order (the job's own pipelines first,
        then the best by estimate), and always the first."""
        from schedc.layout import checkpoint_bytes, shadow_fits, shadow_overhead_us, units_of
        from schedc.repartition import _S_PER_OP, Shape, _planned_ops, plan_layout

        units = units_of(spec)
        options = []
        predicted = 0.0
        for layout in layout_candidates(spec, gpus, keep):
            if cover and not covers(layout.gpus, keep):
                continue
            shape = Shape(layout.dp, layout.pp, layout.microbatches, layout.slices, 0, layout.holes)
            predicted += _S_PER_OP["greedy"] * _planned_ops(shape, "greedy")
            if options and predicted > share * self.deadline_s:
                break
            try:
                new = plan_layout(spec.without_failures(), layout, "greedy", time_limit=0.05)
            except SchedcError as exc:  # (the estimate's memory model passed, the planner's did not)
                self.refused.append(exc)
                continue
            transition, moved = price(layout)
            replicas = [sum(1 for row in layout.ranks if row[st] is not None) for st in range(layout.pp)]
            shadows = self.shadow and layout.pp > 1 and shadow_fits(units, layout, spec.cluster.gpu.memory)
            # (with shadows, stage s + 1's GPUs hold stage s too: it needs the checkpoint only if all go)
            holders = [replicas[(st + 1) % layout.pp] for st in range(layout.pp)] if shadows else None
            risk = restore_risk_s(self.costs, replicas, self.loss, holders, checkpoint_bytes(units))
            iteration_us = new.metrics.iteration_time
            if shadows:  # (what they add to every iteration, as the replay prices them)
                iteration_us += shadow_overhead_us(units, layout, spec.cluster.link, iteration_us=iteration_us)
            holes = f" with {layout.holes} slot(s) re-routed" if layout.holes else ""
            options.append(Option("repartition", iteration_us / 1e6, transition, moved,
                                  f"{layout.dp} x {layout.pp}{holes}", risk_s=risk, shadows=shadows,
                                  plan=(layout, new)))
        if not options:
            return None
        return choose(options, work_iterations), options

    def _resume(self, found: "Checkpoint") -> str:
        """E553's command that resumes from `found`, quoted for a hint."""
        text = f"`{resume_command(self.out, found, self.iterations)}`"
        return text if self.iterations is not None else text + " (and `--iterations N` if the run was given one)"

    def _cheapest(self, plan: "Plan", events: list[Failure], lost: set[int]) -> Change:
        """recovery="auto": price re-routing and dropping pipelines, take the cheaper; a lost stage
        goes to `_from_checkpoint` as with any method."""
        self.horizon.event(self.clock())
        before_s = plan.metrics.iteration_time / 1e6
        options: list[Option] = []
        problems: list[SchedcError] = []
        for method, solver in (("reroute", None), ("drop-pipeline", "drop-pipeline")):
            try:
                new = self.ctl.replan(plan, events, solver=solver)
            except LostStageError as exc:
                if self.method == "repartition":
                    return self._repartitioned(plan, events, lost, exc)
                return self._from_checkpoint(plan, events, lost, exc)
            except SchedcError as exc:
                problems.append(exc)
                continue
            cost = transition_s(self.costs, lost_gpus=True, moved_bytes=0, bandwidth=plan.spec.cluster.link.bandwidth,
                                previous_iteration_s=before_s)
            options.append(Option(method, new.metrics.iteration_time / 1e6, cost, plan=new))
        if not options:
            raise RunError([error("E553", f"no plan can continue after {', '.join(describe(events))}",
                                  hint="see the reasons below")] + [d for exc in problems for d in exc.diagnostics])
        fault_free_s = (plan.metrics.fault_free_iteration_time or plan.metrics.iteration_time) / 1e6
        horizon = self.horizon.seconds
        best = choose(options, horizon / fault_free_s)
        others = "; ".join(o.describe() for o in options if o is not best)
        self.ctl.note("decision", f"recovery: {best.method} ({best.iteration_s * 1e3:.2f} ms per iteration)"
                                  + (f", not {others}" if others else "")
                                  + f"; horizon {horizon:.0f} s to the next event",
                      chosen=best.method, horizon_s=round(horizon, 3),
                      options=[{"method": o.method, "iteration_s": o.iteration_s,
                                "transition_s": round(o.transition_s, 4)} for o in options])
        return Change(best.plan, tuple(describe(events)), best.method)  # type: ignore[arg-type]

    def _repartitioned(self, plan: "Plan", events: list[Failure], lost: set[int], exc: SchedcError,
                       because: str = "") -> Change:
        """A stage lost every GPU: the survivors laid out anew (the layout that trains the horizon's
        work soonest: `laid_out`), no replacement process: in place (`decide`'s `in_place`), or
        every process restarted on that plan from the latest checkpoint (re-sharded). The job's
        spare GPUs (healthy ones an earlier re-partition left unused: `Controller.spares`) are
        weighed too: a layout over the survivors and them starts fresh processes on the spare
        ones, which receive their layers as the others do (a move) or restore the checkpoint.
        `because`: why no replacement is started, when the policy is not `repartition` itself."""
        from schedc.layout import units_of

        spec = plan.spec
        survivors = sorted(g.rank for g in spec.gpus if g.live and g.rank not in lost)
        found = self.latest_checkpoint()
        units = units_of(spec)
        keep = self._keep if self._in_place else ()
        move = self._in_place == "move"  # (the layers each GPU lacks move to it, a lost stage's from its shadows)
        held = holding(spec, keep) if move else None
        fault_free_s = (plan.metrics.fault_free_iteration_time or plan.metrics.iteration_time) / 1e6
        work = self.horizon.seconds / fault_free_s
        spares = sorted(self.ctl.spares())
        self.refused = []
        share = LAYOUT_SHARE / 2 if spares else LAYOUT_SHARE  # (two sets of layouts share the deadline)
        chosen = self.laid_out(spec, survivors, keep, cover=move, price=self._price(plan, units, held),
                               work_iterations=work, share=share)
        options = [] if chosen is None else list(chosen[1])
        wide = self._with_spares(plan, survivors, spares, keep, held, work, share) if spares else []
        if options or wide:
            best = choose(options + wide, work)
            if len(options) + len(wide) > 1:
                others = "; ".join(o.describe().replace("repartition: ", f"{o.detail}: ")
                                   for o in options + wide if o is not best)
                self.ctl.note("decision", f"re-partition: {best.detail} ({best.iteration_s * 1e3:.2f} ms per iteration"
                                          f"{f', restore risk {best.risk_s:.1f} s' if best.risk_s >= 0.05 else ''}), "
                                          f"not {others}; horizon {self.horizon.seconds:.0f} s to the next event",
                              chosen=best.detail, horizon_s=round(self.horizon.seconds, 3),
                              options=[{"layout": o.detail, "iteration_s": o.iteration_s,
                                        "transition_s": round(o.transition_s, 4), "moved_bytes": o.moved_bytes,
                                        "risk_s": round(o.risk_s, 4)} for o in options + wide])
        laid = best.plan if options or wide else None
        if (self.restarts >= self.max_restarts and not self._in_place) or laid is None:
            why = self._why_not(laid, survivors, spares)
            where = (f"the latest complete checkpoint is `{found.path}`; resume from it (onto fewer stages if "
                     f"need be, docs/live.md) with {self._resume(found)}" if found else
                     "no checkpoint was written (train with --checkpoint-every K)")
            raise RunError([error("E553", f"a stage lost every GPU and the survivors cannot be re-partitioned: "
                                          f"{why}", hint=where)] + list(exc.diagnostics)
                           + [d for refused in self.refused[:1] for d in refused.diagnostics])
        layout, new = laid
        on_spares = any(best is o for o in wide)
        slices, ranks = layout.slices, layout.ranks
        # (`gpus`: ranks of the plan that ran, or with `spare`, the job's GPUs as its spec names them)
        shape = {"dp": layout.dp, "pp": layout.pp, "slices": [list(s) for s in slices],
                 "gpus": [list(row) for row in ranks]}
        placed, taken = None, []
        if on_spares:  # (`ranks` name the job's GPUs: the new plan's ranks run on them)
            placed = tuple((d * layout.pp + s, r) for d, row in enumerate(ranks) for s, r in enumerate(row)
                           if r is not None)
            taken = sorted(set(layout.gpus) & set(spares))
            shape["spare"] = taken
            ranks = None
        layout_ranks = None if ranks is None else tuple(tuple(row) for row in ranks)
        kept = len(layout.gpus) - len(taken)  # (the survivors it runs: the others wait, spare)
        who, started = _in_place_words(self.initial_plan.spec, len(survivors), kept, taken)
        if self._in_place == "move":
            how = (f"{started}, and the layers move among them" if taken else
                   "they keep their processes and move the layers among themselves")
            self.ctl.note("repartition", f"a stage lost every GPU{because}: re-partitioning {who} as "
                                         f"{layout.describe(units.kind)}; {how} (a lost stage's from its shadows)",
                          layout=shape)
            return Change(new, tuple(describe(events)), "repartition", restart_all=True, ranks=layout_ranks,
                          physical=placed)
        restore = str(found.path) if found else "initial"
        if self._in_place == "restore":
            how = (f"{started}, and all restore" if taken and kept else f"{started} and restore" if taken else
                   "they keep their processes and restore")
            self.ctl.note("repartition", f"a stage lost every GPU{because}: re-partitioning {who} as "
                                         f"{layout.describe(units.kind)}; {how} "
                                         f"{found.path.name if found else 'the initial weights'}, re-sharded "
                                         "(no shadow holds the lost stage)", restore=restore, layout=shape)
            return Change(new, tuple(describe(events)), "repartition", restore=restore, restart_all=True,
                          ranks=layout_ranks, physical=placed)
        self.restarts += 1
        self.ctl.note("restart", f"a stage lost every GPU{because}: re-partitioning {who} as "
                                 f"{layout.describe(units.kind)} and restarting every process from "
                                 f"{found.path.name if found else 'the initial weights'}, re-sharded "
                                 f"(restart {self.restarts} of {self.max_restarts})", restore=restore,
                      layout=shape)
        return Change(new, tuple(describe(events)), "repartition", restore=restore, restart_all=True,
                      ranks=layout_ranks, physical=placed)

    def _with_spares(self, plan: "Plan", survivors: Sequence[int], spares: Sequence[int],
                     keep: Sequence[Sequence[int]], held: dict[int, frozenset[int]] | None, work: float,
                     share: float) -> list[Option]:
        """`_repartitioned`'s options over the `survivors` (ranks of `plan`) and the job's `spares`,
        named as the job's spec names its GPUs: those that take at least one spare GPU (a layout
        of the survivors alone is weighed in their own numbering). `held`: a move's units held by
        each rank of `plan`, translated to the job's GPUs (with the job's units not matched to the
        running plan's unit by unit, none: each GPU receives its whole stage, an upper bound)."""
        from schedc.layout import units_of

        physical = self.ctl.physical()
        job = self.initial_plan.spec
        units = units_of(job)
        if held is not None:
            same = units_of(plan.spec).kind == units.kind == "layer"
            held = {physical[r]: u for r, u in held.items() if r in physical} if same else {}
        laid = self.laid_out(job, sorted({physical[r] for r in survivors} | set(spares)),
                             [[physical[r] for r in group] for group in keep], cover=held is not None,
                             price=self._price(plan, units, held), work_iterations=work, share=share)
        out = []
        for o in [] if laid is None else laid[1]:
            taken = len(o.plan[0].gpus & set(spares))
            if taken:
                out.append(dataclasses.replace(o, detail=f"{o.detail} (+{taken} spare)"))
        return out

    def _why_not(self, laid, survivors: Sequence[int], spares: Sequence[int]) -> str:
        """Why `_repartitioned` cannot go on (E553's message): no restart left, or no layout."""
        if laid is not None:
            return f"no restart is left (--max-restarts {self.max_restarts})"
        if not survivors and not spares:
            return "no GPU of the running layout survives, and no spare GPU is left"
        gpus = f"{len(survivors)} surviving GPU(s)" + (f" and {len(spares)} spare one(s)" if spares else "")
        holders = self._in_place == "move"
        if self.refused:
            return (f"the planner refused every layout of the {gpus}"
                    + (" that keeps a holder of every stage" if holders else "") + " (below)")
        return f"the {gpus}" + (" have no layout that keeps a holder of every stage" if holders else
                                " cannot hold one pipeline of the model (its memory)")

    def _price(self, plan: "Plan", units, held: dict[int, frozenset[int]] | None) -> Callable:
        """``price(layout) -> (transition seconds, largest share one GPU receives)`` of a
        re-partition from `plan` into layouts of `units`: with `held` (each GPU the layouts name
        -> the units it holds), an in-place move, whose GPUs receive the units they lack (a GPU not
        in `held`, a spare one, receives all of its stage's: with the layouts' stages not matched
        unit by unit to what runs, `held` is empty, an upper bound); without, a restore, the same
        for every layout."""
        from schedc.layout import received_bytes

        before_s, bandwidth = plan.metrics.iteration_time / 1e6, plan.spec.cluster.link.bandwidth
        if held is not None:
            def price(layout):
                moved = max(received_bytes(units, layout, held).values(), default=0)
                return transition_s(self.costs, lost_gpus=True, moved_bytes=moved, bandwidth=bandwidth,
                                    previous_iteration_s=before_s), moved
            return price
        cost = transition_s(self.costs, lost_gpus=True, moved_bytes=0, bandwidth=bandwidth,
                            previous_iteration_s=before_s, restore=True)
        return lambda layout: (cost, 0)

    def _from_checkpoint(self, plan: "Plan", events: list[Failure], lost: set[int], exc: SchedcError) -> Change:
        """A stage lost every GPU: restore the latest checkpoint with replacements for that stage."""
        spec = plan.spec
        stages = lost_stages(spec, lost)
        replacements = self._replacements(spec, stages, lost)
        gone = self._unreachable(replacements)
        if gone:  # (a spot instance taken back with its GPUs: nothing can be started there)
            hosts = ", ".join(f"host {h} (rank(s) {rs})" for h, rs in sorted(gone.items()))
            hosts += " is gone" if len(gone) == 1 else " are gone"
            if self.method == "auto":
                return self._repartitioned(plan, events, lost, exc, because=f" and {hosts}, so no "
                                                                            "replacement process can start")
            raise RunError([error("E553", f"stage(s) {stages} lost every GPU, so re-routing is impossible, and "
                                          f"the replacement processes cannot start: {hosts}",
                                  hint="`--recovery auto` or `--recovery repartition` goes on without them, on the "
                                       "surviving GPUs laid out anew")] + list(exc.diagnostics))
        found = self.latest_checkpoint()
        if self.restarts >= self.max_restarts:
            where = (f"the latest complete checkpoint is `{found.path}`; resume from it with "
                     f"{self._resume(found)} once the GPUs are replaced" if found else
                     "no checkpoint was written (train with --checkpoint-every K)")
            raise RunError([error("E553", "a stage lost every GPU, so re-routing is impossible, and no restart is "
                                          f"left (--max-restarts {self.max_restarts})", hint=where)]
                           + list(exc.diagnostics))
        self.restarts += 1
        recover = [Failure("recover_gpu", dp=spec.gpus[r].dp, pp=spec.gpus[r].pp) for r in replacements]
        new = self.ctl.replan(plan, events + recover)
        restore = str(found.path) if found else "initial"
        self.ctl.note("restart", f"stage(s) {stages} lost every GPU: restoring "
                                 f"{found.path.name if found else 'the initial weights'} with replacement "
                                 f"process(es) for rank(s) {replacements} (restart {self.restarts} of "
                                 f"{self.max_restarts})", stages=stages, replacements=replacements,
                      restore=restore)
        return Change(new, tuple(describe(events + recover)), "checkpoint", restore=restore,
                      replacements=tuple(replacements))


def _in_place_words(job, survivors: int, kept: int, spares: Sequence[int]) -> tuple[str, str]:
    """(who, started) of the note of an in-place re-partition of `survivors` GPUs that runs `kept`
    of them and the job's `spares` (`job`'s ranks): the GPUs it lays out, and how processes start
    on the spare ones ("" without)."""
    some = f"{kept} of the {survivors} survivors" if kept < survivors else f"the {survivors} survivors"
    if not spares:
        return some, ""
    named = ", ".join(f"GPU (dp={job.gpus[p].dp}, pp={job.gpus[p].pp})" for p in spares)
    if not kept:
        return f"{len(spares)} spare GPU(s) of the job ({named})", "fresh processes start on them"
    return (f"{some} and {len(spares)} spare GPU(s) of the job ({named})",
            "the survivors keep their processes and fresh ones start on the spare GPUs")


def restored_name(restore: str | None) -> str:
    """How a generation's `restore` reads in a message."""
    return "the initial weights" if restore == "initial" else Path(restore).name
