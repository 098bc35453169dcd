"""Growing back: GPUs the job lost come back after a re-partition (`Growth`, a mixin of
`schedc.live.supervisor.Supervisor`).

After a re-partition the run's ranks are the new layout's. A GPU asked back
(`schedc rejoin`, an injected `recover gpu(...)`) that the running layout lost
since is taken back into it (catch-up, then a switch: `schedc.live.rejoin`);
one outside it counts toward **growing**: once the GPUs back make a faster
layout than the running one (the spec's own once every GPU the job lost is
back), the job grows onto it at a complete checkpoint, in place (the running
processes keep theirs and the layers move among the members:
`Relayout._grow_in_place`) or, when that layout leaves out every running GPU
of a stage, by restarting every process from that checkpoint, re-sharded.

**When** is priced as every recovery is (`schedc.recovery_cost`). Back onto
the spec's own layout, the job grows at the next complete checkpoint
whatever the policy: nothing is missing any more. A growth onto part of the
job's GPUs grows at once (the next complete checkpoint) under a fixed
`--recovery`; under ``auto`` ski rental decides (`recovery_cost.grow_delay_s`,
as in `schedc replay`): how long the GPUs back stay is unknown, so the run
keeps its plan until the time lost by not growing, ``(1 - new / running
iteration time) x seconds since the GPUs came back``, reaches the growth's
price (`growth_option`: reconfiguring, and the largest share of state one GPU
receives over the link; a restart's fixed part instead when the growth
restarts every process), then grows at the next complete checkpoint. Each
GPU that comes back, and each recovery, starts the rent afresh, as an event
does in the replay.
Whatever the GPUs' stay, this loses at most twice what growing at the best
moment in hindsight would.
"""

from __future__ import annotations

from schedc.live.protocol import Phase, RejoinAsked
from schedc.live.layouts import covers, growth_option, layout_words
from schedc.live.result import Recovery
from schedc.plan import Plan
from schedc.recovery_cost import Option, grow_delay_s


