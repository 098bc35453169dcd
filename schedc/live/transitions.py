"""How a live run changes generation: the second half of `schedc.live.supervisor.Supervisor`.

`Supervisor` (the loop over typed messages) inherits these from `Transitions`,
which holds no state of its own: announcing a generation (its programs
rendered once, shipped and written), a generation becoming ready (committed
iterations, the policies told, the milestones noted), planned switches (what
the fail-slow and rejoin policies ask for), and recoveries (what the recovery
policy decides, carried out). They are kept apart from the loop so that each
file reads as one thing; the state they use is the supervisor's (its
`__init__` lists it).
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Sequence

from schedc.diagnostics import RunError, error
from schedc.live.detect import Beat
from schedc.live.hosts import TICK
from schedc.live.membership import Generation
from schedc.live.protocol import Phase
from schedc.live.layouts import layout_words
from schedc.live.recovery import Change, describe, failure_events, replan_solver, restored_name, resume_hint
from schedc.printer import human_bytes
from schedc.live.result import GenerationRecord, Recovery, Switch
from schedc.plan import Plan
from schedc.runtime.manifest import MANIFEST_NAME
from schedc.schedule import status_text
from schedc.solvers.sandbox import failure_of
from schedc.spec import Failure

#: Seconds to gather failures that come together (a node's GPUs die within milliseconds).
SETTLE = 0.02
#: A planned switch starts this many iterations after the furthest rank's current one.
SWITCH_MARGIN = 2


class Transitions:
    """Generation changes of a `Supervisor` (see the module docstring)."""

    # -- a generation is announced, and becomes ready ---------------------------------------------

    def _relabel(self, physical: dict[int, int], *, lost: set[int] = frozenset()) -> None:
        """The next plan's rank -> the GPU it runs on (the job's own rank at its start), after a
        re-partition or a growth: the GPUs of the job outside it are lost (`lost`, and those lost
        before that are not back) or spare (healthy, unused: the next growth may use them)."""
        initial = {g.rank for g in self.recovery.initial_plan.spec.gpus if g.live}
        outside = initial - set(physical.values())
        self.lost_to_repartition = ((self.lost_to_repartition - self._returned) | set(lost)) & outside
        self.spare = outside - self.lost_to_repartition
        self._returned = set()
        self.physical = physical
        self.slowness.relabelled()  # (what it learned per rank is another GPU's now)
        self.fleet.place(physical)
        self.injections.place(physical)  # (a GPU or node an injection names: the ranks that run it now)

    def _announce(self, plan: Plan, *, restore: str | None, reason: str, start_at: int | None = None,
                  moved: dict | None = None) -> None:
        """Publish the next generation: `plan`'s programs, rendered once (the same files are
        shipped to the workers and written to ``OUT/live/gen-N``), its members, what to restore."""
        number = 0 if self.gen is None else self.gen.number + 1
        plan_dir = None if number == 0 else self.out / "live" / f"gen-{number:04d}"
        files = plan.programs(str(plan_dir or self.out))
        members = tuple(g.rank for g in plan.spec.gpus if g.live)
        armed = self.injections.armed()
        speeds = {g.rank: g.speed for g in plan.spec.gpus if g.live and g.speed < 1.0}
        shadow = self._shadows_fit(number, plan)
        manifest = json.loads(files[MANIFEST_NAME])
        job = self.recovery.initial_plan.spec
        if plan.spec.microbatches != job.microbatches:  # another number of pipelines: the same global batch
            manifest["data_microbatches"] = job.microbatches
            files = {**files, MANIFEST_NAME: json.dumps(manifest, indent=2) + "\n"}
        gen = Generation(number, members, manifest, restore=restore, injections=tuple(armed),
                         reason=reason, start_at=start_at, speeds=speeds,
                         physical={r: p for r, p in self.physical.items() if r != p} or None,
                         coords={g.rank: (g.dp, g.pp) for g in plan.spec.gpus} if self.repartitioned else None,
                         shadow=shadow, epoch=self.epoch, moved=moved)
        now = self._publish(gen, files)
        self.plan = plan
        for r in members:
            if r not in self.detector.watching():
                self.detector.watch(r, now)
        leaving = self.detector.watching() - set(members)
        if start_at is None:
            self._leaving = set()
            for r in leaving:
                self.detector.forget(r)  # excluded (on standby) or gone: no longer a member to watch
        else:  # they run the old plan until `start_at`: still watched (an exit is a failure) until then
            self._leaving = leaving
        self._gen_speeds[number] = {g.rank: g.speed for g in plan.spec.gpus if g.live}
        self.generation_records.append(GenerationRecord(number, list(members), reason, restore,
                                                        plan.metrics.iteration_time,
                                                        None if plan_dir is None else str(plan_dir), round(now, 4),
                                                        shadow=shadow if self.options.shadow else None))
        if number > 0:
            self._pending_write = (number, plan, files)

    def _shadows_fit(self, number: int, plan: Plan) -> bool:
        """--shadow: whether generation `number`'s plan has the memory to keep shadows (its
        re-routed or re-partitioned GPUs may not: `schedc.live.shadow.room_problem`); a change is said."""
        if not self.options.shadow:
            return True
        from schedc.live.shadow import room_problem

        problem = room_problem(plan)
        if (problem is None) != self.shadows_on:
            self.shadows_on = problem is None
            if problem is None:
                self._note("shadow", f"generation {number}: its plan has room for shadows again: the processes that "
                                     "start on it keep one (those that dropped theirs hold none until they restart)",
                           generation=number)
            else:
                self._note("shadow", f"generation {number}: no room for shadows in its plan ({problem[0]}): every "
                                     "worker drops its shadow, and a stage lost on every GPU restores the latest "
                                     "checkpoint until they restart on a plan with room", generation=number)
        return self.shadows_on

    def _publish(self, gen: Generation, files: dict[str, str]) -> float:
        """Announce `gen` and start waiting for its members (nobody ready yet); the time now."""
        self.job.announce(gen, files)
        self.checkpoints.announced(gen.number, gen.restore)  # (kept as it is until the generation is ready)
        self.gen = gen
        self._ready, self._done = {}, set()
        self._unexplained = None
        now = self._now()
        self._announced_at, self._up_at, self._old_done_at, self._wait_noted = now, None, None, False
        return now

    def _write_generation(self, number: int, plan: Plan, files: dict[str, str]) -> None:
        """The generation's plan beside the compiled one, as `schedc compile -o` writes it (for the record)."""
        try:
            plan.write(self.out / "live" / f"gen-{number:04d}", programs=files)
        except (OSError, RunError) as exc:  # (a read-only OUT: the record is lost, never the run)
            why = exc.diagnostics[0].message if isinstance(exc, RunError) else str(exc)
            self._note("warning", f"warning: could not write the plan of generation {number} (for the record): {why}")

    def _generation_ready(self, now: float) -> None:
        if self.gen.dump:
            self._after_dump(now)
            return
        start = min(r.start for r in self._ready.values())
        undone = sum(1 for r in self._ready.values() if r.undone)
        # Every iteration before `start` is committed: every survivor applied its step.
        for record in self.ledger.commit_before(start, lambda g: self._gen_speeds.get(g, {})):
            self._iteration_done(record, now)
        self.checkpoints.resumed(self.gen.number, start)  # checkpoint files of undone steps are written again
        self.generation_records[-1].t_ready = now
        self.shadows_held = {r for r, m in self._ready.items() if m.shadow}
        self._dump_refused = False
        first = self._training_started is None
        changed = self.phase in (Phase.RECOVERING, Phase.SWITCHING)
        self.phase = Phase.RUNNING
        self.base_plan = self.plan
        for r in self._leaving - set(self.gen.members):
            self.detector.forget(r)  # left at the switch: on standby now
        self._leaving = set()
        self.detector.restart_progress(now)
        self._unexplained = None
        self._late = 0
        for rank in self.rejoins.wanted.keys() & set(self.gen.members):
            self.slowness.joined(rank)
        self.rejoins.joined(self.gen.members)
        sw = self._switch_rec
        if sw is not None and sw.to_generation == self.gen.number:
            sw.t_ready = now
            self._note("switched", f"generation {self.gen.number} ({sw.kind}): {len(self.gen.members)} ranks "
                                   f"switched at iteration {start}, {now - sw.t_announce:.2f} s after the "
                                   "announcement", generation=self.gen.number, switch=sw.kind)
        self.rejoins.resume()
        if changed:
            self.slowness.after_plan_change()
        if first:
            self._training_started = now
            self._note_slowdowns(start)
            self._note("running", f"generation {self.gen.number}: {len(self.gen.members)} ranks running from "
                                  f"iteration {start}; store {self.job.host}:{self.job.port}",
                       generation=self.gen.number, start=start, store=f"{self.job.host}:{self.job.port}")
            return
        rec = self._recovery
        if rec is not None:
            rec.t_ready, rec.resumed_at, rec.undone = now, start, undone
            back = f"rolled back to iteration {start}" + (f" ({undone} rank(s) undid their last step)"
                                                           if undone else "")
            if self.gen.restore:
                back = f"restored {restored_name(self.gen.restore)}, iteration {start}"
            if self.gen.moved is not None:
                moved = [r.moved for r in self._ready.values()]
                rec.moved_bytes, rec.moved_max_bytes = sum(moved), max(moved)
                back += (f"; moved {human_bytes(sum(moved))} of layers in place (at most {human_bytes(max(moved))} "
                         "to one rank)")
            t0 = rec.t_fault if rec.t_fault is not None else rec.t_detect
            self._note("reconfigured", f"generation {self.gen.number}: {len(self.gen.members)} ranks reconfigured "
                                       f"{now - t0:.2f} s after the {rec.start_word}; {back}",
                       generation=self.gen.number, start=start, undone=undone)

    # -- planned changes (the policies' switches) ----------------------------------------------------

    def _replan(self, base: Plan, events: Sequence[Failure], solver: str | None = None) -> Plan:
        from schedc.replan import replan

        solver = solver or replan_solver(base.spec)
        plan = replan(base, list(events), deadline=self.options.replan_deadline, solver=solver)
        failed = failure_of(plan.schedule.solver.detail)
        if failed:  # contained (solvers/sandbox.py): the run goes on with the plan found before the search
            self._note("warning", f"warning: {failed}; the new plan is the one found before its search (verified)")
        return plan

    def _switch(self, plan: Plan, *, kind: str, reason: str, ranks: Sequence[int]) -> str | None:
        """Announce a planned switch to `plan` a little ahead; None, or why it was not made."""
        if self.phase != Phase.RUNNING:
            return f"the run is {self.phase}"
        # Where the members are now (read after the planning that led here, which took time).
        fresh = self.job.heartbeats(self.gen.members)
        beats = [Beat.parse(fresh[r]) if r in fresh else self.detector.last_beat(r) for r in self.gen.members]
        furthest = max([b.iteration for b in beats if b is not None] + [self.ledger.now])
        start_at = furthest + self._switch_margin()
        if start_at >= self.iterations:
            return f"the run ends (after iteration {self.iterations - 1}) before iteration {start_at}"
        old = self.gen.number
        before = self.plan.metrics.iteration_time
        t_decide = self._now()
        self._switch_from = self.gen.members
        self._announce(plan, restore=None, reason=f"{kind}: {reason}", start_at=start_at)
        rec = Switch(kind=kind, reason=reason, ranks=list(ranks), from_generation=old,
                     to_generation=self.gen.number, start_at=start_at, t_decide=t_decide, t_announce=self._now(),
                     predicted_before_us=before, predicted_after_us=plan.metrics.iteration_time)
        if kind == "rejoin":
            rec.catch_up_s, rec.catch_up_bytes = self.rejoins.catch_up_figures(ranks)
        self.switches.append(rec)
        self._switch_rec = rec
        self.phase = Phase.SWITCHING
        # The old generation should reach the switch within four times its pace, plus the stall
        # rule's bound; past that, the switch's deadline runs even if nothing was seen to stall.
        self._old_due = self._now() + (start_at - self.ledger.now) * 4 * self._period() + self.detector.stall_timeout
        self._note("switch", f"switch to generation {self.gen.number} at iteration {start_at} ({kind}): "
                             f"{before / 1e3:.2f} -> {plan.metrics.iteration_time / 1e3:.2f} ms per iteration",
                   switch=kind, start_at=start_at, generation=self.gen.number)
        return None

    def _switch_margin(self) -> int:
        """Iterations between announcing a planned switch and its start: SWITCH_MARGIN, plus what
        a heartbeat's staleness (the furthest rank may be further) spans at the measured pace, so
        that no member is past the start when it reads of the switch (at its next boundary)."""
        return SWITCH_MARGIN + min(50, math.ceil(self.options.heartbeat_interval / max(self._period(), 1e-3)))

    def _period(self) -> float:
        """Seconds per iteration lately (the median gap of the last iterations; the plan's before any)."""
        ends = [r.end for r in self.ledger.history[-6:]]
        gaps = [b - a for a, b in zip(ends, ends[1:]) if b > a]
        return statistics.median(gaps) if gaps else self.plan.metrics.iteration_time / 1e6

    # -- recovery -----------------------------------------------------------------------------------

    def _recover(self) -> None:
        # Failures that come together (a node) are planned together.
        settle = self._now() + SETTLE
        while self._now() < settle:
            self.fleet.step(TICK)
            now = self._now()
            for ev in self.job.events():
                self._dispatch(ev, now)
        suspects, self._suspects = self._suspects, {}
        failed = sorted(suspects)
        self._grow_since = self._now()  # (a growth waiting for its rent starts afresh, as after any event)
        for r in failed:
            self.detector.forget(r)
            self.rejoins.lost(r)  # a joiner that died is no longer wanted back (a new request can ask)
        self.dead.update(failed)
        self._fence([r for r, s in suspects.items() if s.fence])
        if self.phase == Phase.SWITCHING:  # the switch is off: plan from the last plan that ran
            self._note("switch", f"the switch to generation {self.gen.number} is abandoned: a failure came first")
            self.plan = self.base_plan
            self._switch_rec = None
        self.rejoins.cancel_all()
        old = self.gen
        self.job.abort(old.number)
        rec = self._recovery if (self._recovery and self._recovery.t_ready is None) else None
        if rec is None:  # (a failure during a recovery extends it)
            rec = Recovery(from_generation=old.number, t_detect=min(s.at for s in suspects.values()),
                           method=self.options.recovery,
                           t_last_complete=max((r.end for r in self.ledger.records.values()), default=None),
                           predicted_before_us=self.plan.metrics.iteration_time)
            self.recoveries.append(rec)
            self._recovery = rec
        rec.failed = sorted(set(rec.failed) | set(failed))
        rec.causes.update({str(r): s.cause for r, s in suspects.items()})
        fault = self.injections.fault_time(failed)
        if fault is not None and rec.t_fault is None:
            rec.t_fault = fault - self.t0
        # Every rank of the running plan lost since it was announced, not only these: a recovery
        # that had not yet planned around the earlier ones (a dump generation) must now.
        self._decide(rec, self._failed_since_plan(), suspects)

    def _decide(self, rec: Recovery, failed: Sequence[int], suspects: dict) -> None:
        """Choose and announce how to go on after `failed` failed (of `self.plan`), then take back once a GPU
        of `suspects` declared failed by its silence. A recovery that re-partitioned, then re-routed: re-partitioned."""
        gpu_of = dict(self.physical)  # (the ranks of the plan that failed -> the job's GPUs)
        if self._move_first(rec, failed) or self._dump_first():
            if self.gen.dump and self.generation_records[-1].t_ready is None:
                self._silent_after_dump = dict(suspects)  # (the survivors save first: decided after that)
            elif self._failure is None:
                self._take_back_maybe_healthy(suspects, gpu_of, "repartition")  # (re-partitioned in place)
            return
        if not failed:  # only GPUs coming back died (a switch was abandoned): the plan that ran goes on
            self._note("retry", f"the plan that ran goes on as generation {self.gen.number + 1}: no GPU of it failed")
            rec.method, rec.t_plan = "retry", self._now()
            restore, moved = self._unfinished()
            self._announce(self.plan, restore=restore, moved=moved, reason="retry: only a GPU coming back failed")
            rec.to_generation, rec.t_announce = self.gen.number, self._now()
            self.phase = Phase.RECOVERING
            return self._take_back_maybe_healthy(suspects, gpu_of, "retry")
        try:
            change = self.recovery.decide(self.plan, failed, self.dead)
        except RunError as exc:
            if self.options.recovery != "restart":
                rec.events += describe(failure_events(self.plan.spec, failed))
            self._fail(list(exc.diagnostics))
            return
        old = self.gen
        if change.restart_all:
            self._stop_survivors()
        rec.method = "repartition" if rec.method == "repartition" and rec.to_generation is not None else change.method
        rec.events += list(change.events)
        rec.t_plan = self._now()
        if change.restart_all:
            if change.method == "repartition":
                # A GPU still being taken back (catching up on standby) has no place in the new
                # layout, whose ranks are numbered anew: it counts as lost, and asked for again,
                # grows the job back like the others.
                pending = self.rejoins.drop_all("the job re-partitioned first: it counts as lost; ask for it "
                                                "again to grow the job back")
                self._kill_and_wait(sorted(set(pending) & self.alive))
                self.dead.update(pending)
                spec = change.plan.spec
                gone = {self.physical[r] for r in self.dead if r in self.physical}
                self._relabel(dict(change.physical) if change.physical is not None else
                              {d * spec.pp + s: self.physical[r] for d, row in enumerate(change.ranks)
                               for s, r in enumerate(row) if r is not None}, lost=gone)
                self.repartitioned = (f"{layout_words(change.plan)} after "
                                      f"{self.completed} iterations")
            self.dead.clear()
            if change.plan.spec.pp != self.checkpoints.stages or self.repartitioned:  # (a re-partitioned plan)
                self.checkpoints.relayout(change.plan.spec.pp, self.gen.number + 1)
            if change.method != "repartition":  # (the policy said what it re-partitioned)
                self._note("restart", f"restarting every process from {restored_name(change.restore)} with the "
                                      "failed GPU(s) replaced", restore=change.restore)
        else:
            self._note_replan(rec, change, old.number)
        restore, moved = (change.restore, None) if change.restore else self._unfinished()
        self.dead.difference_update(change.replacements)
        self._announce(change.plan, restore=restore, moved=moved, reason="; ".join(change.events))
        rec.to_generation = self.gen.number
        rec.t_announce = self._now()
        if change.restart_all:
            self._start_workers(self.gen.members)
        elif change.replacements:
            self._start_workers(change.replacements)
        self.phase = Phase.RECOVERING
        self._take_back_maybe_healthy(suspects, gpu_of, change.method)

    def _take_back_maybe_healthy(self, suspects: dict, gpu_of: dict[int, int], method: str) -> None:
        """Each of `suspects` whose GPU may be healthy (declared failed by its silence, what load
        looks like too; or out of reach when its host's agent was replaced) gets one more chance:
        after a re-partition by growing onto its GPU (`gpu_of`: the failed plan's ranks -> the
        job's GPUs), else by a fresh process through the rejoin path."""
        for r, s in sorted(suspects.items()):
            why = s.maybe_healthy
            if why and method == "repartition":
                # (the ranks are the new layout's now: the GPU, named as the job named it, is taken
                # back by growing onto it, once, like any GPU the job lost)
                gpu = gpu_of.get(r)
                if gpu is not None and ("gpu", gpu) not in self._taken_back:
                    self._taken_back.add(("gpu", gpu))
                    self._user_rejoin(gpu, f"{why}; the GPU may be healthy")
                continue
            if why and r not in self.gen.members and r not in self._taken_back:
                # It gets one fresh process through the rejoin path (catch-up, then a switch); lost
                # again, it stays out.
                self._taken_back.add(r)
                self.rejoins.request(r, f"{why}; the GPU may be healthy: one fresh process takes it back")

    def _failed_since_plan(self) -> list[int]:
        """The ranks of the running plan lost since it was announced (what the next plan routes around)."""
        return [g.rank for g in self.plan.spec.gpus if g.live and g.rank in self.dead]

    def _note_replan(self, rec: Recovery, change: Change, old: int) -> None:
        plan, s = change.plan, change.plan.schedule.solver
        rec.solver = {"name": s.name, "status": s.status, "wall_s": round(s.wall_s, 4), "stopped_by": s.stopped_by}
        rec.predicted_after_us = plan.metrics.iteration_time
        events = [e for e in change.events if not e.startswith("recover ")]
        self._note("replan", f"replan: {'; '.join(events)} -> generation {old + 1}, "
                             f"{len([g for g in plan.spec.gpus if g.live])} ranks, "
                             f"{plan.metrics.iteration_time / 1e3:.2f} ms per iteration "
                             f"(was {self.plan.metrics.iteration_time / 1e3:.2f}); {s.name} {status_text(s.status)} in "
                             f"{s.wall_s:.3f} s" + (" (the deadline ended its search)" if s.stopped_by == "deadline"
                                                    else ""),
                   events=events, solver=rec.solver, predicted_us=plan.metrics.iteration_time)

    def _unfinished(self) -> tuple[str | None, dict | None]:
        """(restore, move) of the generation that replaces the newest one if that never became
        ready: its restore again, since some members may not have loaded it yet (a replacement
        process that never restored holds the initial weights, not the survivors' state); or its
        move again, from the same old layout, while the survivors still hold every old stage (a
        member keeps what it ran before a move until the move's first iteration is done:
        `schedc.live.member`); else, with layers moved only partly, the latest checkpoint. Called
        before the next generation is announced."""
        if self.gen is None or self.generation_records[-1].t_ready is not None:
            return None, None
        if self.gen.moved is None:
            return self.gen.restore, None
        again = self._move_again(self.gen.moved)
        if again is not None:
            self._note("repartition", f"generation {self.gen.number}'s move did not finish: the survivors still hold "
                                      "every stage of the layout before it, so the next generation moves the layers "
                                      "again from there (nothing restored)", generation=self.gen.number)
            return None, again
        found = self.checkpoints.latest_own()
        return (str(found.path) if found else "initial"), None

    def _move_again(self, moved: dict) -> dict | None:
        """`moved` for the members still alive, marked as a retry, if they hold every old stage
        (their own, or a shadow of it on the next stage that was exact when the move began)."""
        live = {r for r in self.gen.members if r not in self.dead and r in self.alive}
        stage = {int(r): int(t) for r, t in moved["stage"].items() if int(r) in live}
        shadows = {int(r) for r in moved.get("shadows", ()) if int(r) in live}
        pp = int(moved["pp"])
        for t in range(pp):
            if not any(s == t or (r in shadows and (s - 1) % pp == t) for r, s in stage.items()):
                return None
        return dict(moved, stage=stage, shadows=sorted(shadows), retry=True)

    def _stop_survivors(self) -> None:
        """recovery="restart": every survivor is killed before all restart (their exits are ours)."""
        self._kill_and_wait([r for r in self.gen.members if r not in self.dead])

    # -- deadlines: a transition that does not end is tried again, then restarted, then reported -----

    def _check_transition(self, now: float) -> None:
        """A generation being started, recovered or switched to must become ready within
        `transition_timeout` seconds, counted from when every member's process is up and has built
        its model (start-up itself is the detector's) and, for a planned switch, from when the old generation ended
        (until then it runs, and the stall rule watches it) or should have (`_old_due`: a
        backstop, should the old generation hang in a way no rule sees). Escalates when it does not."""
        if self.gen is None or self.phase not in (Phase.STARTING, Phase.RECOVERING, Phase.SWITCHING):
            return
        if self._up_at is None:
            beats = [self.detector.last_beat(r) for r in self.gen.members if r not in self.dead]
            if any(b is None for b in beats):
                return
            # A model being built is not a transition stuck; a build longer than the start-up
            # limit counts as one (the clock starts anyway).
            if any(b.state == "build" for b in beats) and now - self._announced_at < self.options.startup_timeout:
                return
            self._up_at = now
        begin = self._up_at
        if self.phase == Phase.SWITCHING:
            begin = max(begin, self._old_done_at if self._old_done_at is not None else self._old_due)
            if now < begin:
                return
        bound = self.options.transition_timeout
        late = sorted(set(self.gen.members) - set(self._ready) - self.dead)
        if not self._wait_noted and now - begin > bound / 2:
            self._wait_noted = True
            self._note("waiting", f"generation {self.gen.number}: waiting {now - begin:.1f} s for rank(s) {late} "
                                  f"to become ready (at most {bound:g} s, then it is tried again)",
                       generation=self.gen.number, ranks=late)
        if now - begin > bound:
            self._escalate(late, now)

    def _escalate(self, late: list[int], now: float) -> None:
        """The generation missed its deadline: the first time, try it again (a fresh generation,
        rolled back in memory; a planned switch is abandoned for the plan that ran); the second
        time in a row, restart every process from the latest checkpoint; then stop with E554."""
        gen, bound = self.gen, self.options.transition_timeout
        if gen.dump:  # the survivors did not save their state in time: restore the latest checkpoint
            self.job.abort(gen.number)
            self._note("deadline", f"generation {gen.number} did not save the survivors' state within {bound:g} s "
                                   f"(rank(s) {late} never reported): restoring the latest complete checkpoint "
                                   "instead", generation=gen.number, ranks=late)
            self._dump_refused = True
            self._decide(self._recovery, self._failed_since_plan(), {})
            return
        self._late += 1
        what = (f"generation {gen.number} did not become ready within {bound:g} s of its members running "
                f"(rank(s) {late} never reported ready)")
        rec = self._recovery if (self._recovery and self._recovery.t_ready is None) else None
        if rec is None and self._training_started is not None:
            rec = Recovery(from_generation=gen.number, t_detect=now, method="retry",
                           t_last_complete=max((r.end for r in self.ledger.records.values()), default=None),
                           predicted_before_us=self.base_plan.metrics.iteration_time)
            self.recoveries.append(rec)
            self._recovery = rec
        if rec is not None:
            rec.causes[f"generation {gen.number}"] = what
        if self.phase == Phase.SWITCHING:
            self._note("switch", f"the switch to generation {gen.number} is abandoned: it did not complete in time")
            self.plan = self.base_plan
            self._switch_rec = None
            self.rejoins.cancel_all()
        phase = Phase.STARTING if self._training_started is None else Phase.RECOVERING
        self.job.abort(gen.number)
        if self._late == 1:
            self._note("deadline", f"{what}: trying it again as generation {gen.number + 1}", generation=gen.number,
                       ranks=late)
            restore, moved = self._unfinished()
            self._announce(self.plan, restore=restore, moved=moved, reason=f"retry: {what}")
        elif self._late == 2 and self.recovery.restarts < self.options.max_restarts:
            self.recovery.restarts += 1
            found = self.checkpoints.latest_own()
            restore = str(found.path) if found else "initial"
            self._note("deadline", f"{what} again: restarting every process from {restored_name(restore)} "
                                   f"(restart {self.recovery.restarts} of {self.options.max_restarts})",
                       generation=gen.number, ranks=late, restore=restore)
            self.rejoins.cancel_all()
            self._kill_and_wait(sorted(self.alive - self.dead))
            self._announce(self.plan, restore=restore, reason=f"restart: {what}")
            self._start_workers(self.gen.members)
        else:
            self._fail([error("E554", f"the job is stuck: {what}, after it was tried again"
                                      + (" and every process restarted" if self._late > 2 else ""),
                              hint=resume_hint(self.out, self.checkpoints.latest_own(), self.iterations))])
            return
        if rec is not None:
            rec.to_generation = self.gen.number
            rec.t_announce = self._now()
        self.phase = phase

    def _retry(self) -> None:
        """Ranks lost a peer but no failure was detected: run the same plan again as a new generation."""
        self._unexplained = None
        self._retries += 1
        if self._retries > 3:
            self._fail([error("E554", "ranks keep losing their connections to live peers",
                              hint="check the network between the hosts (GLOO_SOCKET_IFNAME)")])
            return
        self.job.abort(self.gen.number)
        self._note("retry", f"ranks lost a connection but no rank failed: running generation {self.gen.number} "
                            "again")
        restore, moved = self._unfinished()
        self._announce(self.plan, restore=restore, moved=moved, reason="retry after a lost connection")
        self.phase = Phase.RECOVERING
