"""In-place re-partitions: the survivors keep their processes and move layers among themselves.

When a stage is lost on every GPU and the recovery policy lays the survivors
out anew (`--recovery repartition`, or `auto` once the lost GPUs' host is
gone), and with `--shadow` the survivors hold every stage (their own, or a
valid shadow of a lost one), nothing needs a checkpoint or a new process:

1. the supervisor numbers the survivors as the new layout's ranks: a new
   *epoch* (`JobStore.put_rename`: the rank each survivor has now). Agents
   rename the processes they watch, and heartbeats and catch-up roles are
   keyed by epoch, so a rank number of the new layout never meets the same
   number of the old one. Processes outside the new layout (on standby,
   catching up, or left spare by it) are ended first;
2. it announces the new plan as a generation whose `moved` says the old
   layout (its stage count and each member's stage in it);
3. each member builds its new stage (and new shadow), agrees with the others
   on the step count (a lost stage's shadows may hold one step fewer: the
   others go back one, as in a dump), and the members tell each other which
   old stages they hold exactly at that count; every member then receives
   the old stages it needs from one holder each, point to point over the
   generation's gloo group (`schedc.live.move`), and re-shards them onto its
   new layers as a checkpoint would be (`schedc.live.reshard.assemble`).

Exact: the moved state is the survivors' own, at one step count, and the
same code re-shards it. A failure during the move: each member still holds what
it ran before (until the move's first iteration is done), so while the
survivors hold every old stage the generation that follows moves the layers
again from there; else it restores the latest checkpoint (`Transitions.
_unfinished`). This module is the supervisor's part (`Relayout`, a
mixin of `schedc.live.supervisor.Supervisor`), with the other way the survivors' state outlives
a new layout: the *dump* generation, which writes it to disk when every process is to restart
anyway (`_dump_first`, `_after_dump`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from schedc.diagnostics import RunError
from schedc.live.membership import Generation
from schedc.live.protocol import Phase
from schedc.live.layouts import layout_words
from schedc.live.result import GenerationRecord


class Relayout:
    """The in-place re-partition of a `Supervisor` (see the module docstring)."""

    def _move_first(self, rec, failed: Sequence[int]) -> bool:
        """Whether the survivors were told to re-partition in place (and the decision made): they
        move the layers among themselves when they hold every stage (a lost one in its shadows),
        else restore the latest checkpoint in their own processes, re-sharded."""
        if not self.recovery.repartitions(self.plan, self.dead):
            return False
        held = self._lost_held()
        if held and self.gen.dump and self.generation_records[-1].t_ready is not None:
            held = None  # (the survivors just saved what they hold: they restore it in place, free of holders)
        spec = self.plan.spec
        survivors = sorted(g.rank for g in spec.gpus if g.live and g.rank not in self.dead)
        # Who holds each stage of the running plan: its survivors, or (lost) its shadows' holders.
        # A move's layout must run one of each, or the state of a stage would be left behind.
        keep = ([held.get(s) or [g.rank for g in spec.gpus if g.pp == s and g.rank in survivors]
                 for s in range(spec.pp)] if held else [])
        try:
            change = self.recovery.decide(self.plan, failed, self.dead, in_place="move" if held else "restore",
                                          keep=keep)
        except RunError as exc:
            if not held:
                self._fail(list(exc.diagnostics))
                return True
            # No layout that runs a holder of every stage (of the survivors, and of the job's spare
            # GPUs) fits or could be planned: the survivors save what they hold, then restore it in
            # place, free of the holders (`_after_dump`); with nothing trained since the latest
            # checkpoint, they restore that at once.
            self._note("warning", "warning: no layout that keeps a holder of every stage could be laid out and "
                                  "planned: the survivors restore in place instead (after saving what they hold, "
                                  "if they trained past the latest checkpoint)")
            if self._dump_first():
                return True
            held, keep = None, []
            try:
                change = self.recovery.decide(self.plan, failed, self.dead, in_place="restore")
            except RunError as again:
                self._fail(list(again.diagnostics))
                return True
        spec = change.plan.spec
        if change.physical is not None:  # (also on spare GPUs of the job: fresh processes start there)
            by_gpu = {self.physical[r]: r for r in survivors}
            renamed = {by_gpu[p]: r for r, p in change.physical if p in by_gpu}
            started = sorted(r for r, p in change.physical if p not in by_gpu)
        else:
            renamed = {r: d * spec.pp + s for d, row in enumerate(change.ranks) for s, r in enumerate(row)
                       if r is not None}
            started = []
        moved = self._moved(renamed) if held else None
        # Processes without a place in the new layout end first: a GPU being taken back (it
        # counts as lost, as in a restart), one on standby, a survivor the layout leaves spare.
        pending = self.rejoins.drop_all("the job re-partitioned first: it counts as lost; ask for it "
                                        "again to grow the job back")
        self._kill_and_wait(sorted(((self.alive - self.dead) | set(pending)) & (self.alive - set(renamed))))
        self.dead.update(pending)  # (the lost ones were fenced already: no wait for exits a gone host never sends)
        gone = {self.physical[r] for r in self.dead if r in self.physical}
        physical = (dict(change.physical) if change.physical is not None else
                    {renamed[r]: self.physical[r] for r in renamed})
        self._rename(renamed)
        self._relabel(physical, lost=gone)
        self.repartitioned = (f"{layout_words(change.plan)} after {self.completed} "
                              "iterations")
        self.checkpoints.relayout(spec.pp, self.gen.number + 1)
        rec.method = "repartition"
        rec.events += list(change.events)
        rec.t_plan = self._now()
        self._announce(change.plan, restore=change.restore, moved=moved,
                       reason="; ".join(change.events) + (" (the survivors move the layers in place)" if held else
                                                          " (the survivors restore in place)"))
        rec.to_generation = self.gen.number
        rec.t_announce = self._now()
        self._start_workers(started)
        self.phase = Phase.RECOVERING
        return True

    def _grow_in_place(self, plan, physical: dict[int, int], reason: str) -> None:
        """Grow onto `plan` (its rank -> the GPU it runs on: `physical`) keeping the running
        processes: they are renamed as its ranks (a new epoch), processes start for the GPUs back
        (and spare ones), and the members move the layers among themselves (the new processes take
        all of theirs), as an in-place re-partition does. Called at a complete checkpoint: a
        failure during the move moves again, or restores it (`_unfinished`)."""
        by_gpu = {self.physical[r]: r for r in self.gen.members if r not in self.dead and r in self.alive}
        renamed = {by_gpu[p]: r for r, p in physical.items() if p in by_gpu}
        started = sorted(r for r, p in physical.items() if p not in by_gpu)
        moved = self._moved(renamed)
        self.rejoins.drop_for_growth()
        self.job.abort(self.gen.number)
        self._kill_and_wait(sorted((self.alive - self.dead) - set(renamed)))  # (on standby: no place)
        gone = {self.physical[r] for r in self.dead if r in self.physical}  # (lost since: not spare)
        self._rename(renamed)
        self._relabel(physical, lost=gone)
        self._announce(plan, restore=None, moved=moved, reason=reason)
        self._start_workers(started)

    def _moved(self, renamed: dict[int, int]) -> dict:
        """A move's `Generation.moved`: the running layout's stage count, each renamed process's
        stage in it (by its new rank), the model's split over those stages, and the processes
        (by their new rank) holding an exact shadow of the stage before theirs."""
        old = self.gen.manifest
        return {"pp": old["pp"], "stage": {renamed[r]: self.plan.spec.gpus[r].pp for r in renamed},
                "partition": old.get("partition"),
                "shadows": sorted(renamed[r] for r in self.shadows_held if r in renamed)}

    def _rename(self, renamed: dict[int, int]) -> None:
        """A new epoch: the survivors' processes are the new layout's ranks `renamed[r]`."""
        self.epoch += 1
        self._renames[self.epoch] = dict(renamed)
        self.job.put_rename(self.epoch, renamed)
        self.job.epoch = self.epoch
        self.fleet.rename(self.epoch, renamed)
        for r in list(self.detector.watching()):
            self.detector.forget(r)
        self.alive = {renamed[r] for r in self.alive if r in renamed}
        self._started_by = {renamed[r]: a for r, a in self._started_by.items() if r in renamed}
        self.shadows_held = {renamed[r] for r in self.shadows_held if r in renamed}
        self._error_exits = {renamed[r]: t for r, t in self._error_exits.items() if r in renamed}
        # A member of the new layout found failed since the decision (its exit came in while the
        # processes without a place ended) is the new layout's failure, under its new number; one
        # without a place is not the run's any more.
        self._suspects = {renamed[r]: dataclasses.replace(s, rank=renamed[r]) for r, s in self._suspects.items()
                          if r in renamed}
        self.dead.clear()

    def _current_rank(self, rank: int, epoch: int) -> int | None:
        """What rank `rank` of epoch `epoch` is now (None: that process has no place since)."""
        for e in range(epoch + 1, self.epoch + 1):
            if rank not in self._renames[e]:
                return None
            rank = self._renames[e][rank]
        return rank

    # -- shadows (--shadow): save what the survivors hold before every process restarts ------------

    def _dump_first(self) -> bool:
        """Whether a dump generation was announced before choosing how to go on (`schedc.live.shadow`).

        With --shadow, when every process is about to restart from a checkpoint (a stage lost on
        every GPU, or `--recovery restart`), the survivors first save what they hold as a newer
        checkpoint, if they hold every stage (their own, or a valid shadow of it on the next
        stage) and have trained past the latest checkpoint. Once that generation is ready, the
        choice is made (`_after_dump`): the checkpoint it restores is then the one just saved."""
        held_by = self._lost_held()
        if held_by is None:
            return False
        if self.options.recovery != "restart" and not held_by:
            return False  # every stage has a live GPU: the survivors go on without a restart
        lost = sorted(held_by)
        spec = self.plan.spec
        live = [g for g in spec.gpus if g.live and g.rank not in self.dead]
        found = self.checkpoints.latest_own()
        if found is not None and found.iteration >= self.completed:
            return False  # nothing trained since the latest checkpoint
        number = self.gen.number + 1
        members = tuple(sorted(g.rank for g in live))
        reason = "the survivors save their state and the shadows of stage(s) " + ", ".join(map(str, lost))
        gen = Generation(number, members, dict(self.gen.manifest, programs={}), restore=None,
                         injections=tuple(self.injections.armed()), reason=reason, dump=True)
        now = self._publish(gen, {})
        self._gen_speeds[number] = {}
        self.generation_records.append(GenerationRecord(number, list(members), reason, None,
                                                        self.plan.metrics.iteration_time, None, round(now, 4),
                                                        shadow=True))
        self.phase = Phase.RECOVERING
        where = "; ".join(f"stage {s} from its shadow on rank(s) {held_by[s]}" for s in lost)
        self._note("shadow", f"generation {number}: the {len(members)} survivors save the state they hold"
                             + (f" ({where})" if lost else "") + ", to restart from it", generation=number,
                   stages=lost, holders=held_by)
        return True

    def _lost_held(self) -> dict[int, list[int]] | None:
        """--shadow: each stage of the running plan with no live GPU -> the survivors holding a
        valid shadow of it (empty: no stage is lost); None when the survivors do not hold every
        stage, or their states may differ (a restore or a move not done everywhere)."""
        if not self.options.shadow or self.gen is None or self._dump_refused:
            return None
        if (self.gen.restore is not None or self.gen.moved is not None) and self.generation_records[-1].t_ready is None:
            return None  # a restore (or a move) not yet done everywhere: its members' states differ
        spec = self.plan.spec
        live = [g for g in spec.gpus if g.live and g.rank not in self.dead]
        if spec.pp < 2 or not live:
            return None
        held_by = {}
        for s in range(spec.pp):
            if any(g.pp == s for g in live):
                continue
            holders = sorted(g.rank for g in live if g.pp == (s + 1) % spec.pp and g.rank in self.shadows_held)
            if not holders:
                return None
            held_by[s] = holders
        return held_by

    def _after_dump(self, now: float) -> None:
        """The dump generation is ready: its members agreed on a step count and wrote what they hold.
        Choose again: the latest checkpoint is now the state they saved (or, if a stage could not be
        written after all, the one before)."""
        start = min(r.start for r in self._ready.values())
        for record in self.ledger.commit_before(start, lambda g: self._gen_speeds.get(g, {})):
            self._iteration_done(record, now)
        self.checkpoints.resumed(self.gen.number, start)
        self.shadows_held = {r for r, m in self._ready.items() if m.shadow}
        self.generation_records[-1].t_ready = now
        self._late = 0
        found = self.checkpoints.latest_own()
        if found is not None and found.iteration == start:
            self._note("shadow", f"generation {self.gen.number}: saved the state after {start} steps ({found.path.name}): "
                                 "nothing trained since the last checkpoint is lost", generation=self.gen.number,
                       iteration=start, path=str(found.path))
        else:
            self._dump_refused = True  # (this recovery restores without another dump: it would fail alike)
            self._note("warning", f"warning: generation {self.gen.number} could not save every stage after {start} "
                                  "steps: restoring the latest complete checkpoint instead")
        suspects, self._silent_after_dump = self._silent_after_dump, {}
        self._decide(self._recovery, self._failed_since_plan(), suspects)
