"""One simulated run from a seed: its fault schedule, the invariants checked at every step, its outcome.

`simulate(seed)` compiles (once per process) a 3x3 plan, draws a fault
schedule from the seed, and runs the real `Supervisor` against a `SimWorld`
until the run ends or a bound passes. Checked as it goes:

- **bounded**: the run ends (finished, or stopped with a diagnostic) within
  `BOUND_S` simulated seconds; never silent;
- **exact**: every rank's stage state holds each iteration's update once,
  in order, at every step (`SimWorld.applied`); a finished run's final
  members hold all of them; every complete checkpoint holds exactly the
  steps it names, each stage's file written by a generation of its layout;
- **one generation at a time**: ranks running iterations of two
  generations at once only across a planned switch (the old one before its
  start, the new one from it);
- **no healthy GPU declared failed**: every rank the supervisor declares
  failed was killed, stopped or hung shortly before; no rank the world never
  slowed is reported slow (one the scheduler starves, `starve`: its compute
  takes longer because its thread waits for a CPU, is not slowed);
- **diagnostics that are not bugs**: a run that stops does so with a
  diagnostic, and not with one that says schedc broke its own rules (E551,
  E552, E590, "every rank finished, yet ..."), nor calls the job stuck
  (E554, "every rank waits") while a member has been silent for longer than
  the stall rule waits for (it waited for a dead peer: the silence rule's
  case).

One scenario in eight (its own random stream, so the other seeds' schedules
stay as they were) runs on three hosts (a node each) and loses one that is
not the supervisor's: its agent and every process on it are gone at once,
no exit is ever reported, nothing can be started there (until, in some,
it comes back: a new agent registers and its GPUs are asked back); on a
patient cluster (``--detect-timeout`` 15 s, past the 10 s stall bound).

``python -m schedc.live.sim --schedules N [--first S]`` runs N seeds and
prints every violation with the seed that replays it.
"""

from __future__ import annotations

import functools
import math
import random
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from schedc.diagnostics import SchedcError
from schedc.live.options import TrainOptions
from schedc.live.protocol import Phase, RejoinAsked
from schedc.live.sim.world import SimWorld

#: Simulated seconds a run may take before it counts as hung. A fault-free run takes ~3 s; the
#: worst legitimate path (a transition tried again, then every process restarted, each waiting
#: out `TRANSITION_S`, plus stall and start-up limits) stays well inside this.
BOUND_S = 400.0
TRANSITION_S = 20.0
ITERATIONS = 40
#: ... and of a run that loses a host: long enough after the loss is found (15 s of silence) for
#: the host to come back and its GPUs to rejoin before the run ends.
HOST_ITERATIONS = 120
#: The options of every simulated run besides these (tests change them).
OPTIONS = dict(transition_timeout=TRANSITION_S, replan_deadline=0.5, checkpoint_every=8)

SPEC = """
model "m" { source = "schedc.models.mlp:build" }
cluster { dp = 3  pp = 3  gpus_per_node = 3
          gpu { memory = 1GiB }  link { latency = 50us  bandwidth = 1GB/s } }
stages { all { forward = 2ms  backward_input = 2ms  backward_weight = 1ms  optimizer = 0.5ms
               activation = 4MiB  stash = 1MiB  static = 16MiB  send = 64KiB } }
train { microbatches = 3  optimizer = sgd  lr = 0.05  iterations = 40 }
schedule { solver = greedy }
"""

_COMPILED: dict[str, Path] = {}


def compiled_plan() -> Path:
    """The simulation's plan, compiled once per process into a temporary folder."""
    if "plan" not in _COMPILED:
        import schedc

        root = Path(tempfile.mkdtemp(prefix="schedc-sim-"))
        schedc.compile(SPEC).write(root / "plan")
        _COMPILED["plan"] = root / "plan"
    return _COMPILED["plan"]


