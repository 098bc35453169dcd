"""The supervisor of a live run (`schedc train`): a loop over typed messages, generation after generation.

A **generation** is one membership running one plan. The supervisor's loop (`_tick`) drains
the workers' reports and the agents' events (`schedc.live.protocol`), feeds heartbeats to the
detector (`schedc.live.detect`), and moves the run through its phases (`protocol.Phase`):
starting, running, switching, recovering, finishing.
What to do about a failure, a slow GPU or a GPU that comes back is decided
by three policies that see the run only through a `Controller`
(`schedc.live.control`):

* `schedc.live.recovery`: which plan after GPUs fail (re-route, drop the
  pipeline, restore a checkpoint when a stage is lost, restart everything);
* `schedc.live.slowness`: slow GPUs, priced and switched around (ski rental);
* `schedc.live.rejoin`: catch-up and switch-in of a GPU that comes back
  (`schedc.live.growth`: after a re-partition, growing onto GPUs back).

On a failure the supervisor aborts the generation (``abort`` in the store: every survivor
stops at its next wait), fences failed ranks that are still alive (SIGKILL), asks the
recovery policy for the next plan, announces generation N+1 (members, programs, what to
restore) and waits until every member has reconfigured. The supervisor never prints:
`on_line` receives one line per finished iteration and per event.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Callable

from schedc.diagnostics import Diagnostic, RunError, SchedcError, error
from schedc.live import checkpoint, reshard
from schedc.live.agent import Fleet
from schedc.live.control import SupervisorControl
from schedc.live.detect import Detector, Suspect
from schedc.live.inject import Injections, parse_injections
from schedc.live.ledger import Ledger
from schedc.live.membership import Generation, JobStore
from schedc.live.options import TrainOptions
from schedc.live.protocol import (AgentLeft, AgentUp, Aborted, CaughtUp, CheckpointFailed, CheckpointWritten, Done,
                                  Exited, Injected, IterationDone, Left, Phase, Probe, Ready, RejoinAsked, RunConfig,
                                  Started, WorkerError)
from schedc.live.recovery import RecoveryPolicy, replan_solver
from schedc.recovery_cost import Costs
from schedc.live.rejoin import Rejoins
from schedc.live.result import GenerationRecord, IterationRecord, Recovery, Switch, TrainResult, write_log
from schedc.live.slowness import Slowness
from schedc.live.world import LocalWorld, World
from schedc.live.growth import Growth
from schedc.live.relayout import Relayout
from schedc.live.hosts import TICK, Hosts
from schedc.live.transitions import Transitions
from schedc.live.member import EXIT_ERROR
from schedc.plan import Plan, read_plan

#: A worker's error codes that say schedc's live runtime broke one of its own rules (a bug to
#: report, whose hint says so), reported as they are rather than as an error of the user's code.
SCHEDC_BUGS = frozenset({"E552"})
#: Seconds to wait for the error report of a worker that exited with EXIT_ERROR.
ERROR_REPORT_WAIT = 1.0
#: Seconds the workers get to exit by themselves once the run is over.
FINISH_WAIT = 10.0


class Supervisor(Transitions, Hosts, Relayout, Growth):
    """Runs the compiled plan in `out` on live workers and keeps it training through failures."""

    def __init__(self, out: str | Path, options: TrainOptions = TrainOptions(), *,
                 on_line: Callable[[str], None] | None = None, world: World | None = None):
        options.check()
        self.world = world or LocalWorld()
        self.t0 = self.world.time()
        self.out = Path(out)
        self.on_line = on_line or (lambda line: None)
        self.plan: Plan = read_plan(self.out)
        options = options.with_spec(self.plan.spec)  # the spec's `recovery` block where no option was given
        self.options = options
        self.base_plan: Plan = self.plan  # the plan of the last generation that became ready
        spec = self.plan.spec
        from schedc.runtime.manifest import refuse_unrunnable

        refuse_unrunnable(self.plan)
        if options.shadow:
            from schedc.live.shadow import check_memory

            check_memory(self.plan)
        from schedc.runtime.placement import place_live  # (first: a machine without the GPUs asked for hears it)
        place_live(options.device, options.backend, -(-len(spec.gpus) // options.hosts))
        self.iterations = options.iterations or spec.train.iterations
        self.injections = Injections(parse_injections(options.inject, spec, iterations=self.iterations),
                                     clock=self.world.time)
        self.ckpt_root = (Path(options.checkpoint_dir) if options.checkpoint_dir else self.out / "checkpoints").resolve()
        stall = options.stall_timeout or max(10.0, 10 * self.plan.metrics.iteration_time / 1e6)
        self.detector = Detector(heartbeat_timeout=options.detect_timeout, stall_timeout=stall, phi=options.phi,
                                 startup_timeout=options.startup_timeout, beat_interval=options.heartbeat_interval)
        self.phase = Phase.NEW
        self.job: JobStore | None = None
        self.fleet: Fleet | None = None  # every host's agent
        self.gen: Generation | None = None
        self.dead: set[int] = set()  # ranks lost for good in this run (failed, fenced)
        self.alive: set[int] = set()  # ranks whose worker process runs (started, no exit reported yet)
        self._started_by: dict[int, str] = {}  # ... that said so: the lease of the agent that started it
        self.events: list[dict] = []
        self.ledger = Ledger(self.t0, with_loss=not options.emulate)  # which iterations are done
        self.recoveries: list[Recovery] = []
        self.generation_records: list[GenerationRecord] = []
        self.switches: list[Switch] = []
        self.state_dict: dict | None = None
        self.checkpoints = checkpoint.RunCheckpoints(self.ckpt_root, spec.pp, options.keep_checkpoints)
        self._ready: dict[int, Ready] = {}
        self._done: set[int] = set()
        self._suspects: dict[int, Suspect] = {}
        self._error_exits: dict[int, float] = {}  # rank -> when it exited with EXIT_ERROR
        self._finish_deadline = math.inf
        self._recovery: Recovery | None = None  # the recovery under way
        self._switch_rec: Switch | None = None  # the planned switch under way
        self._switch_from: tuple[int, ...] = ()  # the members of the generation it switches from
        self._leaving: set[int] = set()  # members of that generation that are not in the next
        self._gen_speeds: dict[int, dict[int, float]] = {}  # generation -> rank -> the speed its plan assumes
        self.repartitioned: str | None = None  # onto what the job was re-partitioned (its ranks are the layout's since)
        # The GPU each rank of the running plan runs on, named by the job's rank for it at its start
        # (they differ after a re-partition); of the job's GPUs outside that plan, those lost and
        # not back, those back since the last re-partition or growth, and those healthy but unused.
        self.physical: dict[int, int] = {g.rank: g.rank for g in spec.gpus}
        self.lost_to_repartition: set[int] = set()
        self._returned: set[int] = set()
        self.spare: set[int] = set()
        self.hosts_gone: set[int] = set()  # hosts whose agent stopped answering (`_unreachable`)
        self.epoch = 0  # how its ranks are numbered: one more at each in-place re-partition (`Relayout`)
        self._renames: dict[int, dict[int, int]] = {}  # epoch -> rank of the epoch before -> rank then
        self._start_growth()  # (`Growth`'s state: none to grow onto yet)
        self._last_beats = 0.0
        self._training_started: float | None = None
        self._pending_write: tuple[int, Plan, dict[str, str]] | None = None
        self._failure: list[Diagnostic] | None = None
        self._unexplained: float | None = None  # an abort no failure explains, since when
        self._retries = 0
        # The deadline of a transition (a generation that must become ready): when it was announced,
        # when every member's process was up (had beaten), when a switch's old generation ended,
        # whether the wait was said, and how many transitions in a row missed their deadline.
        self._announced_at = 0.0
        self._up_at: float | None = None
        self._old_done_at: float | None = None
        self._old_due = math.inf  # when a planned switch's old generation should have ended at the latest
        self._wait_noted = False
        self._late = 0
        self.shadows_held: set[int] = set()  # --shadow: ranks whose shadow was exact when they were last ready
        self.shadows_on = True  # --shadow: whether the newest plan has room for them (`_shadows_fit`)
        self._dump_refused = False  # a dump generation missed its deadline: this recovery restores without one
        # Ranks declared failed by silence: taken back once (("gpu", G): by growing); those of a recovery
        # whose survivors save their state first (a dump), for the decision after it.
        self._taken_back, self._silent_after_dump = set(), {}
        control = SupervisorControl(self)
        self.rejoins = Rejoins(control)
        self.slowness = Slowness(control, mode=options.fail_slow)
        # A restore loses half this run's checkpoint interval (`Costs.lost_work_s`; without: the spec's).
        every_s = options.checkpoint_every * self.plan.metrics.iteration_time / 1e6 or None
        costs = Costs.of(self.plan.spec.recovery, horizon_s=options.horizon, checkpoint_every_s=every_s)
        self.recovery = RecoveryPolicy(control, method=options.recovery, max_restarts=options.max_restarts,
                                       initial_plan=self.plan, latest_checkpoint=self.checkpoints.latest_own,
                                       out=self.out, costs=costs, clock=self._now, iterations=self.iterations,
                                       shadow=options.shadow, deadline_s=options.replan_deadline)
        self._handlers = {
            WorkerError: self._on_error, Ready: self._on_ready, IterationDone: self._on_iteration,
            Aborted: self._on_aborted, Done: self._on_done, CheckpointWritten: self._on_checkpoint,
            CheckpointFailed: self._on_checkpoint_failed, CaughtUp: lambda m, now: self.rejoins.caught_up(m),
            Probe: self._on_probe, Left: self._on_left, RejoinAsked: self._on_rejoin_asked,
            Exited: self._on_exit, Injected: self._on_injected, Started: self._on_started, AgentUp: self._on_agent_up,
            AgentLeft: lambda m, now: self.fleet.left.add(m.host),
        }

    # -- public --------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train to the end (or fail with a `RunError`); Ctrl-C stops every worker first."""
        try:
            self._setup()
            while self.phase not in (Phase.DONE, Phase.FAILED):
                self._tick()
        except KeyboardInterrupt as exc:
            how = "SIGTERM" if getattr(exc, "signal_name", "") == "SIGTERM" else "Ctrl-C"
            self._note("interrupted", f"interrupted ({how}): stopping every worker")
            self._failure = [error("E559", f"training was interrupted ({how})")]
            self._teardown("interrupted")
            raise
        except SchedcError as exc:  # e.g. no checkpoint to resume, no plan after a failure
            self._fail(list(exc.diagnostics))
            self._teardown("failed")
            raise TrainError(self._failure, self.result(), exc.sources) from None
        except BaseException:
            self._teardown("the supervisor failed")
            raise
        self._teardown("finished" if self.phase == Phase.DONE else "failed")
        result = self.result()
        if self._failure:
            raise TrainError(self._failure, result)
        return result

    def result(self) -> TrainResult:
        opts = dict(self.options.__dict__, iterations=self.iterations)
        return TrainResult(ok=self.phase == Phase.DONE and not self._failure, out=str(self.out),
                           iterations=[self.ledger.records[i] for i in sorted(self.ledger.records)],
                           events=self.events, recoveries=self.recoveries, generations=self.generation_records,
                           wall_s=self.world.time() - self.t0, options=opts, state_dict=self.state_dict,
                           error=[d.to_json() for d in self._failure] if self._failure else None,
                           checkpoints=list(self.checkpoints.paths), history=list(self.ledger.history),
                           switches=self.switches, decisions=self.slowness.decisions)

    @property
    def completed(self) -> int:
        """Iterations completed so far (the next one to complete)."""
        return self.ledger.completed

    # -- start ---------------------------------------------------------------------------------

    def _setup(self) -> None:
        opts, spec = self.options, self.plan.spec
        found, notes = self.checkpoints.prepare(
            resume=opts.resume, every=opts.checkpoint_every, emulate=opts.emulate, optimizer=spec.train.optimizer,
            iterations=self.iterations, dp=spec.dp, microbatches=spec.microbatches, partition=spec.partition,
            model_layers=lambda: reshard.plan_model_layers(self.plan, self.out))
        restore = str(found.path) if found else None
        try:
            self.job = self.world.serve(opts.store_host, opts.store_port)
        except (RuntimeError, OSError) as exc:  # a busy port, an address not of this machine
            raise RunError([error("E557", f"cannot serve the run's store on {opts.store_host}:{opts.store_port}: "
                                          f"{str(exc).strip().splitlines()[0]}",
                                  hint="choose a free --store-port, and a --store-host address of this machine")])
        self.job.put_config(RunConfig(
            iterations=self.iterations, emulate=opts.emulate, heartbeat_interval=opts.heartbeat_interval,
            wait_timeout=opts.wait_timeout, checkpoint_every=opts.checkpoint_every,
            checkpoint_dir=str(self.ckpt_root.resolve()), want_weights=opts.want_weights,
            injections=tuple(i.to_json() for i in self.injections.all),
            coords={str(g.rank): (g.dp, g.pp) for g in spec.gpus}, probe=opts.fail_slow == "act",
            cluster=(spec.cluster.dp, spec.cluster.pp), stall_clock=opts.fail_slow != "off", device=opts.device,
            shadow=opts.shadow))
        self.fleet = self.world.fleet(self.job, spec, opts.hosts)
        for message in notes:  # damaged checkpoints passed over, unfinished files removed
            self._note("checkpoint", message)
        if found and checkpoint.split_differs(found.meta, spec.pp, spec.partition):
            self._note("checkpoint", f"{found.path.name} was written by {found.meta['stages']} stages; each of the "
                                     f"plan's {spec.pp} re-shards it from the stage files holding its layers",
                       path=str(found.path))
        self.fleet.wait_for_agents(opts.agent_timeout, lambda kind, message: self._note(kind, message))
        self._announce(self.plan, restore=restore, reason=f"resume from {Path(restore).name}" if restore else "start")
        self._start_workers(self.gen.members)
        self.phase = Phase.STARTING
        if replan_solver(spec) == "cpsat":
            # OR-Tools' import (0.4-1.2 s) does not fit the first replan's deadline (0.5 s by default),
            # which would otherwise always plan with greedy alone ("no time to load OR-Tools").
            from schedc.solvers import cpsat

            cpsat.warm_up_in_background()

    # -- the loop --------------------------------------------------------------------------------

    def _tick(self) -> None:
        self.fleet.step(TICK)
        now = self._now()
        for msg in self.job.reports() + self.job.events():
            self._dispatch(msg, now)
        if now - self._last_beats >= self.options.heartbeat_interval and self.phase not in (Phase.FINISHING,
                                                                                             Phase.DONE):
            self._last_beats = now
            for rank, text in self.job.heartbeats(self.detector.watching()).items():
                self.detector.beat(rank, text, now)
            self.slowness.beat_rates(self.detector.beat_rates(now))
            self.slowness.stalls(self.detector.stall_fractions(now))
            for s in self.detector.check(now, running=self.phase in (Phase.RUNNING, Phase.SWITCHING)):
                self._suspect(s)
            if self.detector.nobody_started:
                self._fail([error("E554", f"no rank sent a heartbeat in {self.options.startup_timeout:g} s since "
                                          "it started",
                                  hint="the workers cannot reach the store, or the host is too busy to start "
                                       "them; check --store-host and the host's load")])
                return
            if self.detector.stalled_waiting:
                self._fail([error("E554", "the job is stuck: every rank waits for another and none has "
                                          f"finished an op for {self.detector.stall_timeout:g} s",
                                  hint="a message was lost or a program is wrong; rerun with SCHEDC_DEBUG=1 "
                                       "and report it")])
                return
        self._fire_timed_injections(now)
        if self.phase == Phase.RUNNING:
            self.rejoins.check_progress(self.options.transition_timeout)
        else:
            self._check_transition(now)
        for rank, at in list(self._error_exits.items()):
            if now - at > ERROR_REPORT_WAIT:  # exited with EXIT_ERROR but no report came: a crash
                del self._error_exits[rank]
                s = self.detector.exited(rank, EXIT_ERROR, now)
                if s:
                    self._suspect(s)
        if self._failure:
            return
        if self._suspects:
            self._recover()
        elif self._unexplained is not None and now - self._unexplained > self.options.detect_timeout + 1.0:
            self._retry()
        elif self.phase == Phase.RUNNING and self._complete():
            self._finish()
        elif self.phase == Phase.RUNNING and self.gen is not None and self._done >= set(self.gen.members):
            never = self.ledger.missing(self.iterations, limit=20)
            self._fail([error("E554", f"every rank finished, yet iterations {never} were never completed",
                              hint="this is a bug in schedc's live runtime; please report it with the --log file")])
        elif self.phase == Phase.FINISHING and (not (self.alive - self.dead) or now > self._finish_deadline):
            self.phase = Phase.DONE  # (workers still there after the deadline are killed at teardown)
        if self._pending_write is not None and self.phase in (Phase.RUNNING, Phase.RECOVERING, Phase.STARTING,
                                                               Phase.SWITCHING):
            self._write_generation(*self._pending_write)
            self._pending_write = None

    def _dispatch(self, msg, now: float) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg, now)

    def _now(self) -> float:
        return self.world.time() - self.t0

    # -- what workers report ----------------------------------------------------------------------

    def _on_error(self, msg: WorkerError, now: float) -> None:
        self._error_exits.pop(msg.rank, None)
        diags = [error(d.get("code", "E590"), d["message"], hint=d.get("hint", "")) for d in msg.diagnostics]
        if diags and diags[0].code in SCHEDC_BUGS:  # schedc's own rule broken, not the user's code
            self._fail(diags)
            return
        self._fail([error("E551", f"rank {msg.rank} stopped on an error of its own, not a hardware "
                                  "failure: the run cannot route around it", hint="see the error below")] + diags)

    def _on_ready(self, msg: Ready, now: float) -> None:
        if self.gen is not None and msg.gen == self.gen.number:
            self._ready[msg.rank] = msg
            if set(self._ready) >= set(self.gen.members):
                self._generation_ready(now)

    def _on_iteration(self, msg: IterationDone, now: float) -> None:
        speeds = self._gen_speeds.get(msg.gen, {})
        current = self.gen.number if self.gen else -1
        if msg.rank in speeds and msg.gen == current and self.options.fail_slow != "off":
            self.slowness.observe(msg, speeds[msg.rank])
        record = self.ledger.add(msg, self._members_of(msg.gen), speeds)
        if record is not None:
            self._iteration_done(record, now)

    def _on_aborted(self, msg: Aborted, now: float) -> None:
        self._note("aborted", f"rank {msg.rank} left generation {msg.gen}: {msg.reason}", quiet=True,
                   rank=msg.rank, generation=msg.gen, steps=msg.steps)
        current = self.gen.number if self.gen else -1
        if msg.gen == current and self.phase in (Phase.RUNNING, Phase.STARTING, Phase.RECOVERING) \
                and self._unexplained is None:
            # No abort was announced: a failure should be detected soon; if none is, run the
            # generation again (a lost connection, or groups that could not form).
            self._unexplained = now

    def _on_done(self, msg: Done, now: float) -> None:
        if self.gen is not None and msg.gen == self.gen.number:
            self._done.add(msg.rank)

    def _on_checkpoint(self, msg: CheckpointWritten, now: float) -> None:
        spec, job = self.plan.spec, self.recovery.initial_plan.spec  # (job: the data's shape, whatever the layout)
        meta = {"spec": spec.source_name, "optimizer": spec.train.optimizer, "emulate": self.options.emulate,
                "model": self.gen.manifest["source"] if self.gen else None, "dp": job.dp,
                "microbatches": job.microbatches, "generation": self.gen.number, "time": self.world.time()}
        try:
            done = self.checkpoints.stage_written(msg.gen, msg.iteration, msg.stage, meta, layers=msg.layers,
                                                  model_layers=msg.model_layers)
        except (OSError, RunError) as exc:  # a full disk, a folder gone: training goes on, as when a stage fails
            why = exc.diagnostics[0].message if isinstance(exc, RunError) else f"{type(exc).__name__}: {exc}"
            return self._note("warning", f"warning: the checkpoint after {msg.iteration} steps was not sealed: {why}")
        if done is not None:
            self._note("checkpoint", f"checkpoint {done.path.name} complete (the state after {done.iteration} steps)",
                       path=str(done.path), iteration=done.iteration)
            if self._grow_at_checkpoint and self.phase == Phase.RUNNING:
                self._grow_back(done)

    def _on_checkpoint_failed(self, msg: CheckpointFailed, now: float) -> None:
        self._note("warning", f"warning: rank {msg.rank} could not write stage {msg.stage} of the "
                              f"checkpoint after {msg.iteration} steps: {msg.reason}")

    def _on_probe(self, msg: Probe, now: float) -> None:
        if self.options.fail_slow != "off":
            self.slowness.probe(msg)

    def _on_left(self, msg: Left, now: float) -> None:
        self._note("left", f"rank {msg.rank} left generation {msg.gen} for the next", quiet=True,
                   rank=msg.rank, generation=msg.gen)

    # -- what agents tell ----------------------------------------------------------------------------

    def _on_exit(self, msg: Exited, now: float) -> None:
        if msg.epoch != self.epoch:  # numbered before an in-place re-partition renamed the survivors
            rank = self._current_rank(msg.rank, msg.epoch)
            if rank is None:
                return  # a process without a place in the new layout: its end was expected
            msg = dataclasses.replace(msg, rank=rank, epoch=self.epoch)
        self.alive.discard(msg.rank)
        self._started_by.pop(msg.rank, None)
        if self.phase in (Phase.FINISHING, Phase.DONE):
            return  # an expected exit: the run is over
        if msg.rank not in self.detector.watching():  # fenced, or a standby process
            self.rejoins.lost(msg.rank)
            self.slowness.lost(msg.rank)
            return
        if msg.code == EXIT_ERROR:
            self._error_exits[msg.rank] = now  # its error report may still be on its way
            return
        s = self.detector.exited(msg.rank, msg.code, now)
        if s:
            self._suspect(s)

    def _on_injected(self, msg: Injected, now: float) -> None:
        inj = self.injections.fired_by_agent(msg.id, msg.t, msg.ranks)
        self._note("injected", f"injected `{inj}`: {inj.signal_name} to rank(s) {list(msg.ranks)}", t=msg.t - self.t0,
                   injection=str(inj), ranks=list(msg.ranks), signal=inj.signal_name)

    def _suspect(self, s: Suspect) -> None:
        if s.rank in self._suspects or s.rank in self.dead:
            return
        self._suspects[s.rank] = s
        self._note("failure", f"rank {s.rank} {self._gpu_name(s.rank)} failed: {s.cause}", t=s.at, rank=s.rank,
                   cause=s.cause)
        if s.fence:
            self._signal([s.rank], "kill")

    # -- generations ---------------------------------------------------------------------------------

    def _iteration_done(self, record: IterationRecord, now: float) -> None:
        it, gen = record.iteration, record.generation
        self._after_iteration(record)
        rec = self._recovery
        # (the recovery's generation, or a planned switch's after it, if one came before its first iteration)
        if rec is not None and rec.t_first is None and rec.t_ready is not None and gen >= rec.to_generation:
            rec.t_first = now
            t0 = rec.t_fault if rec.t_fault is not None else rec.t_detect
            self._note("recovered", f"first iteration under generation {gen} done {now - t0:.2f} s after the "
                                    f"{rec.start_word}", generation=gen, iteration=it)
            self._recovery = None
        loss_text = "" if record.loss is None else f"  loss {record.loss:.6f}"
        again = f"  (run {record.runs})" if record.runs > 1 else ""
        self.on_line(f"iteration {it:4d}{loss_text}  {record.end - record.start:7.3f} s  gen {gen}{again}")

    def _after_iteration(self, record: IterationRecord) -> None:
        """An iteration is done: a switch's figures; for the current generation, the policies."""
        sw, it, gen = self._switch_rec, record.iteration, record.generation
        if sw is not None:
            if gen == sw.from_generation and it == sw.start_at - 1:
                sw.t_last_old = record.end
                self._old_done_at = self._now()  # the new generation's deadline counts from here
            elif gen == sw.to_generation and sw.t_first is None:
                sw.t_first = record.end
                self._switch_rec = None
                if sw.stall_s is not None and sw.kind != "rejoin":  # (never free: new groups at least)
                    self.slowness.ladder.measured(max(sw.stall_s, 0.1))
        if gen != self.gen.number:
            return
        self.job.set_progress(it, gen)
        for inj in self.injections.due_rejoins(it):  # `at iteration I: recover gpu(...)` as iteration I starts
            self._user_rejoin(inj.ranks[0], f"injected `{inj}`")
        self._note_slowdowns(it + 1)
        if self.phase == Phase.RUNNING:
            self.slowness.tick(it)
            self.rejoins.switch_if_ready(self.ledger.now)

    def _members_of(self, gen: int) -> tuple[int, ...] | None:
        """The members whose reports complete an iteration of `gen`: the current generation's, and
        during a planned switch the one before's (it runs until the switch)."""
        if self.gen is not None and gen == self.gen.number:
            return self.gen.members
        sw = self._switch_rec
        if sw is not None and gen == sw.from_generation and self.phase == Phase.SWITCHING:
            return self._switch_from
        return None

    def _complete(self) -> bool:
        if self.gen is None or self.ledger.first is None:
            return False
        return not self.ledger.missing(self.iterations, limit=1) and self._done >= set(self.gen.members)

    # -- processes ---------------------------------------------------------------------------------------

    def _note_slowdowns(self, starting: int) -> None:
        """Say when an injected slowdown begins (its workers apply it themselves, by the iteration)."""
        for inj, line in self.injections.begun_lines(starting):
            self._note("injected", line, injection=str(inj), ranks=list(inj.ranks))

    def _note_never_fired(self) -> None:
        """At the end: every injection that did nothing, and why (a user asked for it)."""
        trained = self._now() - (self._training_started or self._now())
        for inj, line in self.injections.never_fired_lines(trained, self.gen.number):
            self._note("warning", line, injection=str(inj))

    def _fire_timed_injections(self, now: float) -> None:
        if self._training_started is None:
            return
        for inj in self.injections.due_at(now - self._training_started):
            if inj.action == "rejoin":
                self._user_rejoin(inj.ranks[0], f"injected `{inj}`")
            else:
                self.fleet.fire(inj.index, inj.ranks)

    # -- the end ---------------------------------------------------------------------------------------------

    def _finish(self) -> None:
        if self.options.want_weights:
            import torch

            state: dict = {}
            for stage in range(self.plan.spec.pp):
                blob = self.job.weights(self.gen.number, stage)
                if blob is None:
                    self._fail([error("E534", f"no rank sent the weights of stage {stage}")])
                    return
                state.update(torch.load(io.BytesIO(blob), weights_only=True))
            self.state_dict = state
        self.phase = Phase.FINISHING
        self._finish_deadline = self._now() + FINISH_WAIT
        self.job.stop("finished")
        self._note("finished", f"{self.iterations} iterations done")
        self._note_never_fired()

    def _fail(self, diagnostics: list[Diagnostic]) -> None:
        if self._failure is None:
            self._failure = diagnostics
            # In the log, not on screen: the run raises these diagnostics, and whoever catches
            # them (the CLI) shows them in full; a progress line too said it twice.
            self._note("error", diagnostics[0].message, quiet=True)
        self.phase = Phase.FAILED

    def _teardown(self, reason: str) -> None:
        if self.job is None:
            return
        try:
            if self.gen is not None:
                self.job.abort(self.gen.number)
            self.job.stop(reason)
        except Exception:
            pass
        if self.fleet is not None:
            self.fleet.stop(grace=2.0)
        if self.options.hosts > 1 and self.fleet is not None:
            # Remote agents report their workers' exits, then that they saw the stop: the store
            # (this process's) stays up until then, or they would take its end for a lost supervisor.
            left = self.alive - self.dead
            self.fleet.wait_left(left, self.hosts_gone)
            self.alive -= (self.alive - self.dead) - left
        if self._pending_write is not None and self.phase == Phase.DONE:
            self._write_generation(*self._pending_write)
            self._pending_write = None
        checkpoint.clean_partials(self.ckpt_root)  # the workers are gone: nothing half-written stays

    def _note(self, kind: str, message: str, *, t: float | None = None, quiet: bool = False, **details) -> None:
        t = self._now() if t is None else t
        self.events.append({"t": round(t, 4), "kind": kind, "message": message, **details})
        if not quiet:
            self.on_line(f"[{t:8.3f} s] {message}")


class TrainError(RunError):
    """A live run that could not finish; `result` holds what it did until then."""

    def __init__(self, diagnostics, result: TrainResult, sources: dict[str, str] | None = None):
        super().__init__(diagnostics, sources)  # sources: the texts the spans point into
        self.result = result


def train(out: str | Path, *, on_line: Callable[[str], None] | None = None, log: str | Path | None = None,
          **options) -> TrainResult:
    """Train the compiled plan in `out` with live workers, through failures (see `TrainOptions`).

    >>> result = train("out/mlp", iterations=6, want_weights=True,                 # doctest: +SKIP
    ...                inject=["at iteration 2 during B: fail gpu(dp=1, pp=0)"])
    >>> result.losses, result.recoveries[0].durations()                            # doctest: +SKIP
    """
    sup = Supervisor(out, TrainOptions(**options), on_line=on_line)
    try:
        return sup.run()
    finally:
        if log is not None:
            write_log(log, sup.result())
