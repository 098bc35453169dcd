"""The supervisor of a live run (`schedc train`): a state machine over generations.

::

    starting --every member ready--> running --every iteration done--> finishing --> done
        |                               |
        +----------- failure -----------+--> recovering --every member ready--> running
                                                 |  (another failure: recover again)

A **generation** is one membership running one plan. On a failure the
supervisor

1. **detects** it (`schedc.live.detect`: a process exit reported by its
   agent, a silent heartbeat, or a rank stuck while the others wait);
2. **aborts** the generation (``abort`` in the store: every survivor stops at
   its next wait) and **fences** failed ranks that are still alive (SIGKILL:
   a stopped or wedged process must not come back, and its closed
   connections wake every peer blocked on it);
3. **replans**: `schedc.replan(plan, "fail gpu(...)", deadline=...)`;
4. **announces** generation N+1 (its members, programs and whether to
   restore a checkpoint) and writes its plan to ``OUT/live/gen-N``;
5. waits until every member has **reconfigured** (new process groups, the
   agreed rollback) and is running again.

If re-routing is impossible because a stage lost every GPU (E301), the run
falls back to the latest complete checkpoint (or the initial weights) with
replacement processes for that stage's GPUs, at most `max_restarts` times.
`recovery="drop-pipeline"` (FT-HSDP/torchft: a pipeline with a failed GPU
leaves) and `recovery="restart"` (torchelastic: every process restarts from
the latest checkpoint, the failed GPU replaced) run the same job in the same
harness for comparison. The supervisor never prints: `on_line` receives one
line per finished iteration and per event.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from schedc.diagnostics import Diagnostic, RunError, SchedcError, error
from schedc.live import checkpoint
from schedc.live.agent import Agent
from schedc.live.detect import Beat, Detector, Suspect
from schedc.live.inject import Injection, parse_injections
from schedc.live.membership import Generation, JobStore
from schedc.live.rejoin import Rejoins
from schedc.live.result import GenerationRecord, IterationRecord, Recovery, Switch, TrainResult, write_log
from schedc.live.slowness import Slowness, measured_speed
from schedc.live.worker import EXIT_ERROR
from schedc.plan import Plan, read_plan

RecoveryMethod = Literal["reroute", "drop-pipeline", "restart"]
#: Seconds between two turns of the supervisor's loop when nothing happens (an exit wakes it at once).
TICK = 0.005
#: Seconds to gather failures that come together (a node's GPUs die within milliseconds).
SETTLE = 0.02
#: Seconds to wait for the error report of a worker that exited with EXIT_ERROR.
ERROR_REPORT_WAIT = 1.0
#: Seconds the workers get to exit by themselves once the run is over.
FINISH_WAIT = 10.0
#: A planned switch starts this many iterations after the furthest rank's current one.
SWITCH_MARGIN = 2


@dataclass(frozen=True)
class TrainOptions:
    """How a live run goes (the options of `schedc train`)."""

    iterations: int | None = None  # default: the spec's train.iterations
    emulate: bool = False
    inject: tuple[str, ...] = ()
    checkpoint_every: int = 0  # 0: no checkpoints
    checkpoint_dir: str | None = None  # default OUT/checkpoints
    keep_checkpoints: int = 2
    resume: bool = False
    recovery: RecoveryMethod = "reroute"
    fail_slow: str = "act"  # act: detect slow GPUs and switch plans by cost; detect: only say so; off
    detect_timeout: float = 3.0  # seconds of heartbeat silence before a rank is declared hung
    heartbeat_interval: float = 0.05
    stall_timeout: float | None = None  # default: max(10 s, 10 x the plan's iteration time)
    startup_timeout: float = 120.0
    replan_deadline: float = 0.5
    max_restarts: int = 3
    want_weights: bool = False
    wait_timeout: float = 600.0  # a rank's longest wait for a peer before it gives up by itself
    hosts: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    agent_timeout: float = 60.0

    def check(self) -> None:
        """E555 for option values that make no sense."""
        problems = []
        for name in ("detect_timeout", "heartbeat_interval", "startup_timeout", "replan_deadline", "wait_timeout",
                     "agent_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                problems.append(f"{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        if self.stall_timeout is not None and not (math.isfinite(self.stall_timeout) and self.stall_timeout > 0):
            problems.append(f"stall-timeout must be a positive number of seconds, got {self.stall_timeout}")
        if self.iterations is not None and self.iterations < 1:
            problems.append(f"iterations must be at least 1, got {self.iterations}")
        for name in ("checkpoint_every", "max_restarts", "store_port"):
            if getattr(self, name) < 0:
                problems.append(f"{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            problems.append(f"keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.hosts < 1:
            problems.append(f"hosts must be at least 1, got {self.hosts}")
        if self.heartbeat_interval * 3 > self.detect_timeout:
            problems.append("detect-timeout must be at least three heartbeat intervals")
        if self.recovery not in ("reroute", "drop-pipeline", "restart"):
            problems.append(f"unknown recovery `{self.recovery}` (reroute, drop-pipeline or restart)")
        if self.fail_slow not in ("act", "detect", "off"):
            problems.append(f"unknown fail-slow mode `{self.fail_slow}` (act, detect or off)")
        if self.recovery == "restart" and not self.checkpoint_every:
            problems.append("recovery `restart` restarts from checkpoints: give --checkpoint-every K")
        if self.want_weights and self.emulate:
            problems.append("weights need real compute, not --emulate")
        if problems:
            raise RunError([error("E555", p) for p in problems])


class Supervisor:
    """Runs the compiled plan in `out` on live workers and keeps it training through failures."""

    def __init__(self, out: str | Path, options: TrainOptions = TrainOptions(), *,
                 on_line: Callable[[str], None] | None = None):
        options.check()
        self.t0 = time.time()
        self.out = Path(out)
        self.options = options
        self.on_line = on_line or (lambda line: None)
        self.plan: Plan = read_plan(self.out)
        self.initial_plan = self.plan
        spec = self.plan.spec
        from schedc.runtime.manifest import refuse_tensor_parallel

        refuse_tensor_parallel(spec.cluster.tp)
        self.iterations = options.iterations or spec.train.iterations
        self.injections: tuple[Injection, ...] = parse_injections(options.inject, spec, iterations=self.iterations)
        self.ckpt_root = (Path(options.checkpoint_dir) if options.checkpoint_dir else self.out / "checkpoints").resolve()
        self.world = spec.dp * spec.pp
        nodes = -(-self.world // spec.cluster.gpus_per_node)
        self._host_of = {r: spec.cluster.node_of(r) * options.hosts // nodes for r in range(self.world)}
        iteration_s = self.plan.metrics.iteration_time / 1e6
        stall = options.stall_timeout or max(10.0, 10 * iteration_s)
        self.detector = Detector(heartbeat_timeout=options.detect_timeout, stall_timeout=stall,
                                 startup_timeout=options.startup_timeout)
        self.phase = "new"
        self.job: JobStore | None = None
        self.local: Agent | None = None
        self.gen: Generation | None = None
        self.dead: set[int] = set()  # ranks lost for good in this run (failed, fenced)
        self.alive: set[int] = set()  # ranks whose worker process runs (started, no exit reported yet)
        self.events: list[dict] = []
        self.iteration_records: dict[int, IterationRecord] = {}  # the latest completion of each
        self.history: list[IterationRecord] = []  # every completion, in order
        self.recoveries: list[Recovery] = []
        self.generation_records: list[GenerationRecord] = []
        self.restarts = 0
        self.checkpoints: list[str] = []
        self.state_dict: dict | None = None
        self._reports: dict[tuple[int, int], dict[int, dict]] = {}  # (generation, iteration) -> rank -> report
        self._first_iteration: int | None = None  # where this run started (a resumed run: the checkpoint's)
        self._ready: dict[int, dict] = {}
        self._done: set[int] = set()
        self._suspects: dict[int, Suspect] = {}
        self._error_exits: dict[int, float] = {}  # rank -> when it exited with EXIT_ERROR
        self._fired: dict[int, dict] = {}  # injection index -> its `injected` event
        self._ckpt: dict[int, set[int]] = {}  # iteration -> stages written
        self._starts: dict[int, int] = {}  # generation -> the iteration it started from
        self._finish_deadline = math.inf
        self._recovery: Recovery | None = None
        self._last_beats = 0.0
        self._training_started: float | None = None
        self._pending_write: tuple[int, Plan] | None = None
        self._failure: list[Diagnostic] | None = None
        self._unexplained: float | None = None  # an abort no failure explains, since when
        self._retries = 0
        self.base_plan: Plan = self.plan  # the plan of the last generation that became ready
        self._gen_speeds: dict[int, dict[int, float]] = {}  # generation -> rank -> the speed its plan assumes
        self.switches: list[Switch] = []
        self._switch_rec: Switch | None = None  # the planned switch under way
        self._switch_from: tuple[int, ...] = ()  # the members of the generation it switches from
        self._leaving: set[int] = set()  # members of that generation that are not in the next
        self.rejoins = Rejoins(self)
        self.slowness = Slowness(self)

    # -- public --------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train to the end (or fail with a `RunError`); Ctrl-C stops every worker first."""
        try:
            self._setup()
            while self.phase not in ("done", "failed"):
                self._tick()
        except KeyboardInterrupt:
            self._note("interrupted", "interrupted (Ctrl-C): stopping every worker")
            self._failure = [error("E559", "training was interrupted (Ctrl-C)")]
            self._teardown("interrupted")
            raise
        except SchedcError as exc:  # e.g. no checkpoint to resume, no plan after a failure
            self._fail(list(exc.diagnostics))
            self._teardown("failed")
            raise TrainError(self._failure, self.result()) from None
        except BaseException:
            self._teardown("the supervisor failed")
            raise
        self._teardown("finished" if self.phase == "done" else "failed")
        result = self.result()
        if self._failure:
            raise TrainError(self._failure, result)
        return result

    def result(self) -> TrainResult:
        opts = {k: v for k, v in self.options.__dict__.items()}
        opts["iterations"] = self.iterations
        return TrainResult(
            ok=self.phase == "done" and not self._failure, out=str(self.out),
            iterations=[self.iteration_records[i] for i in sorted(self.iteration_records)],
            events=self.events, recoveries=self.recoveries, generations=self.generation_records,
            wall_s=time.time() - self.t0, options=opts, state_dict=self.state_dict,
            error=[d.to_json() for d in self._failure] if self._failure else None,
            checkpoints=self.checkpoints, history=list(self.history), switches=self.switches,
            decisions=self.slowness.decisions)

    @property
    def completed(self) -> int:
        """Iterations completed so far (the next one to complete)."""
        return max(self.iteration_records, default=-1) + 1

    # -- start ---------------------------------------------------------------------------------

    def _setup(self) -> None:
        opts = self.options
        restore = None
        if opts.resume:
            found = checkpoint.latest(self.ckpt_root)
            if found is None:
                raise RunError([error("E556", f"no complete checkpoint in `{self.ckpt_root}` to resume from",
                                      hint="train with --checkpoint-every K first, or drop --resume")])
            self._check_checkpoint(found)
            restore = str(found.path)
            self.checkpoints.append(restore)
        elif opts.checkpoint_every and checkpoint.latest(self.ckpt_root) is not None:
            # Another run's checkpoints: mixing them would make `latest` and pruning lie.
            raise RunError([error("E556", f"`{self.ckpt_root}` holds checkpoints of an earlier run",
                                  hint="continue that run with --resume, or give this one another "
                                       "--checkpoint-dir (or remove the old checkpoints)")])
        if opts.checkpoint_every:
            self._check_checkpoint_dir()
        removed = checkpoint.clean_partials(self.ckpt_root)
        try:
            self.job = JobStore.serve(opts.store_host, opts.store_port)
        except (RuntimeError, OSError) as exc:  # a busy port, an address not of this machine
            raise RunError([error("E557", f"cannot serve the run's store on {opts.store_host}:{opts.store_port}: "
                                          f"{str(exc).strip().splitlines()[0]}",
                                  hint="choose a free --store-port, and a --store-host address of this machine")])
        self.job.put_config({
            "iterations": self.iterations, "emulate": opts.emulate, "heartbeat_interval": opts.heartbeat_interval,
            "wait_timeout": opts.wait_timeout, "checkpoint_every": opts.checkpoint_every,
            "checkpoint_dir": str(self.ckpt_root.resolve()), "want_weights": opts.want_weights,
            "injections": [i.to_json() for i in self.injections],
            "coords": {str(g.rank): [g.dp, g.pp] for g in self.plan.spec.gpus},  # every GPU, live or not
            "probe": opts.fail_slow == "act",
            "cluster": [self.plan.spec.cluster.dp, self.plan.spec.cluster.pp],  # GPUs with no ops to time measure their speed by probes
        })
        self.local = Agent(self.job, 0)
        self.local.register()
        if removed:
            self._note("checkpoint", f"removed {len(removed)} unfinished checkpoint file(s) of an earlier run")
        self._wait_for_agents()
        members = self._members(self.plan)
        reason = f"resume from {Path(restore).name}" if restore else "start"
        self._announce(self.plan, restore=restore, reason=reason)
        self._start_workers(members)
        self.phase = "starting"

    def _wait_for_agents(self) -> None:
        want = set(range(1, self.options.hosts))
        if not want:
            return
        self._note("agents", f"waiting for {len(want)} agent(s): on each other host run "
                             f"`schedc agent --store {self.job.host}:{self.job.port} --host H` (H = "
                             f"{', '.join(map(str, sorted(want)))})")
        deadline = time.monotonic() + self.options.agent_timeout
        while want and time.monotonic() < deadline:
            for ev in self.job.events():
                if ev.get("kind") == "agent":
                    want.discard(ev["host"])
            time.sleep(0.01)
        if want:
            raise RunError([error("E557", f"agents of host(s) {sorted(want)} did not register within "
                                          f"{self.options.agent_timeout:g} s",
                                  hint=f"start them with `schedc agent --store {self.job.host}:{self.job.port} "
                                       f"--host H`, or run with fewer --hosts")])

    def _check_checkpoint_dir(self) -> None:
        try:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            probe = self.ckpt_root / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise RunError([error("E558", f"checkpoints cannot be written to `{self.ckpt_root}`: "
                                          f"{exc.strerror or exc}", hint="give a writable --checkpoint-dir")])

    def _checkpoint_meta(self) -> dict:
        spec = self.plan.spec
        return {"spec": spec.source_name, "optimizer": spec.train.optimizer, "emulate": self.options.emulate,
                "model": self.gen.manifest["source"] if self.gen else None}

    def _check_checkpoint(self, found: checkpoint.Checkpoint) -> None:
        stages = found.meta.get("stages")
        if stages != self.plan.spec.pp:
            raise RunError([error("E570", f"checkpoint `{found.path}` has {stages} stages but the plan has "
                                          f"{self.plan.spec.pp}", hint="resume with a plan of the same model split")])
        for key, mine, what in (("emulate", self.options.emulate, "--emulate"),
                                ("optimizer", self.plan.spec.train.optimizer, "the optimizer")):
            if key in found.meta and found.meta[key] != mine:
                raise RunError([error("E570", f"checkpoint `{found.path}` was written with {key} = "
                                              f"{found.meta[key]!r}, this run has {mine!r}",
                                      hint=f"resume with the same {what} as the run that wrote it")])
        if found.iteration >= self.iterations:
            raise RunError([error("E556", f"checkpoint `{found.path}` is after iteration {found.iteration - 1}: "
                                          f"nothing is left of the {self.iterations} iterations to run",
                                  hint="run more iterations (--iterations)")])

    # -- the loop --------------------------------------------------------------------------------

    def _tick(self) -> None:
        self.local.step(TICK)
        now = self._now()
        for rep in self.job.reports():
            self._on_report(rep, now)
        for ev in self.job.events():
            self._on_event(ev, now)
        if now - self._last_beats >= self.options.heartbeat_interval and self.phase not in ("finishing", "done"):
            self._last_beats = now
            for rank, text in self.job.heartbeats(self.detector.watching()).items():
                self.detector.beat(rank, text, now)
            for s in self.detector.check(now, running=self.phase in ("running", "switching")):
                self._suspect(s)
            if self.detector.stalled_waiting:
                self._fail([error("E554", "the job is stuck: every rank waits for another and none has "
                                          f"finished an op for {self.detector.stall_timeout:g} s",
                                  hint="a message was lost or a program is wrong; rerun with SCHEDC_DEBUG=1 "
                                       "and report it")])
                return
        self._fire_timed_injections(now)
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
        elif self.phase == "running" and self._complete():
            self._finish()
        elif self.phase == "running" and self.gen is not None and self._done >= set(self.gen.members):
            missing = [i for i in range(self._first_iteration or 0, self.iterations) if i not in self.iteration_records]
            self._fail([error("E554", f"every rank finished, yet iterations {missing} were never completed",
                              hint="this is a bug in schedc's live runtime; please report it with the --log file")])
        elif self.phase == "finishing" and (not (self.alive - self.dead) or now > self._finish_deadline):
            self.phase = "done"  # (workers still there after the deadline are killed at teardown)
        if self._pending_write is not None and self.phase in ("running", "recovering", "starting", "switching"):
            self._write_generation(*self._pending_write)
            self._pending_write = None

    def _now(self) -> float:
        return time.time() - self.t0

    # -- reports from workers -----------------------------------------------------------------------

    def _on_report(self, rep: dict, now: float) -> None:
        kind = rep.get("kind")
        gen = rep.get("gen")
        current = self.gen.number if self.gen else -1
        if kind == "error":
            self._error_exits.pop(rep["rank"], None)
            diags = [error(d.get("code", "E590"), d["message"], hint=d.get("hint", ""))
                     for d in rep["diagnostics"]]
            self._fail([error("E551", f"rank {rep['rank']} stopped on an error of its own, not a hardware "
                                      "failure: the run cannot route around it", hint="see the error below")]
                       + diags)
        elif kind == "ready" and gen == current:
            self._ready[rep["rank"]] = rep
            if set(self._ready) >= set(self.gen.members):
                self._generation_ready(now)
        elif kind == "iter":
            reps = self._reports.setdefault((gen, rep["it"]), {})
            reps[rep["rank"]] = rep
            speeds = self._gen_speeds.get(gen, {})
            if rep["rank"] in speeds and gen == current and self.options.fail_slow != "off":
                self.slowness.observe(rep, speeds[rep["rank"]])
            members = self._members_of(gen)
            if members is not None and set(reps) >= set(members):
                del self._reports[(gen, rep["it"])]
                self._iteration_done(rep["it"], gen, reps, now)
        elif kind == "aborted":
            self._note("aborted", f"rank {rep['rank']} left generation {gen}: {rep['reason']}", quiet=True,
                       rank=rep["rank"], generation=gen, steps=rep["steps"])
            if gen == current and self.phase in ("running", "starting", "recovering") and self._unexplained is None:
                # No abort was announced: a failure should be detected soon; if none is, run the
                # generation again (a lost connection, or groups that could not form).
                self._unexplained = now
        elif kind == "done" and gen == current:
            self._done.add(rep["rank"])
        elif kind == "ckpt":
            self._checkpoint_written(rep)
        elif kind == "ckpt_error":
            self._note("warning", f"warning: rank {rep['rank']} could not write stage {rep['stage']} of the "
                                  f"checkpoint after {rep['iteration']} steps: {rep['reason']}")
        elif kind == "caughtup":
            self.rejoins.caught_up(rep)
        elif kind == "probe" and self.options.fail_slow != "off":
            self.slowness.probe(rep)
        elif kind == "left":
            self._note("left", f"rank {rep['rank']} left generation {gen} for the next", quiet=True,
                       rank=rep["rank"], generation=gen)
        elif kind == "rejoin":  # `schedc rejoin` from a user
            self._rejoin_request(rep.get("event", ""), "asked for with schedc rejoin")

    def _generation_ready(self, now: float) -> None:
        start = min(r["start"] for r in self._ready.values())
        undone = sum(1 for r in self._ready.values() if r["undone"])
        if self._first_iteration is None:
            self._first_iteration = start
        # Every iteration before `start` is committed: every survivor applied its step. One whose
        # report a dying rank never sent is recorded from the reports that did arrive.
        for it in range(self._first_iteration, start):
            if it not in self.iteration_records:
                for (g, i), reps in sorted(self._reports.items(), reverse=True):
                    if i == it and reps:
                        self._iteration_done(it, g, reps, now)
                        break
        self._starts[self.gen.number] = start
        # Checkpoint files of steps that were undone will be written again.
        self._ckpt = {k: v for k, v in self._ckpt.items() if k <= start}
        for key in [key for key in self._reports if key[1] < start]:
            del self._reports[key]  # committed: recorded above
        self.generation_records[-1].t_ready = now
        first = self._training_started is None
        recovered = self.phase == "recovering"
        switched = self.phase == "switching"
        self.phase = "running"
        self.base_plan = self.plan
        for r in self._leaving - set(self.gen.members):
            self.detector.forget(r)  # left at the switch: on standby now
        self._leaving = set()
        self.detector.restart_progress(now)
        self._unexplained = None
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
        if recovered or switched:
            self.slowness.after_plan_change()
        if first:
            self._training_started = now
            self._note("running", f"generation {self.gen.number}: {len(self.gen.members)} ranks running from "
                                  f"iteration {start}; store {self.job.host}:{self.job.port}",
                       generation=self.gen.number, start=start, store=f"{self.job.host}:{self.job.port}")
            return
        rec = self._recovery
        if rec is not None:
            rec.t_ready = now
            rec.resumed_at = start
            rec.undone = undone
            back = f"rolled back to iteration {start}" + (f" ({undone} rank(s) undid their last step)"
                                                           if undone else "")
            if self.gen.restore:
                back = f"restored {Path(self.gen.restore).name if self.gen.restore != 'initial' else 'the initial weights'}, iteration {start}"
            t0 = rec.t_fault if rec.t_fault is not None else rec.t_detect
            self._note("reconfigured", f"generation {self.gen.number}: {len(self.gen.members)} ranks reconfigured "
                                       f"{now - t0:.2f} s after the failure; {back}",
                       generation=self.gen.number, start=start, undone=undone)

    def _iteration_done(self, it: int, gen: int, reps: dict[int, dict], now: float) -> None:
        # The last stage sums the loss over its GPUs as it steps: each of its reports has all of it.
        losses = [r["loss"] for r in reps.values() if r.get("loss") is not None]
        loss = None if self.options.emulate or not losses else losses[0]
        start = min(r["t0"] for r in reps.values()) - self.t0
        end = max(r["t1"] for r in reps.values()) - self.t0
        old = self.iteration_records.get(it)
        plan_speeds = self._gen_speeds.get(gen, {})
        measured = {r: measured_speed(rep, plan_speeds.get(r, 1.0)) for r, rep in sorted(reps.items())}
        speeds = {r: round(v, 4) for r, v in measured.items() if v is not None}
        record = IterationRecord(it, gen, loss, round(start, 4), round(end, 4),
                                 runs=(old.runs + 1) if old else 1, speeds=speeds)
        self.iteration_records[it] = record
        self.history.append(record)
        self._after_iteration(record)
        rec = self._recovery
        if rec is not None and rec.t_first is None and rec.to_generation == gen == self.gen.number:
            rec.t_first = now
            t0 = rec.t_fault if rec.t_fault is not None else rec.t_detect
            self._note("recovered", f"first iteration under generation {gen} done {now - t0:.2f} s after the "
                                    "failure", generation=gen, iteration=it)
            self._recovery = None
        loss_text = "" if loss is None else f"  loss {loss:.6f}"
        again = f"  (run {record.runs})" if record.runs > 1 else ""
        self.on_line(f"iteration {it:4d}{loss_text}  {end - start:7.3f} s  gen {gen}{again}")

    def _switch_margin(self) -> int:
        """Iterations between announcing a planned switch and its start: SWITCH_MARGIN, plus what
        a heartbeat's staleness (the furthest rank may be further) spans at the measured pace, so
        that no member is past the start when it reads of the switch (at its next boundary)."""
        ends = [r.end for r in self.history[-6:]]
        gaps = [b - a for a, b in zip(ends, ends[1:]) if b > a]
        period = statistics.median(gaps) if gaps else self.plan.metrics.iteration_time / 1e6
        return SWITCH_MARGIN + min(50, math.ceil(self.options.heartbeat_interval / max(period, 1e-3)))

    def _members_of(self, gen: int) -> tuple[int, ...] | None:
        """The members whose reports complete an iteration of `gen`: the current generation's, and
        during a planned switch the one before's (it runs until the switch)."""
        if self.gen is not None and gen == self.gen.number:
            return self.gen.members
        sw = self._switch_rec
        if sw is not None and gen == sw.from_generation and self.phase == "switching":
            return self._switch_from
        return None

    def _after_iteration(self, record: IterationRecord) -> None:
        """An iteration is done: a switch's figures; for the current generation, the ladder and rejoins."""
        sw, it, gen = self._switch_rec, record.iteration, record.generation
        if sw is not None:
            if gen == sw.from_generation and it == sw.start_at - 1:
                sw.t_last_old = record.end
            elif gen == sw.to_generation and sw.t_first is None:
                sw.t_first = record.end
                self._switch_rec = None
                if sw.stall_s is not None and sw.kind != "rejoin":  # (never free: new groups at least)
                    self.slowness.ladder.measured(max(sw.stall_s, 0.1))
        if gen != self.gen.number:
            return
        self.job.set_progress(it)
        for inj in self.injections:  # `at iteration I: recover gpu(...)` as iteration I starts
            if inj.action == "rejoin" and inj.moment.kind == "iteration" and inj.moment.iteration <= it + 1 \
                    and inj.index not in self._fired:
                self._fired[inj.index] = {"t": time.time(), "ranks": list(inj.ranks)}
                self.rejoins.request(inj.ranks[0], f"injected `{inj}`")
        if self.phase == "running":
            self.slowness.tick(it)
            self.rejoins.switch_if_ready(self.completed)

    def _rejoin_request(self, text: str, reason: str) -> None:
        from schedc.events import parse_events

        try:
            (ev,) = parse_events(text)
            if ev.kind != "recover_gpu":
                raise ValueError
        except Exception:
            self._note("warning", f"warning: ignored a rejoin request that is not `recover gpu(dp=D, pp=S)`: {text!r}")
            return
        cluster = self.plan.spec.cluster
        if not (0 <= ev.dp < cluster.dp and 0 <= ev.pp < cluster.pp):
            self._note("warning", f"warning: ignored a rejoin request for GPU (dp={ev.dp}, pp={ev.pp}): the cluster "
                                  f"has dp 0..{cluster.dp - 1} and pp 0..{cluster.pp - 1}")
            return
        rank = cluster.rank_of(ev.dp, ev.pp)
        self.rejoins.request(rank, reason)

    def _complete(self) -> bool:
        if self.gen is None or self._first_iteration is None:
            return False
        todo = range(self._first_iteration, self.iterations)
        return all(it in self.iteration_records for it in todo) and self._done >= set(self.gen.members)

    def _checkpoint_written(self, rep: dict) -> None:
        k = rep["iteration"]
        if any(start < k for g, start in self._starts.items() if g > rep["gen"]):
            return  # written before a rollback undid step k: it is written again
        stages = self._ckpt.setdefault(k, set())
        stages.add(rep["stage"])
        if len(stages) < self.plan.spec.pp:
            return
        del self._ckpt[k]
        meta = {**self._checkpoint_meta(), "generation": self.gen.number, "time": time.time()}
        done = checkpoint.complete(self.ckpt_root, k, self.plan.spec.pp, meta, keep=self.options.keep_checkpoints)
        self.checkpoints.append(str(done.path))
        self._note("checkpoint", f"checkpoint {done.path.name} complete (the state after {k} steps)",
                   path=str(done.path), iteration=k)

    # -- events from agents ----------------------------------------------------------------------------

    def _on_event(self, ev: dict, now: float) -> None:
        kind = ev.get("kind")
        if kind == "exit":
            rank, code = ev["rank"], ev["code"]
            self.alive.discard(rank)
            if self.phase in ("finishing", "done"):
                return  # an expected exit: the run is over
            if rank not in self.detector.watching():  # fenced, or a standby process
                self.rejoins.lost(rank)
                self.slowness.lost(rank)
                return
            if code == EXIT_ERROR:
                self._error_exits[rank] = now  # its error report may still be on its way
                return
            s = self.detector.exited(rank, code, now)
            if s:
                self._suspect(s)
        elif kind == "injected":
            self._fired[ev["id"]] = ev
            inj = next(i for i in self.injections if i.index == ev["id"])
            t = ev["t"] - self.t0
            self._note("injected", f"injected `{inj}`: {inj.signal_name} to rank(s) {ev['ranks']}", t=t,
                       injection=str(inj), ranks=ev["ranks"], signal=inj.signal_name)

    def _suspect(self, s: Suspect) -> None:
        if s.rank in self._suspects or s.rank in self.dead:
            return
        self._suspects[s.rank] = s
        g = self.plan.spec.gpus[s.rank]
        self._note("failure", f"rank {s.rank} GPU (dp={g.dp}, pp={g.pp}) failed: {s.cause}", t=s.at,
                   rank=s.rank, cause=s.cause)
        if s.fence:
            self._signal([s.rank], "kill")

    # -- recovery ----------------------------------------------------------------------------------------

    def _recover(self) -> None:
        # Failures that come together (a node) are planned together.
        settle = time.monotonic() + SETTLE
        while time.monotonic() < settle:
            self.local.step(TICK)
            now = self._now()
            for ev in self.job.events():
                self._on_event(ev, now)
        suspects, self._suspects = self._suspects, {}
        failed = sorted(suspects)
        for r in failed:
            self.detector.forget(r)
            self.rejoins.lost(r)  # a joiner that died is no longer wanted back (a new request can ask)
        self.dead.update(failed)
        if self.phase == "switching":  # the switch is off: plan from the last plan that ran
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
                           t_last_complete=max((r.end for r in self.iteration_records.values()), default=None),
                           predicted_before_us=self.plan.metrics.iteration_time)
            self.recoveries.append(rec)
            self._recovery = rec
        rec.failed = sorted(set(rec.failed) | set(failed))
        rec.causes.update({str(r): s.cause for r, s in suspects.items()})
        faults = [ev["t"] - self.t0 for ev in self._fired.values() if set(ev["ranks"]) & set(failed)]
        if faults and rec.t_fault is None:
            rec.t_fault = min(faults)
        if self.options.recovery == "restart":
            self._restart_everything(rec)
            return
        events = self._events_for(failed)
        rec.events += events
        solver = "drop-pipeline" if self.options.recovery == "drop-pipeline" else self._replan_solver()
        from schedc.replan import replan
        from schedc.validate import LostStageError

        restore = None
        replacements: list[int] = []
        try:
            plan = replan(self.plan, events, deadline=self.options.replan_deadline, solver=solver)
        except LostStageError as exc:
            plan, restore, replacements = self._checkpoint_fallback(rec, events, exc)
            if plan is None:
                return
        except SchedcError as exc:  # e.g. no plan fits in memory any more
            self._fail([error("E553", f"no plan can continue after {', '.join(events)}",
                              hint="see the reason below")] + list(exc.diagnostics))
            return
        rec.t_plan = self._now()
        s = plan.schedule.solver
        rec.solver = {"name": s.name, "status": s.status, "wall_s": round(s.wall_s, 4),
                      "stopped_by": s.stopped_by}
        rec.predicted_after_us = plan.metrics.iteration_time
        self._note("replan", f"replan: {'; '.join(events)} -> generation {old.number + 1}, "
                             f"{len(self._members(plan))} ranks, {plan.metrics.iteration_time / 1e3:.2f} ms "
                             f"per iteration (was {self.plan.metrics.iteration_time / 1e3:.2f}); "
                             f"{s.name} {s.status} in {s.wall_s:.3f} s"
                             + (" (the deadline ended its search)" if s.stopped_by == "deadline" else ""),
                   events=events, solver=rec.solver, predicted_us=plan.metrics.iteration_time)
        self._announce(plan, restore=restore, reason="; ".join(events))
        rec.to_generation = self.gen.number
        rec.t_announce = self._now()
        if replacements:
            self._start_workers(replacements)
        self.phase = "recovering"

    def _events_for(self, failed: list[int]) -> list[str]:
        """Replan events for ranks that died: a whole node as `fail node N`, else one GPU each."""
        spec = self.plan.spec
        per = spec.cluster.gpus_per_node
        out, covered = [], set()
        for node in sorted({spec.cluster.node_of(r) for r in failed}):
            ranks = range(node * per, min((node + 1) * per, self.world))
            if len(ranks) > 1 and all(r in failed or not spec.gpus[r].live for r in ranks):
                out.append(f"fail node {node}")
                covered.update(ranks)
        for r in failed:
            if r not in covered:
                g = spec.gpus[r]
                out.append(f"fail gpu(dp={g.dp}, pp={g.pp})")
        return out

    def _replan_solver(self) -> str:
        chosen = self.plan.spec.schedule.solver
        return chosen if chosen in ("cpsat", "greedy") else "cpsat"  # templates cannot re-route

    def _checkpoint_fallback(self, rec: Recovery, events: list[str], exc: SchedcError):
        """A stage lost every GPU: restore the latest checkpoint with replacements for that stage."""
        if self.restarts >= self.options.max_restarts:
            found = self._own_latest_checkpoint()
            where = (f"the latest complete checkpoint is `{found.path}`; resume from it with "
                     f"`schedc train {self.out} --resume` once the GPUs are replaced" if found else
                     "no checkpoint was written (train with --checkpoint-every K)")
            self._fail([error("E553", "a stage lost every GPU, so re-routing is impossible, and no restart is "
                                      f"left (--max-restarts {self.options.max_restarts})", hint=where)]
                       + list(exc.diagnostics))
            return None, None, []
        self.restarts += 1
        spec = self.plan.spec
        gone = set(self.dead)
        lost_stages = [s for s in range(spec.pp)
                       if not [g for g in spec.gpus if g.pp == s and g.live and g.rank not in gone]]
        replacements = sorted(g.rank for g in spec.gpus if g.pp in lost_stages)
        replacements = [r for r in replacements if r in gone or not spec.gpus[r].live]
        recover = [f"recover gpu(dp={spec.gpus[r].dp}, pp={spec.gpus[r].pp})" for r in replacements]
        from schedc.replan import replan

        plan = replan(self.plan, events + recover, deadline=self.options.replan_deadline,
                      solver=self._replan_solver())
        found = self._own_latest_checkpoint()
        restore = str(found.path) if found else "initial"
        rec.method = "checkpoint"
        rec.events += recover
        self.dead.difference_update(replacements)
        self._note("restart", f"stage(s) {lost_stages} lost every GPU: restoring "
                              f"{found.path.name if found else 'the initial weights'} with replacement "
                              f"process(es) for rank(s) {replacements} (restart {self.restarts} of "
                              f"{self.options.max_restarts})", stages=lost_stages, replacements=replacements,
                   restore=restore)
        return plan, restore, replacements

    def _own_latest_checkpoint(self) -> checkpoint.Checkpoint | None:
        """The newest complete checkpoint this run wrote (or resumed from) that still exists."""
        for path in reversed(self.checkpoints):
            if Path(path, "meta.json").is_file():
                return checkpoint.read(Path(path))
        return None

    def _restart_everything(self, rec: Recovery) -> None:
        """recovery="restart": stop every worker; restart all from the latest checkpoint, failed GPUs replaced."""
        survivors = [r for r in self.gen.members if r not in self.dead]
        for r in survivors:
            self.detector.forget(r)  # their exits are ours, not failures
        self._signal(survivors, "kill")
        deadline = time.monotonic() + 10
        while self.alive & set(survivors) and time.monotonic() < deadline:
            self.local.step(TICK)
            for ev in self.job.events():
                self._on_event(ev, self._now())
        found = self._own_latest_checkpoint()
        restore = str(found.path) if found else "initial"
        plan = self.initial_plan
        rec.t_plan = self._now()
        rec.events = [f"restart from {Path(restore).name if found else 'the initial weights'}"]
        self.dead.clear()
        self._note("restart", f"restarting every process from {Path(restore).name if found else 'the initial weights'}"
                              f" with the failed GPU(s) replaced", restore=restore)
        self._announce(plan, restore=restore, reason=rec.events[0])
        rec.to_generation = self.gen.number
        rec.t_announce = self._now()
        self._start_workers(self.gen.members)
        self.phase = "recovering"

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
        self._announce(self.plan, restore=None, reason="retry after a lost connection")
        self.phase = "recovering"

    # -- generations ---------------------------------------------------------------------------------------

    def _members(self, plan: Plan) -> list[int]:
        return [g.rank for g in plan.spec.gpus if g.live]

    def _announce(self, plan: Plan, *, restore: str | None, reason: str, start_at: int | None = None) -> None:
        from schedc.codegen.generate import program_name, render_programs

        number = 0 if self.gen is None else self.gen.number + 1
        schedule = plan.schedule
        if hasattr(schedule, "expand"):  # a symmetric plan: the live job runs one program per rank
            schedule = schedule.expand()
        files = render_programs(plan.spec, schedule, metrics=plan.metrics, out_name=str(self.out))
        members = self._members(plan)
        programs = {r: files[program_name(r, self.world)] for r in members}
        armed = [i.to_json() for i in self.injections if i.index not in self._fired]
        speeds = {g.rank: g.speed for g in plan.spec.gpus if g.live and g.speed < 1.0}
        gen = Generation(number, tuple(members), json.loads(files["programs.json"]), restore=restore,
                         injections=tuple(armed), reason=reason, start_at=start_at, speeds=speeds)
        self.job.announce(gen, programs)
        self.gen, self.plan = gen, plan
        self._ready, self._done = {}, set()
        self._unexplained = None
        now = self._now()
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
        plan_dir = None if number == 0 else str(self.out / "live" / f"gen-{number:04d}")
        self.generation_records.append(GenerationRecord(number, members, reason, restore, plan.metrics.iteration_time,
                                                        plan_dir, round(now, 4)))
        if number > 0:
            self._pending_write = (number, plan)

    def _switch(self, plan: Plan, *, kind: str, reason: str, ranks: list[int]) -> str | None:
        """Announce a planned switch to `plan` a little ahead; None, or why it was not made."""
        if self.phase != "running":
            return f"the run is {self.phase}"
        # Where the members are now (read after the planning that led here, which took time).
        fresh = self.job.heartbeats(self.gen.members)
        beats = [Beat.parse(fresh[r]) if r in fresh else self.detector.last_beat(r) for r in self.gen.members]
        furthest = max([b.iteration for b in beats if b is not None] + [self.completed])
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
        self.phase = "switching"
        self._note("switch", f"switch to generation {self.gen.number} at iteration {start_at} ({kind}): "
                             f"{before / 1e3:.2f} -> {plan.metrics.iteration_time / 1e3:.2f} ms per iteration",
                   switch=kind, start_at=start_at, generation=self.gen.number)
        return None

    def _write_generation(self, number: int, plan: Plan) -> None:
        """The generation's plan beside the compiled one, as `schedc compile -o` writes it (for the record)."""
        try:
            plan.write(self.out / "live" / f"gen-{number:04d}")
        except OSError as exc:
            self._note("warning", f"could not write the plan of generation {number}: {exc}")

    def _by_host(self, ranks) -> dict[int, list[int]]:
        by_host: dict[int, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self._host_of[r], []).append(r)
        return dict(sorted(by_host.items()))

    def _start_workers(self, ranks) -> None:
        for r in ranks:
            self.job.forget_heartbeat(r)  # a replacement must not inherit its predecessor's last beat
        for host, rs in self._by_host(ranks).items():
            if host == 0:
                self.local.start(rs)
            else:
                self.job.command(host, {"op": "start", "ranks": rs})
        self.alive.update(ranks)

    def _signal(self, ranks, name: str) -> None:
        for host, rs in self._by_host(ranks).items():
            if host == 0:
                self.local.signal(rs, name)
            else:
                self.job.command(host, {"op": "signal", "ranks": rs, "signal": name})

    def _fire_timed_injections(self, now: float) -> None:
        if self._training_started is None:
            return
        for inj in self.injections:
            m = inj.moment
            if m.kind == "time" and inj.index not in self._fired and now - self._training_started >= m.seconds:
                self._fired[inj.index] = {"t": time.time(), "ranks": list(inj.ranks), "pending": True}
                if inj.action == "rejoin":
                    self.rejoins.request(inj.ranks[0], f"injected `{inj}`")
                    continue
                for host in self._by_host(inj.ranks):
                    self.job.command(host, {"op": "inject", "id": inj.index, "rank": None})

    # -- the end -------------------------------------------------------------------------------------------

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
        self.phase = "finishing"
        self._finish_deadline = self._now() + FINISH_WAIT
        self.job.stop("finished")
        self._note("finished", f"{self.iterations} iterations done")

    def _fail(self, diagnostics: list[Diagnostic]) -> None:
        if self._failure is None:
            self._failure = diagnostics
            self._note("error", diagnostics[0].message)
        self.phase = "failed"

    def _teardown(self, reason: str) -> None:
        if self.job is None:
            return
        try:
            if self.gen is not None:
                self.job.abort(self.gen.number)
            self.job.stop(reason)
            for host in range(1, self.options.hosts):
                self.job.command(host, {"op": "stop"})
        except Exception:
            pass
        if self.local is not None:
            self.local.stop_all(grace=2.0)
        if self.options.hosts > 1:  # remote agents report their workers' exits: wait a little for them
            deadline = time.monotonic() + 5.0
            while self.alive - self.dead and time.monotonic() < deadline:
                try:
                    for ev in self.job.events():
                        if ev.get("kind") == "exit":
                            self.alive.discard(ev["rank"])
                except Exception:
                    break
                time.sleep(0.05)
        if self._pending_write is not None and self.phase == "done":
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

    def __init__(self, diagnostics, result: TrainResult):
        super().__init__(diagnostics)
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