@dataclass(frozen=True)
class Fault:
    """One fault: `action` on `ranks`, `delay` seconds after its trigger (`when`: ``training``, the
    first iteration; ``switching`` / ``recovering``: the first such phase after the previous fault)."""

    when: str
    delay: float
    action: str  # kill, stop, hang, slow, starve, slow_link, pause, forkserver, rejoin, stage, host, agent
    # (`stage`: kill every GPU of stage ranks[0] (mod its stage count) of the plan running then;
    # `host`: host ranks[0] (1 or 2 of three) is lost with its agent and processes, no exit seen;
    # `host_back`: it is back, a new agent registers, and each of its GPUs is asked back;
    # `agent`: host ranks[0]'s agent alone dies, another takes over `duration` later: the workers
    # run on meanwhile, unseen, and stop by themselves at the takeover)
    ranks: tuple[int, ...] = ()
    duration: float = 0.0
    factor: float = 1.0  # slow: the slowdown; starve: its compute's, from waiting for a CPU; slow_link: seconds added to each message

    def __str__(self) -> str:
        timed = ("stop", "slow", "starve", "slow_link", "pause", "agent")
        extra = f" for {self.duration:.2f} s" if self.duration and self.action in timed else ""
        extra += f" x{self.factor:.1f}" if self.factor != 1.0 else ""
        return f"{self.delay:.2f} s after {self.when}: {self.action} {list(self.ranks)}{extra}"


def fault_schedule(seed: int, world: int = 9, pp: int = 3) -> list[Fault]:
    """The faults of run `seed`, in order: half the seeds draw 0-3 faults at random, the others
    follow a scenario that aims a fault at a transition (a planned switch, a recovery, a
    checkpoint restore, a rejoin), where protocols break."""
    if random.Random(f"{seed}/host").random() < 1 / 8:
        return host_lost_schedule(seed, world)
    if random.Random(f"{seed}/agent").random() < 1 / 16:
        return agent_replaced_schedule(seed, world)
    rng = random.Random(seed)
    phase_delay = lambda: rng.choice([0.0, 0.005, 0.02, 0.05, 0.1])  # noqa: E731
    rank = lambda: rng.randrange(world)  # noqa: E731
    scenario = rng.choice(["random", "random", "random", "switch", "recovery", "rejoin", "stage"])
    if scenario == "switch":  # a slow GPU makes the run switch plans; a failure lands in the switch
        return [Fault("training", round(rng.uniform(0.6, 1.0), 3), "slow", (rank(),), duration=3.0,
                      factor=rng.choice([3.0, 4.0])),
                Fault("switching", phase_delay(), rng.choice(["kill", "kill", "stop", "hang"]), (rank(),),
                      duration=5.0)]
    if scenario == "recovery":  # a second failure while the first is recovered
        return [Fault("training", round(rng.uniform(0, 1.0), 3), "kill", (rank(),)),
                Fault("recovering", phase_delay(), rng.choice(["kill", "kill", "stop", "forkserver"]), (rank(),),
                      duration=5.0)]
    if scenario == "rejoin":  # a GPU is lost, comes back, and something fails while it rejoins
        r = rank()
        return [Fault("training", round(rng.uniform(0, 0.5), 3), "kill", (r,)),
                Fault("training", round(rng.uniform(0.2, 0.6), 3), "rejoin", (r,)),
                Fault(rng.choice(["training", "switching"]), phase_delay(), rng.choice(["kill", "stop"]),
                      (rng.choice([r, rank()]),), duration=5.0)]
    if scenario == "stage":  # a burst takes a whole stage: a checkpoint restore, then another fault
        stage = rng.randrange(pp)
        burst = set(range(stage, world, pp))
        if rng.random() < 0.3:  # and a GPU more: survivors that equal pipelines cannot all use (holes, spares)
            burst.add(rank())
        out = [Fault("training", round(rng.uniform(0, 1.0), 3), "kill", tuple(sorted(burst))),
               Fault("recovering", phase_delay(), rng.choice(["kill", "stop", "pause", "forkserver"]), (rank(),),
                     duration=rng.choice([1.0, 5.0]))]
        then = rng.random()
        if then < 0.4:  # later, a whole stage of the layout running then (a second re-partition)
            out.append(Fault("training", round(rng.uniform(0.3, 1.5), 3), "stage", (rng.randrange(pp),)))
        elif then < 0.8:  # the lost GPUs come back (the job grows), and something fails while it grows
            out += [Fault("training", round(rng.uniform(0.1, 0.6), 3), "rejoin", (r,))
                    for r in range(stage, world, pp)]
            out.append(Fault("recovering", phase_delay(), rng.choice(["kill", "stop", "kill"]), (rank(),),
                             duration=rng.choice([1.0, 5.0])))
        return out
    faults = []
    for i in range(rng.choice([0, 1, 1, 2, 2, 3])):
        when = "training" if i == 0 else rng.choice(["training", "switching", "recovering", "recovering"])
        action = rng.choice(["kill", "kill", "kill", "stop", "stop", "hang", "slow", "slow", "slow_link", "pause",
                             "forkserver", "rejoin", "stage", "starve"])
        delay = round(rng.uniform(0.0, 1.5), 3) if when == "training" else phase_delay()
        if action == "stage":
            stage = rng.randrange(pp)
            faults.append(Fault(when, delay, "kill", tuple(range(stage, world, pp))))
        elif action == "stop":
            faults.append(Fault(when, delay, "stop", (rank(),), duration=rng.choice([0.5, 1.5, 5.0, 8.0])))
        elif action == "slow":
            faults.append(Fault(when, delay, "slow", (rank(),), duration=round(rng.uniform(0.5, 3.0), 2),
                                factor=rng.choice([2.0, 3.0, 4.0])))
        elif action == "starve":  # a loaded host's scheduler runs one rank less: its GPU is healthy
            faults.append(Fault(when, delay, "starve", (rank(),), duration=round(rng.uniform(1.0, 4.0), 2),
                                factor=rng.choice([1.5, 2.0, 3.0])))
        elif action == "slow_link":
            faults.append(Fault(when, delay, "slow_link", (rank(),), duration=round(rng.uniform(0.5, 3.0), 2),
                                factor=rng.choice([0.005, 0.02])))
        elif action == "pause":
            faults.append(Fault(when, delay, "pause", duration=round(rng.uniform(1.0, 6.0), 2)))
        elif action in ("kill", "hang", "rejoin"):
            faults.append(Fault(when, delay, action, (rank(),)))
        else:
            faults.append(Fault(when, delay, action))
    return faults


