"""Fail-slow, the supervisor's side: measure each GPU's speed, detect changes, act by cost.

* **Measure**: every rank reports, per iteration, the wall time of its
  compute ops (F, B, W: from the moment their inputs are there to the moment
  their sends are posted, so waiting for a slow peer or a slow link is not
  counted) and their planned time. The GPU's log speed is then
  log(planned x the plan's speed for it / measured).
* **Against the peers**: a host slowed for everyone is no one GPU's
  slowness. Once every member's report of an iteration is in, a rank's log
  speed is taken against the median of the other members' in the same
  iteration; and its heartbeat rate against theirs (`Detector.beat_rates`:
  a process the OS runs half as much beats half as often, even when its
  timed ops look healthy); and the share of time its process ran, not held
  stopped, against theirs (`Detector.stall_fractions`, `schedc.live.stall`:
  a throttled process is stopped, one that load starves is not, though both
  beat less often). Each signal has its own tracker (their noise differs
  tenfold on a loaded host); the rank's speed is the lowest of them.
* **Net of load**: a CPU rank's compute is its host thread's work, and on a
  host that other processes load the scheduler runs some ranks less than
  others for seconds at a time; such a rank computes slower by the time its
  thread waited on a run queue (`IterationDone.queued`), and so reads slow
  against its peers with nothing wrong with it. So a compute slowdown is
  taken net of the rank's share of time on a CPU against its peers' over the
  same iterations (`Slowness.net_of_load`); where that explains it, it is
  noted as load, not reported as a slow GPU. A GPU's kernels do not wait for
  the host's CPUs (`queued` is 0), and a throttle that stops the process is
  the stall signal's.
* **Detect**: one `SpeedTracker` per GPU (`schedc.live.changepoint`).
* **Price and decide**: on a change, the options (keep, rebalance, exclude,
  restore) are priced with the planner and the simulator and handed to the
  `Ladder` (`schedc.live.mitigate`), whose ski-rental rule says when to
  switch; the switch itself is a planned generation change at an iteration
  boundary (`Controller.switch`).
* **Excluded GPUs** stay up on standby and probe their own speed, judged
  against the host's speed now (`host_speed`); once the fastest of the last five
  says healthy, the ladder prices taking them back, and a
  rejoin (`schedc.live.rejoin`: catch-up, then a switch) does it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from schedc.live.changepoint import Shift, SpeedTracker
from schedc.live.control import Controller
from schedc.live.mitigate import Decision, Ladder, Option
from schedc.live.protocol import IterationDone, Phase, Probe
from schedc.spec import Failure

#: Probes a GPU's speed is judged from (the fastest of them: see `Slowness.probe`).
HEALTHY_PROBES = 5
#: An iteration's speeds are judged when the report of an iteration this much later arrives (or
#: when the iteration completes): by then every member's report of it is in.
ROUND_LAG = 2
#: Iterations over which the host's speed (for judging probes) is taken (their median).
HOST_ROUNDS = 10


def retimed_period(plan, speeds: dict[int, float]) -> int:
    """The steady period of `plan`'s programs if the GPUs in `speeds` ran at those speeds."""
    from schedc.simulate_engine import STEADY_ITERATIONS, run_programs, steady_period

    inst = plan.schedule.instance
    inst = replace(inst, gpus=tuple(replace(g, speed=speeds.get(g.rank, g.speed)) for g in inst.gpus))
    programs = {r: [op.id for op in prog] for r, prog in plan.schedule.programs.items()}
    return steady_period(run_programs(inst, programs, STEADY_ITERATIONS).iteration_end)


def measured_speed(rep: IterationDone, plan_speed: float) -> float | None:
    """A rank's speed in one iteration from its report: planned x the plan's speed for it /
    measured compute (None when it computed nothing)."""
    compute, planned = rep.compute or 0.0, rep.planned or 0.0
    return planned * plan_speed / compute if compute > 0 and planned > 0 else None


def cpu_share(rep: IterationDone) -> float | None:
    """The share of a rank's measured compute in one iteration that its thread was on a CPU, not
    waiting for one (None when it computed nothing)."""
    return 1.0 - min(rep.queued, rep.compute) / rep.compute if rep.compute > 0 else None


