"""Chaos runs of `schedc train` with real processes (Jepsen-style), not run in CI.

    python bench/chaos.py --runs N --seed S [--load 0|2] [--out DIR] [--iterations I]
                          [--targets worker,forkserver,tracker] [--shadow] [--recovery METHOD]
    python bench/chaos.py --table OUT [OUT ...]

Run k of a campaign has seed S + k, and everything it does to the run comes from that seed
(`plan_faults`): `--runs 1 --seed S+k` replays it (the same faults at the same moments of the
run; where exactly a signal lands inside an iteration is up to the scheduler). Each run trains a
3 x 3 MLP with Adam (`SPEC`, compiled once) for `--iterations` iterations, with checkpoints, and
the script signals its processes from outside, as a failing machine would:

* SIGKILL, or SIGSTOP and later SIGCONT, of one or two workers, of the forkserver the workers are
  forked from, or of multiprocessing's resource tracker;
* at an iteration (watched on the run's progress lines), during the start-up, and right after a
  line that marks a phase change (a failure seen, `replan:`, `restarting`, `reconfigured`,
  `switch to generation`): a second fault then lands inside the recovery or switch.

Worker processes show in /proc as plain python processes (their multiprocessing name,
`schedc-train-rank-R`, lives only inside the parent), so the script finds them as the children of
the run's forkserver (its session, which it owns: every run starts in a new session, and only that
session is ever signalled) and gives them ranks in the order they are started: 0..N-1 for
generation 0, then the ranks a "replacement process(es) for rank(s) [...]" or "restarting every
process" line names.

Each run ends as one of:

* finished exact: exit 0, and the saved weights within `TOLERANCE` of single-process training;
* finished inexact: exit 0, weights further off (or missing);
* diagnostic: an ``error[E...]`` line (not E000) and a nonzero exit;
* hung: no output line for `--silence` seconds, or longer than `--bound` seconds in all: the run
  gets SIGTERM (so that it writes its log), then its process group gets SIGKILL;
* crashed: a Python traceback or E000 anywhere in the output, or a nonzero exit without a
  diagnostic.

Besides, "healthy excluded" counts ranks that the run's log declares failed (or excludes as slow)
although the script never signalled them, and "leaked" runs left processes in their session after
the run's own process exited (they are killed then). Each bad run keeps its directory under
``--out``: ``command.txt`` (the replay command and the exact `schedc train` command),
``faults.json`` (planned and fired), ``output.txt`` (every line, stamped with the script's clock),
``log.json`` (the run's `--log`), ``procs.txt`` (the session's processes when it hung or leaked).
Good runs' directories are removed. ``summary.json`` lists every run; ``--table OUT [OUT ...]``
prints one table over several campaigns (a row per ``--load``: outcomes, the largest weight
difference of the exact runs, the processes signalled by kind and signal).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A 3 x 3 computing-mode MLP (schedc.models.mlp, 7 layers) with Adam: 9 ranks, ~0.1 s per
#: iteration on two shared cores, so 100 iterations take ~10-30 s.
SPEC = """
model "chaos" { source = "schedc.models.mlp:build" }
cluster { dp = 3  pp = 3  gpus_per_node = 3
          gpu { memory = 1GiB }  link { latency = 50us  bandwidth = 1GB/s } }
stages { all { forward = 2ms  backward_input = 2ms  backward_weight = 1ms  optimizer = 0.5ms
               activation = 4MiB  stash = 1MiB  static = 16MiB  send = 64KiB } }