#: A host lost is found by silence alone: on a patient cluster (the multi-host runs' setting) that
#: takes longer than the stall bound, so every survivor waits for a dead peer meanwhile.
HOST_DETECT_S = 15.0


def host_lost_schedule(seed: int, world: int = 9) -> list[Fault]:
    """A host lost (not the supervisor's), sometimes then another fault while the run recovers
    from it, or back (before or after its loss is found), or lost itself while the run recovers
    from a GPU killed first."""
    rng = random.Random(f"{seed}/host-schedule")
    host = Fault("training", round(rng.uniform(0.1, 1.2), 3), "host", (1 + rng.randrange(2),))
    if rng.random() < 0.3:  # lost while the run recovers from a GPU killed first
        return [Fault("training", round(rng.uniform(0.1, 1.2), 3), "kill", (rng.randrange(world),)),
                replace(host, when="recovering", delay=rng.choice([0.0, 0.02, 0.1, 0.5]))]
    out = [host]
    if rng.random() < 0.4:  # it comes back once the run recovers without it, and its GPUs are asked back
        out.append(Fault("recovering", rng.choice([0.2, 1.0, 2.0]), "host_back", host.ranks))
        early = random.Random(f"{seed}/host-early")  # (its own stream: the draws above stay as they were)
        if early.random() < 0.4:  # ... or before its loss is found (a quick reboot): its new agent says so
            out[-1] = Fault("training", early.choice([0.5, 3.0, 8.0]), "host_back", host.ranks)
    elif rng.random() < 0.5:
        out.append(Fault("recovering", rng.choice([0.0, 0.02, 0.1]), rng.choice(["kill", "stop"]),
                         (rng.randrange(world),), duration=rng.choice([1.0, 5.0])))
    return out