#: Iterations that set a plan's pace (the median of their wall times), and how much longer than
#: it an iteration must take for the run to count as slowed (gating the heartbeat-rate signal).
PACE_ITERATIONS = 8
PACE_SLACK = 1.2
#: The heartbeat rate against the peers' that counts as slow on its own: a starved process (a
#: throttle stopping it half the time beats about half as often) is far below it; heartbeat
#: threads jitter by 10-20% under load with the GPU at full speed (the simulation reported
#: healthy ranks at 0.81-0.88 from jitter alone, 27 of 2500 schedules, before this bar).
BEAT_SLOW = 0.7
#: Iterations of each rank's compute and share of time on a CPU (against its peers') kept for `net_of_load`,
#: and how many of those before a slowdown make the healthy level it is judged against.
ON_CPU_KEEP = 400
HEALTHY_LEVEL = 100
#: Iterations under a new plan left out before its offset on a rank's compute speed is learned
#: (`Slowness.after_plan_change`).
RELEARN_SKIP = 8

class Slowness:
    """The fail-slow policy. `mode` is ``act`` (switch plans by cost) or ``detect`` (only say so)."""

    def __init__(self, ctl: Controller, *, mode: str = "act"):
        self.ctl = ctl
        self.mode = mode
        self.trackers: dict[int, SpeedTracker] = {}  # rank -> its compute speed against its peers'
        self.beat_trackers: dict[int, SpeedTracker] = {}  # rank -> its heartbeat rate against its peers'
        self.held_trackers: dict[int, SpeedTracker] = {}  # rank -> the share of time it ran, against its peers'
        self.speeds: dict[int, float] = {}  # rank -> the lowest of the signals', as last reported
        self.probes: dict[int, list[tuple[int, float]]] = {}  # rank -> its last probes (iterations done, speed)
        self.excluded: set[int] = set()
        self._excluded_speed: dict[int, float] = {}  # excluded rank -> the speed it was excluded at
        self.decisions: list[dict] = []
        period = ctl.plan.metrics.iteration_time / 1e6
        # Before any switch is measured, a switch is taken to cost one period (the pipeline
        # drains and fills again: less than an iteration) and at least 0.1 s (new process groups);
        # measured at 0.4-0.5 periods in bench/live_slowness.py.
        self.ladder = Ladder(cost_s=max(0.1, period))
        self._pending: list[tuple[int, Shift, int, str]] = []  # shifts seen while not running
        self._quiet_until: dict[int, int] = {}  # rank -> iteration before which its probes are not priced
        self._rounds: dict[int, dict[int, float]] = {}  # iteration -> rank -> log speed, waiting for its peers'
        self._walls: dict[int, float] = {}  # iteration -> its longest wall time over the members' reports
        self._pace: list[float] = []  # the walls of the first iterations under the current plan: its pace
        self._pace_rates: list[float] = []  # the members' median heartbeat rate meanwhile
        self._window: list[tuple[float, float | None]] = []  # the last walls (and host rates)
        self._rates: dict[int, float] = {}  # rank -> heartbeats per second lately
        self._stalls: dict[int, float] = {}  # rank -> the share of the last second its process was held stopped
        self._offsets: dict[int, float] = {}  # rank -> what the current plan adds to its compute log speed
        self._relearn: dict[int, list[float]] = {}  # rank -> its first log speeds under a new plan (the offset)
        self._first: dict[int, list[float]] = {}  # rank -> its first log speeds (the host's speed, for probes)
        self._host: list[float] = []  # the host's log speed against the start, the last HOST_ROUNDS iterations
        self._cpu_rounds: dict[int, dict[int, float]] = {}  # iteration -> rank -> log share of compute on a CPU
        self._cpu_rel: dict[int, float] = {}  # rank -> its log share on a CPU against its peers', this iteration
        self._on_cpu: dict[int, list[tuple[int, float, float]]] = {}  # rank -> (iteration, fed to its compute
        # tracker, its log share on a CPU against its peers') for `net_of_load`
        self._compute_since: dict[int, int] = {}  # rank -> the iteration its compute tracker's level began
        self._load_noted: dict[int, int] = {}  # rank -> the compute level (its since) already noted as load

    # -- measuring -----------------------------------------------------------------------------

    def observe(self, rep: IterationDone, plan_speed: float) -> None:
        """One rank's iteration report (a member of the current generation). Judged once its
        peers' reports of the same iteration are in (at the iteration's `tick`, or two
        iterations later), against theirs."""
        self._walls[rep.it] = max(self._walls.get(rep.it, 0.0), rep.t1 - rep.t0)
        speed = measured_speed(rep, plan_speed)
        if speed is None:
            return
        self._rounds.setdefault(rep.it, {})[rep.rank] = math.log(speed)
        self._cpu_rounds.setdefault(rep.it, {})[rep.rank] = math.log(max(cpu_share(rep), 1e-3))
        self._judge_rounds(rep.it - ROUND_LAG)

    def beat_rates(self, rates: dict[int, float]) -> None:
        """The members' heartbeat rates now (beats per second, `Detector.beat_rates`)."""
        self._rates = rates

    def stalls(self, fractions: dict[int, float]) -> None:
        """The share of the last second each member's process was held stopped (`Detector.stall_fractions`)."""
        self._stalls = fractions

    def _judge_rounds(self, upto: int) -> None:
        for it in sorted(k for k in self._rounds if k <= upto):
            self._note_on_cpu(it, self._cpu_rounds.pop(it, {}))
            self._judge(it, self._rounds.pop(it))

    def _note_on_cpu(self, it: int, shares: dict[int, float]) -> None:
        """Each rank's log share of its compute on a CPU in iteration `it`, against the median of
        the other members' (for `net_of_load`, beside what its compute tracker is fed then)."""
        self._cpu_rel = {}
        for rank, y in shares.items():
            others = [v for r, v in shares.items() if r != rank]
            if len(others) >= 2:
                self._cpu_rel[rank] = y - statistics.median(others)

    def net_of_load(self, rank: int, speed: float, since: int) -> float:
        """`rank`'s compute speed against its peers' (its tracker's, `speed`) with its waits for
        a CPU taken out. Per iteration, its log speed less its log share of time on a CPU against
        its peers' is what it computed in the time it was given a CPU, against what they did; the
        change of that from before iteration `since` to since (medians), less the change of the
        log speed alone, is what the waits explain, and `speed` is moved by it. A rank the
        scheduler ran half as much as its peers computes at half their speed on a healthy GPU;
        where nobody waits (a GPU's kernels, an idle host) nothing moves. Never below `speed`
        (this only tells load from a slow GPU), at most 1.0; `speed` where there is too little to
        go on. Taken per iteration, as the waits and the compute times they lengthen move
        together from one iteration to the next (under two busy loops a healthy CPU rank's share
        on a CPU read 0.05-0.75 per iteration, its peers' median 0.13-0.45)."""
        kept = self._on_cpu.get(rank, ())
        after = [(y, c) for it, y, c in kept if it >= since]
        before = [(y, c) for it, y, c in kept if it < since][-HEALTHY_LEVEL:]
        if len(after) < 3 or len(before) < SpeedTracker.warmup:
            return speed
        med = statistics.median
        net = med(y - c for y, c in after) - med(y - c for y, c in before)
        raw = med(y for y, _ in after) - med(y for y, _ in before)
        return min(1.0, max(speed, speed * math.exp(net - raw)))

    def _judge(self, it: int, logs: dict[int, float]) -> None:
        """One iteration's log speeds, each judged against the median of its peers' (a host
        slowed for everyone is no one GPU's slowness), and against the rank's beat rate."""
        self._note_host(logs)
        avail = self._availability()
        held = self._held()
        slowed = self._run_slowed(self._walls.pop(it, None))
        for rank, y in sorted(logs.items()):
            others = [v for r, v in logs.items() if r != rank]
            rel = y - statistics.median(others) if others else y
            shifts = {"compute": self._compute(rank, rel, it)}
            if rank in held:
                shifts["stall"] = self.held_trackers.setdefault(rank, SpeedTracker()).update(held[rank], it)
            if rank in avail:
                # A rank that beats less often than its peers slows the run only if the run is slowed:
                # a heartbeat thread starved while the GPU keeps pace (a fresh process, a busy
                # interpreter) is not a slow GPU; while the run keeps its pace, the signal reads healthy.
                # The gate stops an alarm being raised, not cleared: once it said slow, the rank's own rate
                # says when it is well (fed 0.0 after its rebalance it read "back to full speed", wrongly).
                tracker = self.beat_trackers.setdefault(rank, SpeedTracker())
                said_slow = tracker.level is not None and tracker.speed < 1 - SpeedTracker.min_change
                shifts["heartbeat"] = tracker.update(avail[rank] if slowed or said_slow else 0.0, it)
            shifts = {name: sh for name, sh in shifts.items() if sh is not None}
            if not shifts:
                continue
            if "compute" in shifts:
                self._compute_since[rank] = shifts["compute"].since
            compute = self._compute_speed(rank, it)
            beat = self.beat_trackers[rank].speed if rank in self.beat_trackers else 1.0
            ran = self.held_trackers[rank].speed if rank in self.held_trackers else 1.0
            speed = min(compute, beat if beat <= BEAT_SLOW else 1.0, ran)
            before = self.speeds.get(rank, 1.0)
            if speed == before or min(speed, before) >= 1 - SpeedTracker.min_change:
                continue  # (one signal went back while another still says slow; healthy before and after)
            self.speeds[rank] = speed
            shift = Shift(speed, min(sh.since for sh in shifts.values()), it)
            # (which measure says so: one that changed now to this speed, else the one at it)
            now = {"compute": compute, "stall": ran, "heartbeat": beat}
            signal = next((n for n in shifts if now[n] == speed), next((n for n, v in now.items() if v == speed),
                                                                          next(iter(shifts))))
            if self.ctl.phase == Phase.RUNNING:
                self._shift(rank, shift.speed, shift.since, it, signal)
            else:
                self._pending.append((rank, shift, it, signal))

    def _compute_speed(self, rank: int, it: int) -> float:
        """The compute tracker's speed for `rank` net of load (`net_of_load`); a slowdown that
        load explains is noted once, as load."""
        if rank not in self.trackers:
            return 1.0
        raw = self.trackers[rank].speed
        if raw >= 1 - SpeedTracker.min_change:
            return raw
        since = self._compute_since.get(rank, 0)
        net = self.net_of_load(rank, raw, since)
        if net < 1 - SpeedTracker.min_change:
            return net
        if self._load_noted.get(rank) != since:
            self._load_noted[rank] = since
            self.ctl.note("load", f"rank {rank} {self.ctl.gpu_name(rank)} computes at {raw:.2f} of its peers' "
                                  f"speed since iteration {since} (seen at {it}), but its thread waited for a CPU "
                                  f"as much longer: host load, not a slow GPU ({net:.2f} net of it)",
                          rank=rank, speed=round(raw, 3), net=round(net, 3), since=since, seen=it)
        return 1.0

    def _compute(self, rank: int, rel: float, it: int) -> Shift | None:
        """Feed `rank`'s compute speed against its peers' to its tracker, less the offset the
        current plan puts on it (learned over `SpeedTracker.warmup` iterations under the plan
        after its first `RELEARN_SKIP`, after a plan change: `after_plan_change`)."""
        tracker = self.trackers.setdefault(rank, SpeedTracker())
        if rank in self._relearn:
            seen = self._relearn[rank]
            seen.append(rel)
            if len(seen) < RELEARN_SKIP + SpeedTracker.warmup:
                return None
            del self._relearn[rank]
            self._offsets[rank] = statistics.median(seen[RELEARN_SKIP:]) - tracker.level
            return None
        y = rel - self._offsets.get(rank, 0.0)
        if rank in self._cpu_rel:
            kept = self._on_cpu.setdefault(rank, [])
            kept.append((it, y, self._cpu_rel[rank]))
            del kept[:-ON_CPU_KEEP]
        return tracker.update(y, it)

    def _run_slowed(self, wall: float | None) -> bool:
        """Whether this iteration took clearly longer (PACE_SLACK) than the current plan's pace,
        and longer than the host's slowdown explains: a host slowed for everyone (other
        processes on its CPUs) slows every rank's heartbeat thread too, by the members' median
        heartbeat rate against that during the pace's iterations; one rank that holds the run
        up does not. The pace is the fastest median of PACE_ITERATIONS iterations in a row
        under the plan so far (while the first are measured: not slowed): a plan's first
        iterations are slow (warm-up, a loaded start), and a pace taken from them alone, 0.084 s
        against 0.05 s after, hid a throttle that slowed the run to 0.088 s."""
        if wall is None:
            return False
        host = self._host_rate()
        if len(self._pace) < PACE_ITERATIONS:
            self._pace.append(wall)
            if host is not None:
                self._pace_rates.append(host)
            self._window.append((wall, host))
            return False
        self._window = (self._window + [(wall, host)])[-PACE_ITERATIONS:]
        if statistics.median(w for w, _ in self._window) < statistics.median(self._pace):
            self._pace = [w for w, _ in self._window]
            self._pace_rates = [h for _, h in self._window if h is not None]
        slack = PACE_SLACK
        if host is not None and self._pace_rates:
            slack /= min(1.0, host / statistics.median(self._pace_rates))
        return wall > statistics.median(self._pace) * slack

    def _host_rate(self) -> float | None:
        """The members' median heartbeat rate now (None before there are three)."""
        members = set(self.ctl.members)
        rates = [v for r, v in self._rates.items() if r in members and v > 0]
        return statistics.median(rates) if len(rates) >= 3 else None

    def _availability(self) -> dict[int, float]:
        """Log of each member's heartbeat rate against the median of the other members': a
        process the OS runs half as much as its peers (stopped now and then, starved) beats
        about half as often, whether or not the stops fall inside its timed ops."""
        members = set(self.ctl.members)
        rates = {r: v for r, v in self._rates.items() if r in members and v > 0}
        if len(rates) < 3:  # two ranks cannot say which one is slow
            return {}
        out = {}
        for r, v in rates.items():
            mid = statistics.median(x for q, x in rates.items() if q != r)
            out[r] = math.log(v / mid)
        return out

    def _held(self) -> dict[int, float]:
        """Log of the share of time each member's process ran (was not held stopped: its stall
        clock, `schedc.live.stall`) against the median of the other members': a process stopped
        from outside half the time runs half as much as its peers, and one that load starves
        (which its heartbeat rate cannot tell from that) is not stopped at all."""
        members = set(self.ctl.members)
        ranks = [r for r, v in self._stalls.items() if r in members and v < 1.0]
        if len(ranks) < 3:  # two ranks cannot say which one is slow
            return {}
        return {r: math.log(self._ran_share(r, members)) for r in ranks}

    def _ran_share(self, rank: int, members: set[int] | None = None) -> float:
        """The share of time `rank`'s process ran lately (not held stopped) against the median
        of the other members' (1.0 without its stall clock or two members' to compare with)."""
        if rank not in self._stalls:
            return 1.0
        members = set(self.ctl.members) if members is None else members
        others = [v for r, v in self._stalls.items() if r != rank and r in members and v < 1.0]
        if len(others) < 2:
            return 1.0
        return max(1e-6, 1.0 - self._stalls[rank]) / (1.0 - statistics.median(others))

    def _note_host(self, logs: dict[int, float]) -> None:
        """How fast the host runs now against its start: the median over the members of their
        log speed against their own first iterations (for judging probes, below)."""
        devs = []
        for rank, y in logs.items():
            first = self._first.setdefault(rank, [])
            if len(first) < SpeedTracker.warmup:
                first.append(y)
            else:
                devs.append(y - statistics.median(first))
        if devs:
            self._host.append(statistics.median(devs))
            del self._host[:-HOST_ROUNDS]

    def host_speed(self) -> float:
        """The host's speed now against the run's first iterations (at most 1): what a probe of a
        healthy GPU on this host shows now."""
        if not self._host:
            return 1.0
        return min(1.0, math.exp(statistics.median(self._host)))

    def probe(self, rep: Probe) -> None:
        """A probe of a GPU's speed: an excluded one on standby, or a member its plan gives no
        compute (all its work moved to its peers), whose iterations time nothing. Judged
        against the host's speed now: a probe on a host that every rank finds slower is no
        sign of a slow GPU.

        The GPU's speed is the fastest of its last HEALTHY_PROBES probes: a probe's noise only
        ever adds time (its thread preempted, or waiting for the interpreter while the rank's
        other threads run), and a GPU at speed x never probes faster than x. A member's probes
        say only that it got faster than its plan assumes (well again): its probe thread runs
        beside the rank's own main thread, and in a CPU rank the two share one interpreter;
        with an injected slowdown spinning on the main thread, under four busy loops, the
        fastest of five probes read 0.03-0.05 of a GPU that ran at 0.1 as planned (their median
        had reported it "at 0.04 since iteration 46"). A GPU given no compute slower still costs
        the run next to nothing. A change found is dated from the first probe that read it.

        A probe is a short op: it times the GPU, not the process around it, and a process held
        stopped half the time (a throttle) probes healthy. So a probe counts for no more than the
        share of time the rank's process ran against the members' (its stall clock): a throttled
        rank rebalanced to no compute probed "back to full speed" while still throttled."""
        ctl, rank = self.ctl, rep.rank
        if ctl.rejoin_wanted(rank) or ctl.phase != Phase.RUNNING or ctl.completed < self._quiet_until.get(rank, 0):
            return
        seen = self.probes.setdefault(rank, [])
        seen.append((ctl.completed, min(1.0, rep.speed / self.host_speed(), self._ran_share(rank))))
        del seen[:-HEALTHY_PROBES]
        if len(seen) < HEALTHY_PROBES or self.ladder.is_open(rank):
            return
        speed = max(v for _, v in seen)
        since = next(c for c, v in seen if v >= speed * (1 - SpeedTracker.min_change))  # (its first probe)
        if rank in self.excluded:
            if speed >= 1 - SpeedTracker.min_change:
                self._price_return(rank)
        elif rank in ctl.members:
            plan_speed = ctl.base_plan.spec.gpus[rank].speed
            if speed - plan_speed >= SpeedTracker.min_change * plan_speed:
                self.probes.pop(rank)
                self._shift(rank, speed, since, ctl.completed, "probe")

    # -- deciding ------------------------------------------------------------------------------

    def tick(self, iteration: int) -> None:
        """An iteration was completed (the run is `running`)."""
        self._judge_rounds(iteration)
        for rank, shift, it, signal in self._pending:
            self._shift(rank, shift.speed, shift.since, it, signal)
        self._pending.clear()
        for d in self.ladder.tick(iteration):
            self._act(d)

    def _shift(self, rank: int, speed: float, since: int, iteration: int, signal: str) -> None:
        """A GPU's speed changed, as `signal` (compute, heartbeat or probe: in the event, for
        telling false alarms apart) says."""
        ctl = self.ctl
        where = f"rank {rank} {ctl.gpu_name(rank)}"
        if speed >= 1 - SpeedTracker.min_change:
            ctl.note("slow", f"{where} is back to full speed since iteration {since} (seen at {iteration})",
                      rank=rank, speed=round(speed, 3), since=since, seen=iteration, signal=signal)
        else:
            ctl.note("slow", f"{where} runs at speed {speed:.2f} since iteration {since} (seen at {iteration})",
                      rank=rank, speed=round(speed, 3), since=since, seen=iteration, signal=signal)
        plan_speed = ctl.base_plan.spec.gpus[rank].speed
        if abs(speed - plan_speed) < SpeedTracker.min_change * plan_speed:
            d = self.ladder.close(rank, iteration, "back to the speed the plan assumes")
            if d is not None:
                self._log(d)
            return
        self._open(rank, speed, since, iteration)

    def _open(self, rank: int, speed: float, since: int, iteration: int) -> None:
        d = self.ladder.open(rank, speed, since, self._options(rank, speed), iteration)
        if d.verdict == "switch":
            self._act(d)  # (logs it)
        else:
            self._log(d)

    def _options(self, rank: int, speed: float) -> list[Option]:
        ctl = self.ctl
        base = ctl.base_plan
        g = base.spec.gpus[rank]
        x = min(1.0, max(0.05, round(speed, 2)))
        options = [Option("keep", retimed_period(base, {rank: x}))]

        def priced(action, event: Failure):
            try:
                plan = ctl.replan(base, [event])
            except Exception:  # e.g. excluding the last GPU of a stage: not an option
                return None
            return Option(action, plan.metrics.iteration_time, plan)

        if x >= 1 - SpeedTracker.min_change:
            if g.speed < 1.0:
                options.append(priced("restore", Failure("recover_gpu", dp=g.dp, pp=g.pp)))
        else:
            options.append(priced("rebalance", Failure("slow_gpu", dp=g.dp, pp=g.pp, speed=x)))
            options.append(priced("exclude", Failure("fail_gpu", dp=g.dp, pp=g.pp)))
        return [o for o in options if o is not None]

    def _price_return(self, rank: int) -> None:
        """An excluded GPU probes healthy: what would taking it back save?"""
        ctl = self.ctl
        g = ctl.plan.spec.gpus[rank]
        try:
            plan = ctl.replan(ctl.base_plan, [Failure("recover_gpu", dp=g.dp, pp=g.pp)])
        except Exception:
            return
        options = [Option("keep", ctl.base_plan.metrics.iteration_time), Option("restore", plan.metrics.iteration_time,
                                                                                 plan)]
        ctl.note("slow", f"rank {rank} {ctl.gpu_name(rank)} probes healthy again (speed "
                         f"{max(v for _, v in self.probes[rank]):.2f})", rank=rank)
        d = self.ladder.open(rank, 1.0, ctl.completed, options, ctl.completed)
        if d.verdict == "switch":
            self._act(d)
        else:
            self._log(d)
            if d.verdict == "ignore":  # not worth it now: price it again after 10 iterations, not every probe
                self.probes.pop(rank, None)
                self._quiet_until[rank] = ctl.completed + 10

    def _act(self, d: Decision) -> None:
        ctl = self.ctl
        if self.mode == "detect":
            self._log(replace(d, verdict="ignore", reason=f"{d.reason}; not switched: --fail-slow detect"))
            return
        if d.rank in self.excluded and d.action == "restore":
            self._log(d)
            self.excluded.discard(d.rank)
            self.probes.pop(d.rank, None)
            ctl.request_rejoin(d.rank, f"healthy again ({d.reason})")
            return
        refused = ctl.switch(d.plan, kind=d.action, reason=d.reason, ranks=[d.rank])
        if refused is None:
            self._log(d)
            expected = 1.0 if d.action == "restore" else d.speed
            # The measures that say it is slow now report changes from the plan's speed; one that
            # never said so keeps its own (told to expect a slow speed it never saw, a measure
            # gated while the run keeps its pace, the heartbeat rate, held a throttled rank at that
            # speed after the throttle ended: never back to full speed).
            for trackers in (self.trackers, self.beat_trackers, self.held_trackers):
                t = trackers.get(d.rank)
                if t is not None and (expected >= 1.0 or t.speed < 1 - SpeedTracker.min_change):
                    t.expect(expected)
            if d.rank in self.speeds:
                self.speeds[d.rank] = expected
            if d.action == "exclude":
                self.excluded.add(d.rank)
                self._excluded_speed[d.rank] = d.speed
                self.trackers.pop(d.rank, None)  # its speed comes from probes while it is out
                self._compute_since.pop(d.rank, None)
                self.beat_trackers.pop(d.rank, None)
                self.held_trackers.pop(d.rank, None)
                self._offsets.pop(d.rank, None)
                self._relearn.pop(d.rank, None)
                self.speeds.pop(d.rank, None)
        else:
            self._log(replace(d, verdict="ignore", reason=f"{d.reason}; no switch: {refused}"))

    def _log(self, d: Decision) -> None:
        self.decisions.append(d.to_json())
        verdict = {"ignore": "ignore", "wait": "wait", "switch": d.action, "blip": "blip"}[d.verdict]
        self.ctl.note("decision", f"decision for rank {d.rank}: {verdict}: {d.reason}", decision=d.to_json())

    # -- membership changes ------------------------------------------------------------------------

    def after_plan_change(self) -> None:
        """A failure or a switch changed the plan: every open episode was priced against the old
        one; price again every member whose measured speed differs from what the new plan assumes
        (an excluded GPU's return is priced again from its next probes).

        A member whose compute reads healthy has the offset the new plan puts on its compute
        speed learned anew (the median of `SpeedTracker.warmup` iterations under it after the
        first `RELEARN_SKIP`, against its healthy level; its tracker, with the noise and wander
        it learned, goes on):
        the cost model misses real op times differently for another split of the layers (a CPU
        rank's millisecond ops do not grow with its layers as the model says), so every rank's
        speed against its peers' moves with a repartition. After a rebalance for a throttled
        rank, a healthy rank of another pipeline read 0.33-0.6 of its peers' against the old
        level and was reported slow. The first iterations under a new plan are left out: the
        ranks settle into it at different paces, and a healthy stage-0 rank read 1.5-5.4 times
        its peers' speed over its first 8 after a rebalance, 1.0 after, and was reported at 0.26
        against an offset learned from them. (A slowdown that begins within those iterations is
        taken for the offset; one found before the change stays.)"""
        ctl = self.ctl
        self.ladder.cancel_all()
        self._pace, self._pace_rates, self._window = [], [], []  # the new plan's pace is measured anew
        for rank, t in self.trackers.items():
            if rank in ctl.members and t.level is not None and t.speed >= 1 - SpeedTracker.min_change:
                self._relearn[rank] = []
        for rank in sorted(self.excluded & set(ctl.members)):  # its exclusion's switch was abandoned: still in
            self.excluded.discard(rank)
            self.speeds[rank] = self._excluded_speed.pop(rank, 1.0)  # (priced again below, as it ran)
        for rank, speed in self.speeds.items():
            if rank in ctl.members:
                plan_speed = ctl.base_plan.spec.gpus[rank].speed
                if abs(speed - plan_speed) >= SpeedTracker.min_change * plan_speed:
                    self._open(rank, speed, ctl.completed, ctl.completed)

    def joined(self, rank: int) -> None:
        """A GPU (re)joined: its speed is learned afresh."""
        self.trackers.pop(rank, None)
        self.beat_trackers.pop(rank, None)
        self.held_trackers.pop(rank, None)
        self._offsets.pop(rank, None)
        self._relearn.pop(rank, None)
        self.speeds.pop(rank, None)
        self.probes.pop(rank, None)
        self._on_cpu.pop(rank, None)
        self._compute_since.pop(rank, None)
        self._load_noted.pop(rank, None)
        self.excluded.discard(rank)
        self._excluded_speed.pop(rank, None)
        self.ladder.cancel(rank)

    def relabelled(self) -> None:
        """The ranks are numbered anew (a re-partition, a growth): what was learned per rank is
        another GPU's now, so every rank's speed is learned afresh (a slow GPU is found again
        under its new number; a healthy one that took a slow one's number is not rebalanced)."""
        for rank in set(self.trackers) | set(self.beat_trackers) | set(self.held_trackers) | set(self.speeds) \
                | set(self.probes) | set(self._offsets) | self.excluded:
            self.joined(rank)
        for per_rank in (self._rounds, self._cpu_rounds, self._cpu_rel, self._rates, self._stalls, self._first,
                         self._quiet_until, self._on_cpu):
            per_rank.clear()
        self._pending = []

    def lost(self, rank: int) -> None:
        self.joined(rank)