class Growth:
    """How a re-partitioned `Supervisor` grows back onto GPUs that return (the module docstring)."""

    def _start_growth(self) -> None:
        self._grow_at_checkpoint = False  # GPUs came back: grow onto them at the next complete checkpoint
        self._grow_since = 0.0  # when the last of them came back, or a recovery since (the rent's start)
        self._growth_cache = None  # ((GPUs up, generation, keep), what `_growth_target` found)

    def _on_rejoin_asked(self, msg: RejoinAsked, now: float) -> None:
        from schedc.events import parse_events

        try:
            (ev,) = parse_events(msg.event)
            if ev.kind != "recover_gpu":
                raise ValueError
        except Exception:
            self._note("warning", f"warning: ignored a rejoin request that is not `recover gpu(dp=D, pp=S)`: "
                                  f"{msg.event!r}")
            return
        cluster = self.recovery.initial_plan.spec.cluster  # (GPUs are named as the job named them)
        if not (0 <= ev.dp < cluster.dp and 0 <= ev.pp < cluster.pp):
            self._note("warning", f"warning: ignored a rejoin request for GPU (dp={ev.dp}, pp={ev.pp}): the cluster "
                                  f"has dp 0..{cluster.dp - 1} and pp 0..{cluster.pp - 1}")
            return
        self._user_rejoin(cluster.rank_of(ev.dp, ev.pp), "asked for with schedc rejoin")

    def _gpu_name(self, rank: int) -> str:
        """`Controller.gpu_name`."""
        if self.repartitioned is None or rank not in self.physical:
            g = self.plan.spec.gpus[rank]
            return f"GPU (dp={g.dp}, pp={g.pp})"
        g = self.recovery.initial_plan.spec.gpus[self.physical[rank]]
        return f"GPU (dp={g.dp}, pp={g.pp}) of the job"

    def _user_rejoin(self, rank: int, reason: str) -> None:
        """A rejoin a user asked for (`schedc rejoin`, an injected `recover gpu(...)`), of a GPU named
        as the job named it at its start (`rank` of the initial plan). After a re-partition the
        run's ranks are the new layout's (`physical` maps them to those names): a GPU of the layout
        lost since is taken back into it (catch-up, then a switch); one outside it counts toward
        growing, which happens at the next complete checkpoint once the GPUs back make a faster
        layout (in place, or by a restart from that checkpoint: `_grow_back`), the spec's own once
        every GPU the job lost is back."""
        if self.repartitioned is None:
            self.rejoins.request(rank, reason)
            return
        g = self.recovery.initial_plan.spec.gpus[rank]
        name = f"GPU (dp={g.dp}, pp={g.pp}) of the job"
        current = next((r for r, p in self.physical.items() if p == rank), None)
        if current is not None:
            if current in self.dead:  # lost since the re-partition: back into the layout that runs
                self.rejoins.request(current, reason)  # (its note names the job's GPU and the layout's slot)
            else:
                self._note("rejoin", f"{name} did not leave it (it runs in the re-partitioned layout as rank "
                                     f"{current}): nothing to take back ({reason})", rank=rank)
            return
        if not self.options.checkpoint_every:
            self._note("warning", f"warning: cannot take GPU (dp={g.dp}, pp={g.pp}) back ({reason}): the job was "
                                  f"re-partitioned onto {self.repartitioned}, and it grows back onto returned GPUs "
                                  "through a checkpoint, which this run does not write (--checkpoint-every K); to "
                                  "train on every GPU again, stop the run and start it again", rank=rank)
            return
        if rank not in self.lost_to_repartition:
            self._note("rejoin", f"{name} is not lost: it waits, unused, for the job to grow ({reason})", rank=rank)
            return
        self.recovery.loss.event(0, len(self.gen.members) - len(self.dead))  # (an event: the share of losses)
        self.lost_to_repartition.discard(rank)
        self._returned.add(rank)
        self.spare.add(rank)
        back = f"{len(self._returned)} of the {len(self._returned) + len(self.lost_to_repartition)} GPU(s) the job lost"
        keep = self._grow_keep()  # (as it will grow: keeping a running GPU of each stage where it can)
        if not all(keep):  # a stage no running process holds: its loss is being recovered first
            self._grow_at_checkpoint = True
            self._grow_since = self._now()
            self._note("rejoin", f"{name} is back ({reason}): {back}; a stage lost meanwhile is recovered first, "
                                 "and whether the job grows onto the GPUs back is weighed at a complete checkpoint "
                                 "after that", rank=rank)
            return
        target = self._growth_target(keep)
        if target is None:
            self._grow_at_checkpoint = False
            self._note("rejoin", f"{name} is back ({reason}): {back}; it grows back once enough are back to make "
                                 "a faster layout", rank=rank)
            return
        plan, physical = target
        self._grow_at_checkpoint = True
        self._grow_since = self._now()  # (the rent starts afresh at each GPU back)
        if plan is not self.recovery.initial_plan and self.options.recovery == "auto":
            price = self._growth_price(plan, physical, keep)
            delay = grow_delay_s(self.plan.metrics.iteration_time / 1e6, price) or 0.0
            self._note("decision", f"{name} is back ({reason}): {back}; growing onto {layout_words(plan)} "
                                   f"({plan.metrics.iteration_time / 1e3:.2f} ms per iteration, "
                                   f"against {self.plan.metrics.iteration_time / 1e3:.2f} now) costs "
                                   f"{price.transition_s:.2f} s ({price.detail}): it grows at the first complete "
                                   f"checkpoint {delay:.1f} s from now, when the time lost by not growing has paid "
                                   "for it, unless another GPU comes back first (ski rental)", rank=rank,
                       chosen="grow", option=_priced(price), grow_after_s=round(delay, 3))
            return
        if plan is self.recovery.initial_plan:
            self._note("rejoin", f"{name} is back ({reason}): every GPU the job lost is back; it grows back onto "
                                 "the spec's stages at the next complete checkpoint", rank=rank)
        else:
            self._note("rejoin", f"{name} is back ({reason}): {back}; at the next complete checkpoint it grows onto "
                                 f"{layout_words(plan)} "
                                 f"({plan.metrics.iteration_time / 1e3:.2f} ms per iteration, against "
                                 f"{self.plan.metrics.iteration_time / 1e3:.2f} now)", rank=rank)

    def _growth_target(self, keep=()) -> tuple[Plan, dict[int, int]] | None:
        """What the job would grow onto now: the spec's plan once every GPU of the job is up, else the
        fastest re-partition of the GPUs up (those of the running plan that live, and the spare
        ones) when it beats the running plan; with its rank -> GPU map. None: stay. `keep`: groups
        of GPUs of which the layout runs one where it can (`_grow_keep`: for a growth in place)."""
        initial = self.recovery.initial_plan
        everyone = {g.rank for g in initial.spec.gpus if g.live}
        # (a spare GPU on a host found gone cannot start a process: not up)
        up = ({self.physical[r] for r in self.gen.members if r not in self.dead}
              | {p for p in self.spare if self.fleet.host_of_gpu(p) not in self.hosts_gone})
        if up >= everyone:
            return initial, {r: r for r in everyone}
        key = (frozenset(up), self.gen.number, tuple(tuple(group) for group in keep))
        if self._growth_cache is None or self._growth_cache[0] != key:  # (asked again at each checkpoint)
            # The layouts weighed by their iteration time and the restore they risk (the growth's
            # own price is ski rental's, once the layout is chosen: `_growth_price`).
            chosen = self.recovery.laid_out(initial.spec, sorted(up), keep, cover=False,
                                            price=lambda layout: (0.0, 0),
                                            work_iterations=self.recovery.horizon.seconds
                                            / (initial.metrics.iteration_time / 1e6))
            target = None
            if chosen is not None and chosen[0].plan[1].metrics.iteration_time < self.plan.metrics.iteration_time:
                layout, plan = chosen[0].plan
                target = plan, {d * layout.pp + s: r for d, row in enumerate(layout.ranks)
                                for s, r in enumerate(row) if r is not None}
            self._growth_cache = (key, target)
        return self._growth_cache[1]

    def _grow_back(self, found) -> None:
        """GPUs came back and checkpoint `found` is complete: if they make a faster layout than the
        running plan (the spec's, once every GPU the job lost is back), the job grows onto it in
        place (`Relayout._grow_in_place`: the running processes keep theirs, and the layers move
        among the members; a failure meanwhile moves them again, or restores `found` once the
        running processes no longer hold every stage: `Transitions._unfinished`). When that layout leaves out every
        running GPU of a stage, every process restarts on it instead and restores `found`,
        re-sharded onto its stages (the iterations run since it are run again: a few)."""
        self._grow_at_checkpoint = False
        keep = self._grow_keep()
        if not all(keep):  # a stage no running process holds: its recovery comes first; ask again later
            self._grow_at_checkpoint = True
            return
        target = self._growth_target(keep)
        if target is None:
            return
        plan, physical = target
        now = self._now()
        spec = plan.spec
        full = plan is self.recovery.initial_plan
        onto = f"the spec's {spec.dp} x {spec.pp}" if full else layout_words(plan)
        in_place = covers(physical.values(), keep)
        if not full and self.options.recovery == "auto":  # ski rental (the module docstring)
            price = self._growth_price(plan, physical, keep)
            delay = grow_delay_s(self.plan.metrics.iteration_time / 1e6, price)
            rent = now - self._grow_since
            if delay is None:  # (no faster after all: stay, and ask no more until a GPU comes back)
                return
            if rent < delay:
                self._grow_at_checkpoint = True  # (asked again at the next complete checkpoint)
                self._note("decision", f"not growing onto {onto} at {found.path.name} yet: {rent:.1f} s since the "
                                       f"GPUs came back, of the {delay:.1f} s its price of {price.transition_s:.2f} s "
                                       "takes to pay for (ski rental)", quiet=True, chosen="stay",
                           option=_priced(price), grow_after_s=round(delay, 3), waited_s=round(rent, 3))
                return
            self._note("decision", f"growing onto {onto}: in the {rent:.1f} s since the GPUs came back, the time lost "
                                   f"by not growing has paid for its price of {price.transition_s:.2f} s "
                                   f"({price.detail}; ski rental)", chosen="grow", option=_priced(price),
                       waited_s=round(rent, 3))
        if in_place:
            kept = len({p for group in keep for p in group} & set(physical.values()))
            self._note("repartition", f"growing back onto {onto}: the {kept} running processes keep theirs and "
                                      f"move the layers among all {len(physical)} (in place; a failure meanwhile "
                                      f"moves them again, or restores {found.path.name})", restore=str(found.path))
        else:
            self._note("restart", f"growing back onto {onto}: restarting every process from {found.path.name}, "
                                  "re-sharded", restore=str(found.path))
        rec = Recovery(from_generation=self.gen.number, t_detect=now, method="grow-back",
                       t_last_complete=max((r.end for r in self.ledger.records.values()), default=None),
                       predicted_before_us=self.plan.metrics.iteration_time, events=["grow back"])
        self.recoveries.append(rec)
        self._recovery = rec
        self.checkpoints.relayout(spec.pp, self.gen.number + 1)
        self.repartitioned = None if full else f"{layout_words(plan)} after {self.completed} iterations"
        if in_place:
            self._grow_in_place(plan, physical, "grow back (in place)")
        else:
            self.rejoins.drop_for_growth()
            self.job.abort(self.gen.number)
            self._kill_and_wait(sorted(self.alive - self.dead))
            gone = {self.physical[r] for r in self.dead if r in self.physical}  # (lost since: not spare)
            self.dead.clear()
            self._relabel(physical, lost=gone)
            self._announce(plan, restore=str(found.path), reason="grow back")
            self._start_workers(self.gen.members)
        rec.to_generation, rec.t_plan, rec.t_announce = self.gen.number, now, self._now()
        rec.predicted_after_us = plan.metrics.iteration_time
        self.phase = Phase.RECOVERING


    def _growth_price(self, plan: Plan, physical: dict[int, int], keep) -> Option:
        """What growing onto `plan` (its rank -> GPU: `physical`) costs (`growth_option`): in place
        when it runs one GPU of each group of `keep`, else by restarting every process from the
        checkpoint just completed."""
        running = {r: self.physical[r] for r in self.gen.members if r not in self.dead and r in self.alive}
        return growth_option(self.recovery.costs, self.recovery.initial_plan.spec, self.plan, running, plan,
                             physical, in_place=covers(physical.values(), keep))

    def _grow_keep(self) -> list[list[int]]:
        """The GPUs (named as the job named them) that hold each stage of the running plan: its
        running members. A growth in place must keep one of each in the new layout."""
        spec = self.plan.spec
        running = [r for r in self.gen.members if r not in self.dead and r in self.alive]
        return [[self.physical[r] for r in running if spec.gpus[r].pp == s] for s in range(spec.pp)]


def _priced(option: Option) -> dict:
    """An option's numbers as a logged decision records them."""
    return {"method": option.method, "iteration_s": option.iteration_s, "transition_s": round(option.transition_s, 4),
            "moved_bytes": option.moved_bytes, "detail": option.detail}