def agent_replaced_schedule(seed: int, world: int = 9) -> list[Fault]:
    """A host's agent alone dies and another takes the host over 5.5 or 8 s later (restarted by an
    operator or systemd): its workers run on unseen meanwhile and stop by themselves at the
    takeover; sometimes during the recovery from a GPU killed first, or followed by another fault
    while the run recovers from it."""
    rng = random.Random(f"{seed}/agent-schedule")
    agent = Fault("training", round(rng.uniform(0.1, 1.2), 3), "agent", (1 + rng.randrange(2),),
                  duration=rng.choice([5.5, 8.0]))  # (until another agent takes the host over)
    if rng.random() < 0.3:
        return [Fault("training", round(rng.uniform(0.1, 1.2), 3), "kill", (rng.randrange(world),)),
                replace(agent, when="recovering", delay=rng.choice([0.0, 0.02, 0.1, 0.5]))]
    if rng.random() < 0.5:
        return [agent, Fault("recovering", rng.choice([0.0, 0.02, 0.1]), rng.choice(["kill", "stop"]),
                             (rng.randrange(world),), duration=rng.choice([1.0, 5.0]))]
    return [agent]


@dataclass
class Outcome:
    seed: int
    faults: list[Fault]
    result: str = ""  # finished, stopped (with a diagnostic), hung
    code: str | None = None  # the diagnostic's code, when stopped
    hint: str = ""  # and its hint
    sim_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # the supervisor's notes, for the replay
    world_log: list[tuple[float, str]] = field(default_factory=list)
    recoveries: list = field(default_factory=list)  # the supervisor's `Recovery` records

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {self.result}" + (f" ({self.code})" if self.code else "")
                 + f" after {self.sim_s:.2f} simulated s; faults: " + ("; ".join(map(str, self.faults)) or "none")]
        lines += [f"  VIOLATION: {v}" for v in self.violations]
        if self.violations:
            lines += ["  supervisor:"] + [f"    {e}" for e in self.events[-25:]]
            lines += ["  world:"] + [f"    [{t:8.3f}] {w}" for t, w in self.world_log[-25:]]
        return "\n".join(lines)