train { microbatches = 3  optimizer = adam  lr = 0.001  iterations = 100 }
schedule { solver = greedy  decouple_backward = true  stagger_optimizer = true }
"""
RANKS = 9

#: Max abs weight difference from single-process training that still counts as exact. A
#: fault-free live run of SPEC ends 1.4e-6 off after 100 iterations (float32 sums in another
#: order, amplified by Adam's normalisation); a real defect (a microbatch lost or counted twice,
#: a step skipped or applied twice) moves weights by about one Adam step, lr = 1e-3 per element.
#: 1e-4 sits ~70x above the first and 10x below the second. Re-measure the first with a run
#: without faults (`--runs 1 --no-faults`), which prints its difference.
TOLERANCE = 1e-4

#: Lines that mark a phase change: a follow-up fault fires right after one of them.
PHASE_MARKERS = {
    "failure": re.compile(r"\] rank \d+ GPU \(dp=\d+, pp=\d+\) failed: "),
    "replan": re.compile(r"\] replan: "),
    "restarting": re.compile(r"\] (restarting every process|stage\(s\) \[[\d, ]*\] lost every GPU)"),
    "reconfigured": re.compile(r"\] generation \d+: \d+ ranks reconfigured"),
    "switch": re.compile(r"\] switch to generation \d+"),
}
ITERATION = re.compile(r"^iteration\s+(\d+)\s")
REPLACED = re.compile(r"replacement process\(es\) for rank\(s\) \[([\d, ]*)\]")
RESTART_ALL = re.compile(r"restarting every process")
ALL_REPLACED = re.compile(r"restarting every process .*with the failed GPU\(s\) replaced")
DIAGNOSTIC = re.compile(r"^error\[E(\d{3})\]", re.M)
FAILED_LINE = re.compile(r"\] rank (\d+) GPU \(dp=\d+, pp=\d+\) failed: (.*)$")

OUTCOMES = ("finished exact", "finished inexact", "diagnostic", "hung", "crashed")


# -- the faults of a run: pure, from its seed -----------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """One signal (or SIGSTOP, then SIGCONT `cont_after` s later) to a target of the run.

    target: "worker" (`ranks`), "forkserver" or "tracker" (multiprocessing's resource tracker).
    trigger: "iteration" (once the run prints iteration `at` or later), "startup" (`delay` s after
    the first worker starts), "after" (the first `marker` line after fault `at` fired, or any
    phase line if `marker` is "any"), "phase" (the first `marker` line of the run). It fires
    `delay` s after its trigger.
    """

    target: str
    action: str  # "kill" or "stop"
    trigger: str
    at: int = 0
    marker: str = ""
    delay: float = 0.0
    ranks: tuple[int, ...] = ()
    cont_after: float | None = None

    def describe(self) -> str:
        who = f"worker rank(s) {list(self.ranks)}" if self.target == "worker" else self.target
        what = "SIGKILL" if self.action == "kill" else f"SIGSTOP (SIGCONT {self.cont_after:.2f} s later)"
        when = {"iteration": f"at iteration {self.at}", "startup": "after the first worker started",
                "after": f"after the first {self.marker} line following fault {self.at}",
                "phase": f"at the first {self.marker} line"}[self.trigger]
        return f"{what} to {who} {when} +{self.delay:.3f} s"


TARGETS = ("worker", "forkserver", "tracker")


def _target(rng: random.Random, ranks: int, targets: tuple[str, ...]) -> dict:
    x = rng.random()
    if x < 0.14 and "forkserver" in targets:
        return {"target": "forkserver"}
    if 0.14 <= x < 0.24 and "tracker" in targets:
        return {"target": "tracker"}
    count = 2 if rng.random() < 0.25 else 1
    return {"target": "worker", "ranks": tuple(sorted(rng.sample(range(ranks), count)))}


def _action(rng: random.Random) -> dict:
    if rng.random() < 0.6:
        return {"action": "kill"}
    # Around the heartbeat timeout (3 s): short stops must pass unnoticed or as slowness, long ones
    # get the rank declared hung and fenced.
    return {"action": "stop", "cont_after": round(rng.uniform(0.3, 6.0), 3)}


def plan_faults(seed: int, iterations: int, ranks: int = RANKS, targets: tuple[str, ...] = TARGETS
                ) -> tuple[Fault, ...]:
    """The faults of the run with this seed: the same seed (and `targets`, the kinds of target
    allowed; a worker stands in for the others) always gives the same faults."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    if rng.random() < 0.1:
        faults.append(Fault(trigger="startup", delay=round(rng.uniform(0.2, 4.0), 3), **_target(rng, ranks, targets),
                            **_action(rng)))
    last = max(1, iterations - 12)
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        faults.append(Fault(trigger="iteration", at=rng.randint(2, last), delay=round(rng.uniform(0.0, 0.15), 3),
                            **_target(rng, ranks, targets), **_action(rng)))
    for i in range(len(faults)):
        if rng.random() < 0.5:  # a second fault inside the recovery (or switch) that the first starts
            marker = rng.choice(("any", "failure", "replan", "reconfigured", "restarting"))
            faults.append(Fault(trigger="after", at=i, marker=marker, delay=round(rng.uniform(0.0, 0.3), 3),
                                **_target(rng, ranks, targets), **_action(rng)))
    if rng.random() < 0.3:  # inside a fail-slow switch, if the run makes one
        faults.append(Fault(trigger="phase", marker="switch", delay=round(rng.uniform(0.0, 0.5), 3),
                            **_target(rng, ranks, targets), **_action(rng)))
    return tuple(faults)


# -- what a run came to: pure ----------------------------------------------------------------------

def classify(rc: int | None, output: str, hung: bool, weight_diff: float | None,
             tolerance: float = TOLERANCE) -> str:
    """One of OUTCOMES (see the module docstring). `weight_diff` is None when no weights were saved."""
    if hung:
        return "hung"
    if "Traceback (most recent call last)" in output or "error[E000]" in output:
        return "crashed"
    if rc == 0:
        return "finished exact" if weight_diff is not None and weight_diff <= tolerance else "finished inexact"
    if DIAGNOSTIC.search(output):
        return "diagnostic"
    return "crashed"


def declared(log: dict | None, output: str) -> dict[int, list[str]]:
    """Rank -> why the run took it out of work: failures (from the log's events, else from the
    output's "failed:" lines) and fail-slow exclusions."""
    out: dict[int, list[str]] = {}
    if log is not None:
        for ev in log.get("events", []):
            if ev.get("kind") == "failure" and "rank" in ev:
                out.setdefault(int(ev["rank"]), []).append(ev.get("cause") or ev.get("message", ""))
            decision = ev.get("decision") if ev.get("kind") == "decision" else None
            if decision and decision.get("verdict") == "switch" and decision.get("action") == "exclude":
                out.setdefault(int(decision["rank"]), []).append("excluded as slow")
    else:
        for line in output.splitlines():
            m = FAILED_LINE.search(line)
            if m:
                out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def healthy_excluded(log: dict | None, output: str, touched: set[int]) -> dict[int, list[str]]:
    """The ranks `declared` that the script never signalled."""
    return {r: why for r, why in declared(log, output).items() if r not in touched}


# -- the processes of a run ---------------------------------------------------------------------

@dataclass
class Proc:
    pid: int
    ppid: int
    state: str
    cmd: str


def session(sid: int) -> dict[int, Proc]:
    """Every process of session `sid` (a run's: it started its own)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            rest = stat[stat.rindex(")") + 2:].split()
            if int(rest[3]) != sid:
                continue
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        found[int(name)] = Proc(int(name), int(rest[1]), rest[0], cmd.strip())
    return found


def is_forkserver_cmd(cmd: str) -> bool:
    return "multiprocessing.forkserver" in cmd


def roles(procs: dict[int, Proc], sid: int, workers: set[int]) -> tuple[set[int], set[int]]:
    """(forkservers, workers) among a run's live processes. A worker is forked from a forkserver
    and shares its command line; once its forkserver is killed it is re-parented to `schedc
    train` (its agent is the subreaper), just where a forkserver lives: so a worker is a
    forkserver-like process ever seen as a forkserver's child (`workers`) or one now, and a
    forkserver is one started by `schedc train` that is no worker. (Told apart by the parent
    alone, a campaign once killed eight healthy workers as "the forkserver" and could no longer
    signal them as workers.)"""
    forkservers, found = set(), set()
    for p in procs.values():
        if p.pid == sid or p.state == "Z" or not is_forkserver_cmd(p.cmd):
            continue
        if p.pid in workers or p.ppid != sid:
            found.add(p.pid)
        else:
            forkservers.add(p.pid)
    return forkservers, found


@dataclass
class Ranks:
    """Worker pid -> rank, in the order workers are started (see the module docstring)."""

    pending: list[int]
    of: dict[int, int] = field(default_factory=dict)  # pid -> rank (-1: could not tell)
    unassigned: list[int] = field(default_factory=list)
    first_birth: float | None = None
    failed: set[int] = field(default_factory=set)  # ranks declared failed and not started again

    def born(self, pids: list[int], now: float) -> None:
        self.unassigned += sorted(pids)
        if pids and self.first_birth is None:
            self.first_birth = now
        self._assign()

    def line(self, text: str, ranks: int) -> None:
        """A restart "with the failed GPU(s) replaced" starts every rank; one after a generation
        that never became ready starts only the ranks not declared failed (so does a re-partition,
        taken to keep its survivors' rank numbers: unchecked). (A campaign once took the six
        survivors a deadline restarted for ranks 0-5 and SIGKILLed healthy rank 2 as "rank 0".)"""
        failed = FAILED_LINE.search(text)
        m = REPLACED.search(text)
        if failed:
            self.failed.add(int(failed.group(1)))
        elif m:
            new = [int(x) for x in m.group(1).split(",") if x.strip()]
            self.pending += new
            self.failed.difference_update(new)
        elif ALL_REPLACED.search(text):
            self.pending += list(range(ranks))
            self.failed.clear()
        elif RESTART_ALL.search(text):
            self.pending += [r for r in range(ranks) if r not in self.failed]
        self._assign()

    def _assign(self) -> None:
        while self.unassigned and self.pending:
            self.of[self.unassigned.pop(0)] = self.pending.pop(0)

    def pid_of(self, rank: int, alive: set[int]) -> int | None:
        pids = [p for p, r in self.of.items() if r == rank and p in alive]
        return max(pids) if pids else None


# -- one run ----------------------------------------------------------------------------------------

@dataclass
class RunRecord:
    seed: int
    outcome: str
    rc: int | None
    wall_s: float
    weight_diff: float | None
    faults: list[str]
    fired: list[dict]
    touched: list[int]
    healthy_excluded: dict
    leaked: list[str]
    mapping_doubts: list[str]
    last_lines: list[str]
    dir: str
    load: int | None = None  # the campaign's --load (None in summaries written before it was kept)


def train_command(python: str, plan: Path, rundir: Path, iterations: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [python, "-m", "schedc", "train", str(plan), "--iterations", str(iterations),
            "--save-weights", str(rundir / "weights.pt"), "--log", str(rundir / "log.json"),
            "--checkpoint-every", "20", "--checkpoint-dir", str(rundir / "ckpt"), *extra]


class Run:
    """One run of `schedc train` with the faults of its seed (see the module docstring)."""

    def __init__(self, seed: int, faults: tuple[Fault, ...], plan: Path, rundir: Path, iterations: int,
                 silence: float, bound: float, say, replay: str, extra: tuple[str, ...] = ()):
        self.seed, self.faults, self.plan, self.dir = seed, faults, plan, rundir
        self.extra = extra  # more `schedc train` options (--shadow, --recovery)
        self.iterations, self.silence, self.bound, self.say = iterations, silence, bound, say
        self.replay = replay
        self.fired: list[dict] = []
        self.fired_at: dict[int, float] = {}
        self.due: dict[int, float] = {}  # fault index -> when it fires
        self.conts: list[tuple[float, int, str]] = []  # (when, pid, what)
        self.touched: set[int] = set()
        self.ranks = Ranks(pending=list(range(RANKS)))
        self.known: set[int] = set()
        self.workers: set[int] = set()  # every worker pid seen (as a forkserver's child)
        self.max_iteration = -1
        self.lines: list[tuple[float, str]] = []
        self.doubts: list[str] = []

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = train_command(sys.executable, self.plan, self.dir, self.iterations, self.extra)
        env = dict(os.environ, PYTHONPATH=str(ROOT), SCHEDC_DEBUG="1", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1")
        (self.dir / "command.txt").write_text(
            f"replay: {self.replay}\n"
            f"train:  PYTHONPATH={ROOT} SCHEDC_DEBUG=1 OMP_NUM_THREADS=1 {' '.join(cmd)}\n")
        (self.dir / "faults.json").write_text(json.dumps([asdict(f) | {"text": f.describe()} for f in self.faults],
                                                        indent=1))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True, text=True, errors="replace", bufsize=1)
        self.sid = self.proc.pid
        self.q: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.q.put((time.monotonic(), line.rstrip("\n")))
        self.q.put(None)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # - the loop -

    def go(self) -> tuple[int | None, bool, list[str]]:
        """Run to the end; (exit status, hung, leaked processes)."""
        self.start()
        last_output, eof, hung = time.monotonic(), False, False
        while True:
            try:
                item = self.q.get(timeout=0.05)
                while True:
                    if item is None:
                        eof = True
                    else:
                        last_output = item[0]
                        self._line(item[0] - self.t0, item[1])
                    item = self.q.get_nowait()
            except queue.Empty:
                pass
            procs = session(self.sid)
            self._births(procs)
            self._fire_due(procs)
            self._cont_due()
            if eof and self.proc.poll() is not None:
                break
            quiet = time.monotonic() - last_output
            if quiet > self.silence or self.now() > self.bound:
                hung = True
                self._hung(procs, quiet)
                break
        rc = self.proc.wait()
        self.reader.join(timeout=5)
        while not self.q.empty():
            item = self.q.get_nowait()
            if item is not None:
                self._line(item[0] - self.t0, item[1])
        leaked = self._reap()
        (self.dir / "output.txt").write_text("".join(f"[{t:8.3f}] {s}\n" for t, s in self.lines))
        return rc, hung, leaked

    def _line(self, t: float, text: str) -> None:
        self.lines.append((t, text))
        m = ITERATION.match(text)
        if m:
            self.max_iteration = max(self.max_iteration, int(m.group(1)))
        self.ranks.line(text, RANKS)
        phases = [name for name, rx in PHASE_MARKERS.items() if rx.search(text)]
        for i, f in enumerate(self.faults):
            if i in self.due or i in self.fired_at:
                continue
            if f.trigger == "iteration" and self.max_iteration >= f.at:
                self.due[i] = t + f.delay
            elif f.trigger == "phase" and f.marker in phases:
                self.due[i] = t + f.delay
            elif (f.trigger == "after" and f.at in self.fired_at and t >= self.fired_at[f.at]
                  and phases and (f.marker == "any" or f.marker in phases)):
                self.due[i] = t + f.delay
        m = FAILED_LINE.search(text)
        if m and "SIGKILL" in m.group(2):
            self._check_kill(int(m.group(1)))

    def _births(self, procs: dict[int, Proc]) -> None:
        new = [p.pid for p in procs.values()
               if p.pid not in self.known and is_forkserver_cmd(p.cmd) and p.ppid != self.sid]
        for p in procs:
            self.known.add(p)
        self.workers.update(new)
        if new:
            self.ranks.born(new, self.now())
        for i, f in enumerate(self.faults):
            if f.trigger == "startup" and i not in self.due and self.ranks.first_birth is not None:
                self.due[i] = self.ranks.first_birth + f.delay

    def _fire_due(self, procs: dict[int, Proc]) -> None:
        t = self.now()
        for i, when in sorted(self.due.items(), key=lambda kv: kv[1]):
            if i in self.fired_at or when > t:
                continue
            self.fired_at[i] = t
            self._fire(i, self.faults[i], procs, t)

    def _fire(self, i: int, f: Fault, procs: dict[int, Proc], t: float) -> None:
        targets: list[tuple[int, str]] = []  # (pid, what)
        if f.target == "worker":
            alive = roles(procs, self.sid, self.workers)[1]
            for want in f.ranks:  # that rank, else the next rank (cyclically) that has a process
                for k in range(RANKS):
                    r = (want + k) % RANKS
                    pid = self.ranks.pid_of(r, alive)
                    if pid is not None and pid not in [p for p, _ in targets]:
                        targets.append((pid, f"rank {r}"))
                        self.touched.add(r)
                        break
        elif f.target == "forkserver":
            targets = [(pid, "forkserver") for pid in sorted(roles(procs, self.sid, self.workers)[0])]
        else:
            targets = [(p.pid, "resource tracker") for p in procs.values()
                       if p.state != "Z" and "multiprocessing.resource_tracker" in p.cmd]
        sig = signal.SIGKILL if f.action == "kill" else signal.SIGSTOP
        done = []
        for pid, what in targets:
            if self._signal(pid, sig):
                done.append(what)
                if f.action == "stop":
                    self.conts.append((t + (f.cont_after or 0.0), pid, what))
        record = {"fault": i, "t": round(t, 3), "signal": sig.name, "targets": done,
                  "pids": [p for p, _ in targets], "iteration": self.max_iteration}
        self.fired.append(record)
        text = f"{sig.name} to {', '.join(done) if done else 'nothing (no such process)'}"
        self.lines.append((t, f"<chaos> fault {i}: {text} ({f.describe()})"))
        self.say(f"    t={t:7.3f} s  fault {i}: {text}")

    def _signal(self, pid: int, sig: int) -> bool:
        """Signal `pid` only if it is still in this run's session."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[3]) != self.sid:
                return False
            os.kill(pid, sig)
            return True
        except (OSError, ValueError, IndexError):
            return False

    def _cont_due(self) -> None:
        t = self.now()
        for item in [c for c in self.conts if c[0] <= t]:
            self.conts.remove(item)
            if self._signal(item[1], signal.SIGCONT):
                self.lines.append((t, f"<chaos> SIGCONT to {item[2]} (pid {item[1]})"))

    def _check_kill(self, rank: int) -> None:
        """A rank reported killed by SIGKILL: the script's map should say it signalled that rank
        (or the supervisor fenced it: it was declared hung first)."""
        if rank in self.touched:
            return
        fenced = any(f"rank {rank} GPU" in s and "failed" in s and "SIGKILL" not in s for _, s in self.lines)
        if not fenced:
            self.doubts.append(f"rank {rank} reported killed by SIGKILL, but the script's map never "
                               "signalled it")

    def _hung(self, procs: dict[int, Proc], quiet: float) -> None:
        self.lines.append((self.now(), f"<chaos> HUNG: {quiet:.1f} s without output, {self.now():.1f} s in all"))
        self._dump(procs, "procs.txt")
        for p in procs.values():  # stopped targets must not keep the run from writing its log
            if p.state == "T":
                self._signal(p.pid, signal.SIGCONT)
        self._signal(self.sid, signal.SIGTERM)  # the run writes its log on SIGTERM
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self._killpg()

    def _role(self, p: Proc) -> str:
        if p.pid == self.sid:
            return "schedc train"
        if is_forkserver_cmd(p.cmd):
            if p.ppid == self.sid and p.pid not in self.workers:
                return "forkserver"
            return f"worker rank {self.ranks.of.get(p.pid, '?')}"
        return "resource tracker" if "resource_tracker" in p.cmd else p.cmd[:60]

    def _dump(self, procs: dict[int, Proc], name: str) -> None:
        rows = []
        for p in sorted(procs.values(), key=lambda p: p.pid):
            role = self._role(p)
            try:
                wchan = Path(f"/proc/{p.pid}/wchan").read_text()
            except OSError:
                wchan = "?"
            rows.append(f"{p.pid:>8} ppid {p.ppid:>8} {p.state} wchan={wchan:<24} {role}")
        with open(self.dir / name, "a") as fh:
            fh.write(f"t={self.now():.3f} s\n" + "\n".join(rows) + "\n")

    def _killpg(self) -> None:
        try:
            os.killpg(self.sid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self, grace: float = 15.0) -> list[str]:
        """Processes left in the session after the run's own exited: the workers of a live run
        exit by themselves within ~10 s once the store is gone; what is left after `grace` leaked."""
        deadline = time.monotonic() + grace
        procs = session(self.sid)
        while procs and time.monotonic() < deadline:
            time.sleep(0.2)
            procs = {p: v for p, v in session(self.sid).items() if v.state != "Z"}
        leaked = []
        if procs:
            self._dump(procs, "procs.txt")
            leaked = [f"pid {p.pid} ({self._role(p)}) state {p.state}" for p in procs.values()]
        self._killpg()
        return leaked


# -- the campaign ----------------------------------------------------------------------------------

def compile_plan(out: Path) -> Path:
    import schedc

    plan = out / "plan"
    if not (plan / "schedule.json").exists():
        schedc.compile(SPEC).write(plan)
    return plan


def reference(plan: Path, iterations: int):
    from schedc.runtime import load_manifest, reference_train

    return reference_train(load_manifest(plan), iterations)[0]


def weight_diff(path: Path, ref: dict) -> float | None:
    import torch

    if not path.exists():
        return None
    got = torch.load(path, weights_only=True)
    if list(got) != list(ref):
        return float("inf")
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["python3", "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def fired_by_target(records: list[RunRecord]) -> dict[str, int]:
    """How many processes the faults of `records` signalled, by kind of target and signal
    ("worker SIGKILL", "forkserver SIGSTOP", "resource tracker SIGKILL", ...), and under
    "no process" the faults that found none to signal (their rank's or role's process gone)."""
    out: dict[str, int] = {}
    for r in records:
        for f in r.fired:
            if not f["targets"]:
                out["no process"] = out.get("no process", 0) + 1
            for t in f["targets"]:
                key = f"{'worker' if t.startswith('rank ') else t} {f['signal']}"
                out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def table(records: list[RunRecord]) -> str:
    """A markdown table of `records`, a row per --load value ("load ?": not recorded)."""
    groups: dict[str, list[RunRecord]] = {}
    for r in sorted(records, key=lambda r: (r.load is None, r.load or 0)):
        groups.setdefault(f"load {r.load if r.load is not None else '?'}", []).append(r)
    head = ["campaign", "runs", "finished exact (max weight diff)", *OUTCOMES[1:],
            "healthy excluded (ranks / runs)", "leaked (runs)", "faults fired (processes signalled)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in groups.items():
        counts = {o: sum(1 for r in rs if r.outcome == o) for o in OUTCOMES}
        diffs = [r.weight_diff for r in rs if r.outcome == "finished exact" and r.weight_diff is not None]
        exact = f"{counts[OUTCOMES[0]]}" + (f" ({max(diffs):.2g})" if diffs else "")
        healthy = f"{sum(len(r.healthy_excluded) for r in rs)} / {sum(1 for r in rs if r.healthy_excluded)}"
        fired = ", ".join(f"{k} {n}" for k, n in fired_by_target(rs).items()) or "none"
        row = [name, str(len(rs)), exact, *(str(counts[o]) for o in OUTCOMES[1:]), healthy,
               str(sum(1 for r in rs if r.leaked)), fired]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def load_summaries(paths: list[Path]) -> list[RunRecord]:
    """The runs of campaigns' summary.json files (a campaign's --out folder names its own)."""
    records = []
    for p in paths:
        p = p / "summary.json" if p.is_dir() else p
        records += [RunRecord(**r) for r in json.loads(p.read_text())]
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="run k has seed SEED + k")
    ap.add_argument("--load", type=int, default=0, choices=(0, 2), help="busy loops loading the CPU meanwhile")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "schedc-chaos",
                    help="where the plan, the bad runs and summary.json go (default: TMPDIR/schedc-chaos)")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--silence", type=float, default=120.0, help="seconds without a line: hung")
    ap.add_argument("--bound", type=float, default=420.0, help="seconds in all: hung")
    ap.add_argument("--no-faults", action="store_true", help="runs without faults (the exactness baseline)")
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help="kinds of target to signal, comma-separated (default: all); a worker stands in for the others")
    ap.add_argument("--shadow", action="store_true", help="train with --shadow (every stage also on the next)")
    ap.add_argument("--recovery", choices=("auto", "reroute", "drop-pipeline", "repartition", "restart"),
                    help="train with this --recovery (restart: every failure restarts every process, "
                         "after the survivors save their state when --shadow)")
    ap.add_argument("--keep-all", action="store_true", help="keep every run's directory, not only bad ones")
    ap.add_argument("--table", type=Path, nargs="+", metavar="OUT",
                    help="only print the table of these campaigns' summary.json (their --out), a row per --load")
    args = ap.parse_args(argv)
    if args.table:
        print(table(load_summaries(args.table)))
        return 0

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    targets = tuple(t for t in args.targets.split(",") if t)
    if "worker" not in targets or not set(targets) <= set(TARGETS):
        ap.error(f"--targets: a comma-separated subset of {','.join(TARGETS)} that includes worker")
    plan = compile_plan(out)
    ref = reference(plan, args.iterations)
    print(f"plan {plan} (3 x 3 MLP, Adam), {args.iterations} iterations; tolerance {TOLERANCE:g}; "
          f"load {args.load}; seeds {args.seed}..{args.seed + args.runs - 1}", flush=True)
    load = start_load(args.load)
    records: list[RunRecord] = []
    summary_path = out / "summary.json"
    try:
        for k in range(args.runs):
            seed = args.seed + k
            faults = () if args.no_faults else plan_faults(seed, args.iterations, targets=targets)
            rundir = out / f"run-{seed}"
            if rundir.exists():
                shutil.rmtree(rundir)
            extra = (("--shadow",) if args.shadow else ()) + (("--recovery", args.recovery) if args.recovery else ())
            replay = (f"python bench/chaos.py --runs 1 --seed {seed} --iterations {args.iterations}"
                      + (f" --load {args.load}" if args.load else "")
                      + (f" --targets {','.join(targets)}" if targets != TARGETS else "")
                      + (" --shadow" if args.shadow else "") + (f" --recovery {args.recovery}" if args.recovery else ""))
            print(f"run seed {seed}: {replay}", flush=True)
            for i, f in enumerate(faults):
                print(f"    fault {i}: {f.describe()}", flush=True)
            run = Run(seed, faults, plan, rundir, args.iterations, args.silence, args.bound,
                      lambda s: print(s, flush=True), replay, extra)
            t = time.monotonic()
            rc, hung, leaked = run.go()
            wall = time.monotonic() - t
            output = "\n".join(s for _, s in run.lines)
            diff = weight_diff(rundir / "weights.pt", ref) if rc == 0 and not hung else None
            outcome = classify(rc, output, hung, diff)
            try:
                log = json.loads((rundir / "log.json").read_text())
            except (OSError, ValueError):
                log = None
            healthy = healthy_excluded(log, output, run.touched)
            rec = RunRecord(seed, outcome, rc, round(wall, 2), diff, [f.describe() for f in faults], run.fired,
                            sorted(run.touched), {str(r): w for r, w in healthy.items()}, leaked, run.doubts,
                            [s for _, s in run.lines[-15:]], str(rundir), args.load)
            records.append(rec)
            note = f"max diff {diff:.3g}" if diff is not None else f"exit {rc}"
            print(f"  -> {outcome} ({note}), {wall:.1f} s"
                  + (f"; healthy excluded {rec.healthy_excluded}" if healthy else "")
                  + (f"; leaked {leaked}" if leaked else "")
                  + (f"; map doubts {run.doubts}" if run.doubts else ""), flush=True)
            bad = outcome != "finished exact" or healthy or leaked or run.doubts
            if not bad and not args.keep_all:
                shutil.rmtree(rundir, ignore_errors=True)
            else:
                shutil.rmtree(rundir / "ckpt", ignore_errors=True)
            summary_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    finally:
        stop_load(load)
    print()
    print(table(records))
    for r in records:
        if r.outcome != "finished exact" or r.healthy_excluded or r.leaked or r.mapping_doubts:
            print(f"\nseed {r.seed}: {r.outcome} (exit {r.rc}, {r.wall_s} s), kept in {r.dir}")
            for f in r.fired:
                print(f"  fired at {f['t']} s (iteration {f['iteration']}): {f['signal']} to {f['targets']}")
            if r.healthy_excluded:
                print(f"  healthy excluded: {r.healthy_excluded}")
            if r.leaked:
                print(f"  leaked: {r.leaked}")
            print("  last lines:\n" + "\n".join("    " + s for s in r.last_lines[-8:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
