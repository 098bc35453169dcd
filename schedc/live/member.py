"""A rank's process in a live run: one generation after another, its state kept in memory.

The loop of `LiveWorker.run`:

1. wait for the newest generation (`membership.Generation`) that names
   this rank (or for ``stop``);
2. **join**: mark ``join/N/R`` and wait (abortably) until every member has,
   so no member builds process groups with a peer that is already gone;
3. **connect**: gloo groups for generation N under the store prefix
   ``gN/``: one over all members (point to point), one over this stage's
   members (the gradient all-reduce);
4. **resume**: restore a checkpoint (or the initial weights) when the
   generation says so; otherwise agree with every member on the iteration
   boundary to resume from (all-reduce MIN of the steps applied) and roll
   back the last step if this rank is one ahead (`schedc.live.rollback`);
5. **run** the generation's program for every remaining iteration,
   reporting each one; then report ``done`` and go back to 1 (a failure
   elsewhere may still roll the last iteration back).

Whenever the supervisor aborts the generation (its heartbeat thread sees
``abort``) or a peer's connection breaks, the iteration stops at the next
wait, the groups are dropped (which unblocks peers waiting on this rank),
the work of the interrupted iteration is forgotten, and the worker reports
``aborted`` with the steps it has applied. Weights and optimizer state stay
in memory. A program error (not a lost peer) ends the worker with a
diagnostic: that is a bug to report, not a GPU to route around.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from schedc.diagnostics import RunError, SchedcError, error, exception_site
from schedc.live.catchup import Donor, Joiner
from schedc.live.inject import Injection, Trigger
from schedc.live.member_files import StageFiles, _reason
from schedc.live.member_probe import SpeedProbe
from schedc.live.membership import Generation, Heartbeat, JobStore
from schedc.live.move import Held, move_in
from schedc.live.opclock import make_clock
from schedc.live.protocol import (Aborted, CaughtUp, Done, FireInjection, IterationDone, Left, Ready, Started,
                                   WorkerError)
from schedc.live.rollback import StepSnapshot, roll_back, rollback_target
from schedc.live.shadow import ShadowLink, ShadowStage, assignment, shadowed_stage
from schedc.live.stall import CgroupThrottle, StallClock
from schedc.runtime.manifest import Manifest
from schedc.runtime.placement import own_device

#: Exit status of a worker that stopped on an error of its own (it reported a diagnostic first).
EXIT_ERROR = 1
#: Seconds a worker waits for its agent to carry out an injection it asked for.
INJECT_WAIT = 10.0
#: Seconds a store request may wait (a key that a generation's process groups need, once every
#: member has joined, is there in milliseconds; a member dying in between makes the others wait this).
CONNECT_TIMEOUT = 15.0
_POLL = 0.005


def worker_main(store_host: str, store_port: int, rank: int, host: int, agent: str = "") -> None:
    """Entry of a worker process (started by the agent of `host` that holds lease `agent`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    import torch

    torch.set_num_threads(1)
    job = None
    try:
        job = JobStore.connect(store_host, store_port, timeout=CONNECT_TIMEOUT)
        LiveWorker(job, rank, host, agent).run()
    except SchedcError as exc:
        _report_error(job, rank, [d.to_json() for d in exc.diagnostics])
        os._exit(EXIT_ERROR)
    except BaseException as exc:  # a bug or a broken model: a diagnostic with the frame
        site = exception_site(exc)
        at = f" (at {site})" if site else ""
        _report_error(job, rank, [{"code": "E590", "message": f"rank {rank} failed: {type(exc).__name__}: {exc}{at}"}])
        os._exit(EXIT_ERROR)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: old process groups may still hold threads


def _report_error(job: JobStore | None, rank: int, diagnostics: list[dict]) -> None:
    if job is None:
        print("\n".join(f"error[{d['code']}]: {d['message']}" for d in diagnostics), file=sys.stderr)
        return
    try:
        job.report(WorkerError(rank=rank, diagnostics=tuple(diagnostics)))
    except Exception:
        pass


class LiveWorker(StageFiles, SpeedProbe):
    """One schedule rank's process across generations (see the module docstring)."""

    def __init__(self, job: JobStore, rank: int, host: int, agent: str = ""):
        self.job = job
        job.epoch = job.epoch_now()  # (`rank` is numbered in the newest epoch: `_follow_renames`)
        self.rank = rank
        self.host, self.agent = host, agent
        self.config = job.config()
        latest = job.latest_generation()  # (announced before its processes start)
        self.device = own_device(self.config.device, rank, job.generation(latest).gpu(rank) if latest >= 0 else rank)
        self.generation = -1
        self.iteration = -1
        self.ops = 0
        self.state = "idle"
        self._seq = 0
        self.rt = None
        self.snapshot: StepSnapshot | None = None
        self._moved = 0  # bytes of layers received in this generation's in-place move (`_resume`)
        # What this process ran before an in-place move, kept until the move's first iteration is
        # done everywhere: a failure during the move moves again from it (`moved["retry"]`).
        self._held: Held | None = None
        self._held_until = -1  # the move's first iteration
        self.shadow: ShadowStage | None = None  # --shadow: this rank's copy of the previous stage
        self.trigger = Trigger(())
        self._side_pool: ThreadPoolExecutor | None = None
        self._side_job = job.clone()  # the side thread's own store connection
        # The transfer's kind: $SCHEDC_TRANSFER (inherited from `schedc train`), else direct.
        self.donor = Donor(self._side_job, self._side, transfer=None, timeout=self.config.wait_timeout)
        self.joiner = Joiner(job, transfer=None, timeout=self.config.wait_timeout)
        self._switches: dict[int, Generation] = {}  # newer generations read while running
        self._clock = make_clock("cpu")  # times the computed ops (`_build`: the rank's device's)
        self._probing = threading.Event()  # set: a thread measures this GPU's speed now and then
        # How long this process was held stopped or by its CPU quota (a throttle: `schedc.live.stall`).
        self.stall = StallClock(throttled=CgroupThrottle(), process_time=time.process_time)
        self._stall_halt = threading.Event()
        self.heartbeat = Heartbeat(job.clone(), rank, self.config.heartbeat_interval, self._payload, (host, agent))

    # -- what the heartbeat thread sends, and the abort flag it keeps ---------------------

    def _payload(self) -> str:
        self._seq += 1
        rt = self.rt
        state = self.state
        if state == "run" and rt is not None and rt.transport is not None and getattr(rt.transport, "waiting", None):
            state = "wait"
        return f"{self._seq} {self.generation} {self.iteration} {self.ops} {state} {round(self.stall.stalled * 1000)}"

    def aborted(self) -> bool:
        return self.heartbeat.aborted >= self.generation >= 0

    def _interrupted(self) -> bool:
        """What ends a wait of this generation's transport: its abort, or the run's stop."""
        return self.aborted() or self.heartbeat.stopped

    # -- the generation loop -----------------------------------------------------------------

    def run(self) -> None:
        if self.config.stall_clock:
            self.stall.start(self._stall_halt)
        self.heartbeat.start()
        if self.config.probe:  # (--fail-slow act only)
            threading.Thread(target=self._probe_loop, name="schedc-probe", daemon=True).start()
        self.job.report(Started(self.rank, os.getpid(), self.host, agent=self.agent, epoch=self.job.epoch))
        number = self._next_generation(after=-1)
        while number is not None:
            gen = self.job.generation(number)
            if not self._follow_renames(gen):
                break  # re-partitioned in place without this process (it is ended anyway)
            if self.rank in gen.members:
                self._serve(gen)
            else:
                self._standby(gen)
            number = self._next_generation(after=gen.number)
        self._stall_halt.set()
        self.heartbeat.halt()

    def _follow_renames(self, gen: Generation) -> bool:
        """Take the rank this process has in `gen`'s epoch (the survivors of an in-place
        re-partition are numbered anew: `schedc.live.relayout`); False if it has none."""
        while self.job.epoch < gen.epoch:
            epoch = self.job.epoch + 1
            renamed = self.job.rename(epoch)
            if self.rank not in renamed:
                return False
            self.rank = renamed[self.rank]
            self.job.epoch = self._side_job.epoch = epoch
            self.heartbeat.rename(epoch, self.rank)
        return True

    def _next_generation(self, after: int) -> int | None:
        """The newest generation after `after`, or None once the run is stopped."""
        while True:
            if self.heartbeat.stopped or self.job.stopped():
                return None
            latest = self.job.latest_generation()
            if latest > after:
                self.heartbeat.check_agent(self.job)  # (one whose host has a new agent stops: never joins)
                return latest
            time.sleep(_POLL * 2)

    def _serve(self, gen: Generation) -> None:
        from schedc.runtime.transport import Interrupted

        self.generation = gen.number
        self.state = "join"
        manifest = Manifest.from_json(gen.manifest)
        held = None
        if gen.moved is not None and gen.moved.get("retry"):
            # The move of the generation before never finished: move again from what this process
            # ran before it (whatever the aborted move loaded is dropped). A process that holds no
            # stage of the layout before (started for the move) holds nothing still.
            held = self._held
            if held is None and self.rank in gen.moved["stage"] and self.rt is not None:
                held = Held(self.rt, self.snapshot, self.shadow)  # (it never began the aborted move)
            self.rt = self.shadow = None
        elif self.rt is not None and (gen.moved is not None or self._reshaped(manifest)
                                      or (gen.restore is not None and self._other_shadow(manifest))):
            # Other layers (a re-partition): a new stage, whose state comes from the others
            # (`schedc.live.move`) or from the generation's restore. The old one sends from here.
            held = Held(self.rt, self.snapshot, self.shadow)
            self.rt = self.shadow = None
        self._held = held if gen.moved is not None and gen.restore is None else None
        if self.rt is None:
            self.state = "build"  # (building the model: the supervisor does not count it as reconfiguring)
            self._build(manifest, gen)
            self.state = "join"
        self.trigger = Trigger([Injection.from_json(j) for j in gen.injections if self.rank in j["ranks"]])
        transport = None
        try:
            self._fire(self.trigger.at_recovery(gen.number))
            directive = self.heartbeat.directive or self.job.directive(self.rank)
            joiner = bool(directive and directive.get("role") == "join")
            if gen.start_at is not None and joiner and self.rt.steps_done < gen.start_at:
                self._catch_up_to(gen)  # a joiner: replay the donor's steps up to the switch
            self.job.join(gen.number, self.rank)
            self._wait_joined(gen)
            transport = self._connect(gen, manifest)
            self.rt.retarget(manifest, transport)
            self._link_shadow(manifest, gen)
            start, undone = self._resume(gen, transport, manifest, held)
            held = None  # (moved or restored; a move's old stage stays in `_held` until it has run once)
            self._held_until = start
            if gen.dump:  # save the survivors' state (own stages and shadows) as a checkpoint, then wait
                self._dump(gen)
                self.job.report(Ready(rank=self.rank, gen=gen.number, start=start, undone=undone, t=time.time(),
                                      shadow=self._shadow_valid()))
                return
            program = self._program(gen, manifest)
            self.job.report(Ready(rank=self.rank, gen=gen.number, start=start, undone=undone, t=time.time(),
                                  shadow=self._shadow_valid(), moved=self._moved))
            self._moved = 0
            self.state = "run"
            for it in range(start, self.config.iterations):
                if self.aborted():
                    raise Interrupted("aborted between iterations")
                if (self._held is not None and self.heartbeat.progress_generation == gen.number
                        and self.heartbeat.progress >= self._held_until):
                    # The move's first iteration is done everywhere: no move again. (In this generation:
                    # after a restore of an older checkpoint, the run's newest iteration is an older one's.)
                    self._held = None
                if self._switch_at(gen, it):  # a planned switch: leave in order, nothing to undo
                    if self.shadow is not None:
                        self.shadow.settle(transport, wait=True)
                    transport.flush()
                    self.job.report(Left(rank=self.rank, gen=gen.number, steps=self.rt.steps_done, t=time.time()))
                    return
                self.iteration = it
                self.donor.boundary(self.rt, self.heartbeat.directive)
                # An emulated op sleeps its planned time, which assumes the plan's speed for this
                # GPU; an injected slowdown is the GPU's true speed: sleep planned x planned/true.
                planned = gen.speed(self.rank) if self.config.emulate else 1.0
                self.rt.slowdown = self.trigger.slowdown(it) * planned
                transport.send_delay = self.trigger.link_delay(it)
                self._fire(self.trigger.at_iteration_start(it))
                self.rt.begin_iteration(it)
                self._clock.reset()  # (an interrupted iteration's ops are not this one's)
                t0 = time.time()
                self.snapshot.prefetch(self.rt.steps_done)  # the copy a rollback restores, written meanwhile
                program.iteration(self.rt)
                compute, planned = self._clock.take_iteration()  # measured and planned compute, seconds
                self.job.report(IterationDone(rank=self.rank, it=it, t0=t0, t1=time.time(), loss=self.rt.iteration_loss,
                                              gen=gen.number, steps=self.rt.steps_done, compute=compute,
                                              planned=planned, queued=self._clock.queued))
                if self.config.probe and (planned == 0) != self._probing.is_set():
                    self._probing.set() if planned == 0 else self._probing.clear()  # nothing timed: probe
                self.donor.after_step(self.rt)
                self._maybe_checkpoint(gen)
            transport.flush()
            self.state = "finish"  # (no ops counted: the stall rule gives it longer, `Detector.finish_timeout`)
            self._finish(gen)
        except (Interrupted, RunError) as exc:
            if isinstance(exc, RunError) and not _lost_peer(exc):
                raise  # the program broke a rule: a bug, not a failure to route around
            self.job.report(Aborted(rank=self.rank, gen=gen.number, steps=self.rt.steps_done, reason=_reason(exc),
                                    t=time.time()))
        finally:
            self._probing.clear()
            if transport is not None:
                if self.shadow is not None:
                    self.shadow.settle(transport, wait=False)
                transport.close()
            if self.rt is not None:
                self.rt.abandon_iteration()
            self.state = "idle"

    def _switch_at(self, gen: Generation, it: int) -> bool:
        """Whether a newer generation starts at iteration `it` (a planned switch). Read from the
        store at every boundary (one small read), not from the heartbeat thread's last poll."""
        latest = self.job.latest_generation()
        if latest <= gen.number:
            return False
        if latest not in self._switches:
            self._switches[latest] = self.job.generation(latest)
        start_at = self._switches[latest].start_at
        return start_at is not None and it >= start_at

    def _standby(self, gen: Generation) -> None:
        """Not a member of `gen`: wait for a newer generation, catching up when told to, and
        measuring this GPU's speed now and then (an excluded slow GPU comes back when it is well)."""
        self.generation = gen.number
        self.state = "standby"
        if self.rt is None:
            self.state = "build"
            self._build(Manifest.from_json(gen.manifest), gen)
            self.state = "standby"
        self.trigger = Trigger([Injection.from_json(j) for j in gen.injections if self.rank in j["ranks"]])
        reported = None
        if self.config.probe:
            self._probing.set()
        try:
            while not self.heartbeat.stopped and self.heartbeat.latest <= gen.number:
                if self._follow() and self.joiner.steps != reported:
                    reported = self.joiner.steps
                    self.job.report(CaughtUp(rank=self.rank, session=self.joiner.session, steps=reported,
                                         bytes=self.joiner.received, t=time.time()))
                time.sleep(_POLL)
        finally:
            self._probing.clear()

    def _catch_up_to(self, gen: Generation) -> None:
        """Replay the donor's steps until this rank has `gen.start_at` of them (or the switch is aborted)."""
        from schedc.runtime.transport import Interrupted

        while self.rt.steps_done < gen.start_at:
            if self.aborted() or self.heartbeat.stopped:
                raise Interrupted(f"generation {gen.number} was aborted while rank {self.rank} caught up")
            if not self._follow():
                time.sleep(_POLL)
        self.job.report(CaughtUp(rank=self.rank, session=self.joiner.session, steps=self.rt.steps_done,
                                         bytes=self.joiner.received, t=time.time()))

    def _follow(self) -> bool:
        """One step of catching up from the donor (`Joiner.follow`); True when something was applied.
        The weights are then the donor's: the rollback copy held before is no state of theirs."""
        if not self.joiner.follow(self.rt, self.heartbeat.directive):
            return False
        self.snapshot.invalidate()
        if self.shadow is not None:  # the weights are the donor's; the shadow was not stepped with them
            self.shadow.valid = False
        return True

    def _side(self) -> ThreadPoolExecutor:
        """The one side thread (checkpoints, catch-up state): training goes on while it stores."""
        if self._side_pool is None:
            self._side_pool = ThreadPoolExecutor(1, thread_name_prefix="schedc-side")
        return self._side_pool

    # -- steps of a generation -----------------------------------------------------------------

    def _build(self, manifest: Manifest, gen: Generation) -> None:
        import dataclasses

        from schedc.runtime.primitives import Runtime

        if self.rank not in manifest.coords:  # a rank on standby: not in this plan, but its stage is known
            coords = {**manifest.coords, self.rank: gen.coords_of(self.rank, self.config.coords)}
            manifest = dataclasses.replace(manifest, coords=coords)

        self.rt = Runtime(manifest, self.rank, transport=None, emulate=self.config.emulate, observer=self,
                          reduce_loss=True, device=self.device)
        self._clock = make_clock(self.rt.device)
        if str(self.rt.device).startswith("cuda") and not self.config.emulate:
            from schedc.runtime import gpusleep

            gpusleep.cycles_per_us(self.rt.device)  # now, not inside the first op an injected slowdown slows
        self.snapshot = StepSnapshot(self.rt.module, getattr(self.rt, "optimizer", None))
        shadowed = shadowed_stage(self.rt.stage, manifest.pp) if self.config.shadow and gen.shadow else None
        if shadowed is not None:
            self.shadow = ShadowStage(manifest, shadowed, emulate=self.config.emulate, device=self.device)
            self.rt.shadow = self.shadow
        if self.config.probe and not self.config.emulate:  # the healthy time of one probe (`_probe`)
            import torch

            stage = self.rt.stage
            sample = self.rt.batch(0, 0, 0)[0]
            noise = torch.Generator().manual_seed(0)  # its own generator: the run's random state is untouched
            self._probe_input = sample if stage == 0 else torch.randn(self.rt.shapes[stage - 1][0],
                                                                      generator=noise).to(self.device)
            times = [self._clock.timed(self._probe_op) for _ in range(3)]
            self._probe_base = sorted(times)[1]

    def _wait_joined(self, gen: Generation) -> None:
        from schedc.runtime.transport import Interrupted

        while not self.job.all_joined(gen.number, gen.members):
            if self.aborted():
                raise Interrupted(f"generation {gen.number} was aborted while its members joined")
            time.sleep(_POLL)

    def _connect(self, gen: Generation, manifest: Manifest):
        """Generation `gen`'s gloo groups. They form on a thread of their own while this one
        watches the abort flag: gloo's full-mesh connect retries a member that died after it
        published its address until the group's timeout (`wait_timeout`, minutes), and a
        generation aborted meanwhile must not hold its survivors that long. An abandoned
        connect ends on its own (its own store connection, its generation's own keys)."""
        import torch.distributed as dist

        from schedc.runtime.transport import Interrupted, Transport

        timeout = timedelta(seconds=self.config.wait_timeout)
        n = gen.number
        mine = [r for r in gen.members if manifest.coords[r][1] == self.rt.stage]
        store = self.job.store.clone()  # (the abandoned thread may still use it: not the main connection)
        formed: dict = {}

        def form() -> None:
            try:
                formed["world"] = dist.ProcessGroupGloo(dist.PrefixStore(f"g{n}/world/", store),
                                                        gen.members.index(self.rank), len(gen.members), timeout)
                formed["stage"] = None
                if len(mine) > 1:
                    formed["stage"] = dist.ProcessGroupGloo(dist.PrefixStore(f"g{n}/stage{self.rt.stage}/", store),
                                                            mine.index(self.rank), len(mine), timeout)
            except BaseException as exc:  # a member died while the groups formed (or the store timed out)
                formed["error"] = exc

        thread = threading.Thread(target=form, name=f"schedc-connect-g{n}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL * 4)
            if thread.is_alive() and (self.aborted() or self.heartbeat.stopped):
                raise Interrupted(f"generation {n} was aborted while its groups formed")
        if "error" in formed:
            raise RunError([error("E530", f"rank {self.rank} could not connect generation {n}: "
                                          f"{_reason(formed['error'])}")]) from None
        return Transport(manifest, self.rank, self.config.wait_timeout, world=formed["world"], stage=formed["stage"],
                         interrupted=self._interrupted, device=self.device)  # (gloo: tensors go through the CPU)

    def _reshaped(self, manifest: Manifest) -> bool:
        """Whether `manifest` gives this rank other layers than its stage holds (or another rank
        number: the survivors of an in-place re-partition are numbered anew)."""
        rt = self.rt
        if rt.rank != self.rank or self.rank not in manifest.coords:
            return rt.rank != self.rank
        stage = manifest.coords[self.rank][1]
        if manifest.partition is None or rt.partition is None:
            return (stage, manifest.pp) != (rt.stage, rt.manifest.pp)
        return tuple(manifest.partition[stage]) != tuple(rt.partition[rt.stage])

    def _other_shadow(self, manifest: Manifest) -> bool:
        """Whether the shadow this rank holds copies another stage, or other layers, than the one
        `manifest` gives it (a re-partition that kept this rank's own layers and number)."""
        copy = self.shadow
        if copy is None or not self.config.shadow:
            return False
        held = assignment(manifest).get(self.rank)
        if held is None or held[0] != copy.stage:
            return True
        if copy.partition is None:  # (emulated: no layers)
            return False
        if manifest.partition is None:
            return len(copy.partition) != manifest.pp
        return tuple(manifest.partition[held[0]]) != tuple(copy.layers)

    def _resume(self, gen: Generation, transport, manifest: Manifest, held: Held | None) -> tuple[int, bool]:
        """(iteration to start from, whether this rank undid its last step)."""
        import torch

        if gen.moved is not None and gen.restore is None:
            start, undone, self._moved = move_in(gen, manifest, self.rank, transport, held, self.rt, self.shadow)
            self.snapshot.invalidate()
            return start, undone
        if held is not None and gen.restore is None:
            raise RunError([error("E552", f"rank {self.rank} was given other layers with no state for them",
                                  hint="this is a bug in schedc's live runtime; please report it")])
        if gen.restore is not None:
            self._restore(gen.restore)
        # One all-reduce MIN of (steps, -steps): the fewest and the most steps any member applied.
        # Also after a restore (every member holds the same steps then): it is the generation's
        # first collective, which waits for every member to have formed its groups, and which
        # an abort ends even when a member abandoned the generation while forming them.
        steps = torch.tensor([self.rt.steps_done, -self.rt.steps_done], dtype=torch.int64)
        transport.all_reduce_min(steps, "the members' step counts")
        low, high = int(steps[0]), -int(steps[1])
        if gen.dump:
            low = self._dump_target(gen, transport, low, high)
        target = rollback_target([low, high])
        undone = roll_back(self.rt.steps_done, target, self.snapshot)
        self.rt.steps_done = target
        if self.shadow is not None:  # (it lags one step: never ahead of the target, nothing to undo)
            self.shadow.catch_up(target)
        return target, undone

    def _dump_target(self, gen: Generation, transport, low: int, high: int) -> int:
        """The steps a dump generation saves: the fewest any member holds (`low`), or fewer where a
        lost stage's shadows hold fewer (a shadow lags its holder by a step, and a stage killed
        before its all-reduce never took the step its survivors took); a shadow that would need
        a survivor to go back more than one step is given up instead. Every member takes part."""
        import torch

        mine = low
        copy = self.shadow
        if copy is not None:
            coords = gen.manifest["coords"]
            if not any(coords[str(r)][1] == copy.stage for r in gen.members):  # its stage is lost
                mine = copy.steps_to_keep(low, high)
        target = torch.tensor([mine], dtype=torch.int64)
        transport.all_reduce_min(target, "the steps the lost stages' shadows hold")
        return int(target[0])

    def _link_shadow(self, manifest: Manifest, gen: Generation) -> None:
        """This rank's part in the plan's gradient streaming (--shadow): whom it sends to, and
        from whom its shadow's gradient comes (none when the plan shadows another stage here).
        A plan without room for shadows (`Generation.shadow`) streams nothing, and the shadow
        this rank held is dropped (its memory is the plan's now)."""
        if not self.config.shadow:
            return
        if not gen.shadow:
            self.shadow = self.rt.shadow = None
            self.rt.shadow_to, self.rt.shadow_from = (), None
            return
        link = ShadowLink.of(manifest, self.rank)
        if self._other_shadow(manifest):  # (a copy of a stage this plan does not give it: never exact again)
            self.shadow = self.rt.shadow = None
        self.rt.shadow_to = link.sends_to
        self.rt.shadow_from = link.source if self.shadow is not None else None

    def _shadow_valid(self) -> bool:
        """Whether this rank's shadow holds its stage exactly, at this rank's own step count."""
        return bool(self.shadow is not None and self.shadow.valid and self.shadow.steps == self.rt.steps_done)

    def _program(self, gen: Generation, manifest: Manifest):
        from schedc.runtime.program import program_from_text

        name = manifest.programs[self.rank]
        return program_from_text(self.job.program_file(gen.number, name), f"<generation {gen.number}, {name}>",
                                 manifest, self.rank)

    def _finish(self, gen: Generation) -> None:
        if self._side_pool is not None:
            self._side_pool.shutdown(wait=True)  # checkpoints and catch-up data are stored
            self._side_pool = None
        if self.config.want_weights and not self.config.emulate and self._stage_writer(gen):
            import torch

            buf = io.BytesIO()
            torch.save(self.rt.state_dict(), buf)
            self.job.put_weights(gen.number, self.rt.stage, buf.getvalue())
        self.job.report(Done(rank=self.rank, gen=gen.number, steps=self.rt.steps_done, t=time.time()))

    # -- injection ---------------------------------------------------------------------------

    def _fire(self, inj: Injection | None) -> None:
        """Ask this host's agent to carry out `inj` on its targets, this process among them, and
        wait here to be killed or stopped: the fault lands exactly at this point of the program."""
        if inj is None:
            return
        self.job.command(self.host, FireInjection(id=inj.index, rank=self.rank, iteration=self.iteration,
                                                  t=time.time(), ranks=inj.ranks))
        deadline = time.monotonic() + INJECT_WAIT
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise RunError([error("E563", f"rank {self.rank}: injection `{inj}` was not carried out within "
                                      f"{INJECT_WAIT:g} s", hint="its agent did not answer; see the agent's output")])

    # -- OpObserver: called by the runtime around every op --------------------------------------

    def op_ready(self, kind: str, d: int, mb: int | None) -> None:
        if self.trigger:
            self._fire(self.trigger.at_op(self.iteration, "during", kind, mb))
        self._clock.op_started()  # (after the op's input came: waiting for peers is not counted)

    def step_starts(self, steps_done: int) -> None:
        """The copy that a rollback restores is taken here, after the stage's all-reduce and just
        before the step: an all-reduce that a failure interrupts (it may complete on some members
        and not on others, and a member may run on into the next iteration's) never replaces the
        copy from before the step this rank did apply."""
        self.snapshot.take(steps_done)

    def op_done(self, kind: str, d: int, mb: int | None, us: int) -> None:
        if kind != "O":  # O includes its all-reduce: waiting for peers is not this GPU's speed
            self._clock.op_ended(us)
        self.ops += 1
        if self.trigger:
            self._fire(self.trigger.at_op(self.iteration, "after", kind, mb))


def _lost_peer(exc: RunError) -> bool:
    """A peer's connection broke or a wait ran out: the run lost a member, not this rank's fault."""
    return any(code in ("E530", "E531", "E532") for code in exc.codes)