class _Checker:
    """Fires the faults at their triggers and checks the invariants after every step."""

    def __init__(self, sup, world: SimWorld, faults: list[Fault], options: TrainOptions):
        self.sup, self.world, self.options = sup, world, options
        self.pending = list(faults)
        self.armed_at: float | None = None  # when the next fault's trigger was met
        self.trouble: dict[int, list[list]] = {}  # rank -> [start, end, what] windows it was stopped/hung/dead
        self.slowed: set[int] = set()
        self.timers: list[tuple[float, str, tuple[int, ...]]] = []  # (at, what, ranks): ends of faults
        self.seen_events = 0
        world.on_rename.append(self._renamed)

    def _renamed(self, renamed: dict[int, int]) -> None:
        """The survivors were numbered anew: what is kept by rank follows them (the events so
        far name ranks as they were: they are checked first)."""
        self._check_events(self.world.now)
        self.timers = [(at, what, tuple(renamed[r] for r in ranks if r in renamed)) for at, what, ranks in self.timers]
        self.trouble = {renamed[r]: w for r, w in self.trouble.items() if r in renamed}
        self.slowed = {renamed[r] for r in self.slowed if r in renamed}

    def __call__(self) -> None:
        world = self.world
        now = world.now
        for at, what, ranks in [t for t in self.timers if t[0] <= now]:
            self.timers.remove((at, what, ranks))
            if what == "cont":
                world.signal(ranks, "cont")
                self._trouble_ends(ranks, now)
            elif what == "fast":
                for r in ranks:
                    world.slow.pop(r, None)
                    world.starved.pop(r, None)
                    world.link_delay.pop(r, None)
        self._fire(now)
        self._check_events(now)
        self._check_generations()

    # -- faults ------------------------------------------------------------------------------

    def _fire(self, now: float) -> None:
        if not self.pending or self.sup._training_started is None:
            return
        f = self.pending[0]
        if self.armed_at is None:
            trigger = {"training": True, "switching": self.sup.phase == Phase.SWITCHING,
                       "recovering": self.sup.phase == Phase.RECOVERING}[f.when]
            if not trigger:
                return
            self.armed_at = now
        if now < self.armed_at + f.delay:
            return
        self.pending.pop(0)
        self.armed_at = None
        world = self.world
        world.note(f"fault: {f}")
        if f.action == "stage":
            spec = self.sup.plan.spec
            f = replace(f, action="kill", ranks=tuple(g.rank for g in spec.gpus if g.live and g.pp == f.ranks[0] % spec.pp))
            world.note(f"stage {f.ranks} of the running plan")
        if f.action == "host":
            fleet = world.agents
            for r, w in sorted(world.workers.items()):  # (a real rank spends much of an iteration blocked
                # in a receive: its last beat before its host went says it waited, not computed)
                if fleet.host_of(r) == f.ranks[0] and w.alive and w.beating and w.state == "run":
                    world.job.beat(r, w.payload().replace(" run", " wait"))
            for r in fleet.lose(f.ranks[0]):
                self.trouble.setdefault(r, []).append([now, float("inf"), "host"])
                self.slowed.add(r)
        elif f.action == "agent":  # (another agent takes over `duration` later: at least the lease's 5 s)
            world.agents.agent_dies(f.ranks[0])
            world.later(f.duration, lambda host=f.ranks[0]: self._agent_replaced(host))
        elif f.action == "host_back":  # (and `schedc rejoin` for each of its GPUs, named as the job named them)
            world.agents.restore(f.ranks[0])
            gpus = self.sup.recovery.initial_plan.spec.gpus
            for r in world.agents.gpus_of(f.ranks[0]):  # (once the agent is seen up, as an operator would)
                ask = RejoinAsked(event=f"recover gpu(dp={gpus[r].dp}, pp={gpus[r].pp})", t=world.time() + 0.5)
                world.later(0.5, lambda ask=ask: world.job.report(ask))
        elif f.action == "kill":
            for r in world.signal(f.ranks, "kill"):
                self.trouble.setdefault(r, []).append([now, float("inf"), "kill"])
        elif f.action == "stop":
            for r in world.signal(f.ranks, "stop"):  # (descheduled, SIGSTOP, a VM paused)
                self.trouble.setdefault(r, []).append([now, float("inf"), "stop"])
                self.slowed.add(r)  # (stopped a while, it was slow: a report of that is right)
            self.timers.append((now + f.duration, "cont", f.ranks))
        elif f.action == "hang":
            for r in f.ranks:
                w = world.workers.get(r)
                if w is not None and w.alive:
                    w.hung = True
                    self.trouble.setdefault(r, []).append([now, float("inf"), "hang"])
        elif f.action == "slow":
            for r in f.ranks:
                world.slow[r] = f.factor
                self.slowed.add(r)
            self.timers.append((now + f.duration, "fast", f.ranks))
        elif f.action == "starve":  # (not slowed: its GPU is healthy, a slow report of it is a false alarm)
            for r in f.ranks:
                world.starved[r] = f.factor
            self.timers.append((now + f.duration, "fast", f.ranks))
        elif f.action == "slow_link":  # `factor`: seconds added to every message it sends
            for r in f.ranks:
                world.link_delay[r] = f.factor
            self.timers.append((now + f.duration, "fast", f.ranks))
        elif f.action == "pause":
            world.pause_s = f.duration
        elif f.action == "forkserver":
            world.forkserver_down_until = now + 2.0
        elif f.action == "rejoin":  # `schedc rejoin "recover gpu(...)"` for a rank (lost or not)
            g = self.sup.recovery.initial_plan.spec.gpus[f.ranks[0]]  # (the job names GPUs as at its start)
            world.job.report(RejoinAsked(event=f"recover gpu(dp={g.dp}, pp={g.pp})", t=world.time()))

    def failing(self, diagnostics) -> None:
        """The supervisor is about to stop the run: not as stuck while a member is silent."""
        d = diagnostics[0] if diagnostics else None
        if d is not None and d.code == "E554" and "every rank waits" in d.message:
            self.world.violations.extend(
                f"t={self.world.now:.3f}: called stuck ({d.message}) while rank {r} had been silent since "
                f"t={start:.3f} ({what}): it waited for a dead peer" for r, start, what in self.silent_since(self.sup))

    def silent_since(self, sup) -> list[tuple[int, float, str]]:
        """(rank, since when, why) of the running generation's members whose process the world
        stopped (or lost with its host) longer ago than the stall rule waits for a silent peer, and
        which is still that stopped process (not a replacement started under its rank since)."""
        quiet = sup.detector.quiet
        members = set(sup.gen.members) if sup.gen is not None else set()
        out = []
        for r in sorted(members):
            w = self.world.workers.get(r)
            if w is None or not (w.alive and w.stopped or w.host_lost):
                continue
            out += [(r, start, what) for start, end, what in self.trouble.get(r, [])
                    if end == float("inf") and what in ("stop", "host") and self.world.now - start > quiet]
        return out

    def _agent_replaced(self, host: int) -> None:
        """Another agent takes `host` over: the old one's workers are lost from then."""
        for r in self.world.agents.replace_agent(host):
            self.trouble.setdefault(r, []).append([self.world.now, float("inf"), "host"])

    def _trouble_ends(self, ranks, now: float) -> None:
        """A stop of `ranks` ended (SIGCONT): a hang or a death that came with it goes on (seed
        101837: a hung rank, stopped and continued, was declared failed while still hung, and the
        checker, which had ended all its windows at the SIGCONT, called it healthy)."""
        for r in ranks:
            for window in self.trouble.get(r, []):
                if window[1] == float("inf") and window[2] == "stop":
                    window[1] = now

    # -- invariants ---------------------------------------------------------------------------------

    def _check_events(self, now: float) -> None:
        events = self.sup.events
        for e in events[self.seen_events:]:
            if e["kind"] == "failure":
                self._check_failure(e["rank"], e["t"], e["message"])
            elif e["kind"] == "catch-up" and e.get("donor") is not None and died_with_host(self.world, e["rank"]):
                self.world.violations.append(f"t={now:.3f}: rank {e['rank']} is to catch up, but its process died "
                                             f"with its host (nothing of it runs there): {e['message']}")
            elif e["kind"] == "slow" and e.get("speed", 1.0) < 0.9 and e["rank"] not in self.slowed:
                self.world.violations.append(f"t={now:.3f}: rank {e['rank']} reported slow but the world never "
                                             f"slowed it: {e['message']}")
        self.seen_events = len(events)

    def _check_failure(self, rank: int, t: float, message: str) -> None:
        slack = self.options.detect_timeout + 1.0
        if any(start <= t + 1e-3 and end >= t - slack for start, end, _ in self.trouble.get(rank, [])):  # (t is rounded)
            return
        self.world.violations.append(f"t={t:.3f}: healthy rank {rank} declared failed: {message}")

    def _check_generations(self) -> None:
        running: dict[int, list[int]] = {}
        for w in self.world.workers.values():
            if w.alive and w.state == "run":
                running.setdefault(w.generation, []).append(w.iteration)
        if len(running) < 2:
            return
        newest = max(running)
        start_at = self.world.job.generation(newest).start_at
        old_its = [it for g, its in running.items() if g != newest for it in its]
        if start_at is None or max(old_its) >= start_at or min(running[newest]) < start_at:
            self.world.violations.append(f"t={self.world.now:.3f}: generations {sorted(running)} run at once "
                                         f"(iterations {running}, switch at {start_at})")


