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
same code re-shards it. A failure during the move leaves no whole state: the
generation that follows restores the latest checkpoint (`Transitions.
_unfinished_restore`). This module is the supervisor's part (`Relayout`, a
mixin of `schedc.live.supervisor.Supervisor`).
"""

from __future__ import annotations

from typing import Sequence

from schedc.diagnostics import RunError
from schedc.live.protocol import Phase


class Relayout:
    """The in-place re-partition of a `Supervisor` (see the module docstring)."""

    def _move_first(self, rec, failed: Sequence[int]) -> bool:
        """Whether the survivors were told to re-partition in place (and the decision made)."""
        held = self._lost_held()
        if not held or not self.recovery.repartitions(self.plan, self.dead):
            return False
        try:
            change = self.recovery.decide(self.plan, failed, self.dead, in_place=True)
        except RunError as exc:
            self._fail(list(exc.diagnostics))
            return True
        spec = change.plan.spec
        renamed = {r: d * spec.pp + s for d, row in enumerate(change.ranks) for s, r in enumerate(row)
                   if r is not None}
        old = self.gen.manifest
        moved = {"pp": old["pp"], "stage": {renamed[r]: self.plan.spec.gpus[r].pp for r in renamed}}
        # Processes without a place in the new layout end first: a GPU being taken back (it
        # counts as lost, as in a restart), one on standby, a survivor the layout leaves spare.
        pending = self.rejoins.drop_all("the job re-partitioned first: it counts as lost; ask for it "
                                        "again to grow the job back")
        self._kill_and_wait(sorted(((self.alive - self.dead) | set(pending)) & (self.alive - set(renamed))))
        self.dead.update(pending)  # (the lost ones were fenced already: no wait for exits a gone host never sends)
        gone = {self.physical[r] for r in self.dead if r in self.physical}
        physical = {renamed[r]: self.physical[r] for r in renamed}
        self._rename(renamed)
        self._relabel(physical, lost=gone)
        self.repartitioned = (f"{len(physical)} GPUs as {spec.dp} x {spec.pp} after {self.completed} "
                              "iterations")
        self.checkpoints.stages = spec.pp
        rec.method = "repartition"
        rec.events += list(change.events)
        rec.t_plan = self._now()
        self._announce(change.plan, restore=None, moved=moved,
                       reason="; ".join(change.events) + " (the survivors move the layers in place)")
        rec.to_generation = self.gen.number
        rec.t_announce = self._now()
        self.phase = Phase.RECOVERING
        return True

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
        self.shadows_held = {renamed[r] for r in self.shadows_held if r in renamed}
        self._error_exits = {renamed[r]: t for r, t in self._error_exits.items() if r in renamed}
        self.dead.clear()

    def _current_rank(self, rank: int, epoch: int) -> int | None:
        """What rank `rank` of epoch `epoch` is now (None: that process has no place since)."""
        for e in range(epoch + 1, self.epoch + 1):
            if rank not in self._renames[e]:
                return None
            rank = self._renames[e][rank]
        return rank