def died_with_host(world: SimWorld, rank: int) -> bool:
    """Whether `rank`'s process (as the running layout numbers it) died with its host, and the
    supervisor could know: the host is still lost, or its new agent registered over a second ago
    (its `AgentUp` has arrived) and nothing was started under that rank since."""
    w, fleet = world.workers.get(rank), world.agents
    if w is None or w.alive or not w.host_lost or fleet is None:
        return False
    host = fleet.host_of(rank)
    return host in fleet.gone or world.now > fleet.back_at.get(host, math.inf) + 1.0


def simulate(seed: int, *, faults: list[Fault] | None = None, hook=None) -> Outcome:
    """Run seed `seed` (or `faults`, if given) to its end or the bound; see the module docstring.
    `hook(supervisor, world)`, if given, runs after every step (a test's way to act at a moment)."""
    faults = fault_schedule(seed) if faults is None else faults
    out = compiled_plan()
    ckpt = Path(tempfile.mkdtemp(prefix=f"schedc-sim-{seed}-"))
    weather = random.Random(f"{seed}/weather")  # the store's delays and the heartbeats' jitter of this run
    world = SimWorld(seed, queue_delay_s=weather.choice([0.0, 0.0, 0.02, 0.2]),
                     beat_jitter=weather.choice([0.0, 0.0, 0.5, 3.0]))
    shadow = weather.random() < 0.5  # half the runs keep shadows (`schedc.live.shadow`)
    # A third re-partition around a stage lost on every GPU (in place with shadows: renamed
    # survivors move the layers; without, every process restarts re-sharded); the rest choose
    # by cost, which on the simulation's one host means replacement processes. (Its own stream:
    # the other draws of a seed stay as they were.)
    recovery = random.Random(f"{seed}/recovery").choice(["auto", "auto", "repartition"])
    hosts = any(f.action in ("host", "agent") for f in faults)
    patient = {"detect_timeout": HOST_DETECT_S, "hosts": 3} if hosts else {}
    options = TrainOptions(iterations=HOST_ITERATIONS if hosts else ITERATIONS, emulate=True, checkpoint_dir=str(ckpt),
                           **{"shadow": shadow, "recovery": recovery, **OPTIONS, **patient})
    outcome = Outcome(seed, faults)
    try:
        sup = _supervisor_class()(out, options, world=world)
        checker = _Checker(sup, world, faults, options)
        fail = sup._fail
        sup._fail = lambda diagnostics: (checker.failing(diagnostics), fail(diagnostics))  # (before the teardown)
        world.on_step.append(checker)
        if hook is not None:
            world.on_step.append(lambda: hook(sup, world))
        try:
            sup._setup()
            while sup.phase not in (Phase.DONE, Phase.FAILED) and world.now < BOUND_S:
                sup._tick()
        except SchedcError as exc:
            sup._fail(list(exc.diagnostics))
        sup._teardown("finished" if sup.phase == Phase.DONE else "failed")
        outcome.sim_s = world.now
        outcome.events = [f"[{e['t']:8.3f}] {e['message']}" for e in sup.events]
        outcome.world_log = world.log
        outcome.recoveries = sup.recoveries
        _judge(outcome, sup, world, ckpt)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return outcome


def _judge(outcome: Outcome, sup, world: SimWorld, ckpt: Path) -> None:
    from schedc.live import checkpoint

    v = world.violations
    v += [f"the run ended counting rank {r} alive, but its process died with its host (nothing of it runs there)"
          for r in sorted(sup.alive) if died_with_host(world, r)]
    if sup.phase == Phase.DONE and not sup._failure:
        outcome.result = "finished"
        for r in sup.gen.members:
            w = world.workers[r]
            if w.history != list(range(sup.options.iterations)):
                v.append(f"rank {r} finished holding iterations {_runs(w.history)}, "
                         f"not 0..{sup.options.iterations - 1}")
    elif sup._failure:
        outcome.result = "stopped"
        d = sup._failure[0]
        outcome.code, outcome.hint = d.code, d.hint
        if d.code in ("E551", "E552", "E590") or "yet iterations" in d.message:  # (E551: the sim has no user code)
            v.append(f"stopped with a diagnostic that reports a bug: {d.code} {d.message}")

    else:
        outcome.result = "hung"
        v.append(f"no end and no diagnostic after {BOUND_S:g} simulated s (phase {sup.phase})")
    for found in checkpoint.complete_checkpoints(ckpt):
        for stage in range(found.meta.get("stages", 3)):
            state = checkpoint.load_stage(found, stage)
            held = list(state["history"])
            if held != list(range(found.iteration)):
                v.append(f"checkpoint {found.path.name} stage {stage} holds {_runs(held)}")
            if state.get("pp", found.meta.get("stages")) != found.meta.get("stages"):
                v.append(f"checkpoint {found.path.name} of {found.meta.get('stages')} stages holds a stage {stage} "
                         f"file of a {state['pp']}-stage layout")
    outcome.violations = list(v)


def _runs(history: list[int]) -> str:
    return f"{len(history)} updates " + (f"{history[:3]}..{history[-3:]}" if len(history) > 6 else str(history))


@functools.cache
def _supervisor_class():
    """`Supervisor` with its replans memoised by (plan's spec, events, solver): the same failure
    sets recur across seeds, and planning is what a simulated run would spend most of its time on
    (a replan is a pure function of those; the real one is tested elsewhere)."""
    from schedc.live.supervisor import Supervisor

    class SimSupervisor(Supervisor):
        _memo: dict = {}

        def _replan(self, base, events, solver=None):
            key = (base.spec, tuple(events), solver)
            if key not in self._memo:
                self._memo[key] = super()._replan(base, events, solver)
            return self._memo[key]

    return SimSupervisor
