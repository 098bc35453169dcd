"""Detection: which ranks have failed, and why, from process exits and heartbeats.

Pure bookkeeping on the supervisor's clock (no I/O, so it is tested by
feeding it numbers). Three rules:

1. **Exit**: a worker process that ends (killed, crashed) while the run
   needs it has failed; the agent reports it at once (process sentinels).
2. **Silence**, judged by phi accrual (Hayashibara et al. 2004, as Cassandra
   and Akka do): every worker's heartbeat thread rewrites ``hb/R`` with a
   fresh sequence number every interval. Per rank the detector keeps the
   last `WINDOW` gaps between sequence changes as the supervisor observes
   them, and phi(t) = -log10 P(a gap lasts t or longer), the gaps taken as
   normal with their mean and standard deviation (at least `MIN_STD`). A
   rank is suspected (stopped, wedged: failed, fenced) when its silence is
   at least `heartbeat_timeout` (``--detect-timeout``, the floor) and phi
   of it reaches `phi` (``--phi``, default 8: a healthy rank's gap that long
   is a one-in-10^8 event). Regular beats leave the floor as the bound; a
   rank whose beats jitter (a loaded host) gets a bound that grows with it.
   The silence judged is what the rank's *peers* did not share: from its
   silence is taken the median over the other ranks of the longest silence
   each had since its last beat, so a host-wide pause (every rank late
   together: the machine or the store stalled) is blamed on nobody, while a
   rank that stops as its peers beat on is found. Silence longer than
   `SILENCE_CEILING` floors is suspected whatever the peers did.
   **Start-up**: a rank that has not beaten yet since it was started is
   judged against its peers: once at least half of them have started it is
   allowed `STARTUP_FACTOR` x the slowest start-up seen so far (at least
   `STARTUP_FLOOR`, at most `startup_timeout`); while none has started (the
   whole host is slow) nobody is declared, and past `startup_timeout`
   `nobody_started` says so (the supervisor gives up with a diagnostic).
3. **Stall**: heartbeats also carry the number of ops a rank has run and
   whether it is blocked in a wait. If every member is inside an iteration
   and none has finished an op for
   `stall_timeout` seconds, the members that are *not* waiting are stuck in
   compute (a hung kernel, an endless loop): failed, fenced. A rank that
   merely waits for a slow or stuck peer is never blamed. (If every member
   waits, nobody is to blame: `stalled_waiting` says so, and the supervisor
   gives up with a diagnostic rather than kill at random.) While a member is
   silent (`Detector.quiet`: half the lesser of the two timeouts, at least
   ten beats), the others may be waiting for a dead peer: the stall rule
   defers to the silence rule, for at most the silence ceiling, so a lost
   host is recovered, not called stuck.

Time the supervisor itself did not look (its loop or the store stalled, so
no heartbeat could be read) is not held against the workers: a gap between
two checks longer than half the heartbeat timeout moves every clock forward
by that gap.

The detector also gives each rank's **beat rate** (sequence numbers per
second of wall time, so the supervisor's own polling does not change it):
a process the OS runs less than its peers (stopped now and then, starved)
beats less often than they do, which the fail-slow policy uses
(`schedc.live.slowness`). Heartbeats also carry the time the worker's
process was held stopped (`schedc.live.stall`), and `stall_fractions` gives
each rank's share of the last `STALL_SPAN` seconds so spent: what tells a
throttled process (stopped from outside) from one that load starves.
"""

from __future__ import annotations

import math
import signal
import statistics
from collections import deque
from dataclasses import dataclass

#: Gaps kept per rank (the phi detector's window): at the default 50 ms heartbeat about 10 s of
#: history, so a loaded spell widens a rank's bound for a while, then ages out. Longer: slower to
#: forget a spell; shorter: one spell's few long gaps weigh more. Re-measure with
#: bench/live_false_alarms.py (false alarms under busy loops, detection of a stopped rank).
WINDOW = 200
#: Gaps needed before phi counts at all (until then the floor alone decides).
MIN_SAMPLES = 10
#: Least standard deviation of the gaps, seconds: perfectly regular beats must not make one late
#: beat infinitely suspicious (the floor decides before this matters at the default 3 s).
MIN_STD = 0.1
#: Heartbeat intervals a member may be silent, at least, before the stall rule defers to the silence
#: rule (`Detector.quiet`).
QUIET_BEATS = 10
#: Silence this many floors (`heartbeat_timeout`) long is suspected even when the peers were
#: silent too: the bound on a pause shared by every rank before someone is blamed.
SILENCE_CEILING = 10.0
#: Start-up: once half of a rank's peers have started, it is allowed STARTUP_FACTOR x the slowest
#: start-up seen so far, at least STARTUP_FLOOR seconds (a rank started alone, a replacement,
#: on a host that got busier since) and at most `startup_timeout`. Two busy loops on the shared
#: 2-core host stretched start-ups to 129 s with every rank alike: relative, not absolute.
STARTUP_FACTOR = 3.0
STARTUP_FLOOR = 30.0
#: Seconds of beats the beat rate is measured over.
RATE_SPAN = 2.0
#: Seconds of beats the stalled fraction is measured over: ten cycles of a throttle that stops a
#: process for 50 ms in every 100; longer is steadier but finds a throttle later.
STALL_SPAN = 1.0


def phi(silence: float, gaps) -> float:
    """-log10 of the probability that a gap lasts `silence` or longer, the gaps (seconds) taken
    as normal with their mean and standard deviation (at least `MIN_STD`); inf with fewer than
    `MIN_SAMPLES` gaps (nothing learned yet: the caller's floor decides)."""
    if len(gaps) < MIN_SAMPLES:
        return math.inf
    mean = statistics.fmean(gaps)
    std = max(statistics.pstdev(gaps, mean), MIN_STD)
    z = (silence - mean) / std
    p = 0.5 * math.erfc(z / math.sqrt(2))
    if p > 1e-300:
        return -math.log10(p)
    # Past double precision: log P ~ -z^2/2 - log(z sqrt(2 pi)) (the normal tail, Mills ratio).
    return (z * z / 2 + math.log(z * math.sqrt(2 * math.pi))) / math.log(10)


@dataclass(frozen=True)
class Suspect:
    """A rank the detector declares failed."""

    rank: int
    cause: str  # "killed by SIGKILL", "no heartbeat for 3.0 s", ...
    fence: bool  # still alive: kill it before the run goes on
    at: float  # supervisor clock (seconds) when it was declared
    silent: bool = False  # declared for its silence (no heartbeat), which load can cause too
    out_of_reach: str = ""  # why its process could not be watched (its host's agent was replaced)

    @property
    def maybe_healthy(self) -> str:
        """Why the GPU may well be healthy ("": no reason to think so): it is taken back once."""
        return self.out_of_reach or ("declared failed by its silence" if self.silent else "")


#: The least time a rank may finish (state "finish": its last checkpoint and weights written, no
#: op counted) before it counts as stuck (`Detector.finish_timeout`: ten stall bounds if longer):
#: the stall rule's own bound (ten iterations) killed the writers of the run's last checkpoint, a
#: big stage's write takes tens of seconds (2.6 GB at 100 MB/s: 26 s), and a rank really stuck
#: there must still be found within a bound (the simulation's 400 s).
FINISH_STALL_S = 120.0


@dataclass(frozen=True)
class Beat:
    """One heartbeat: ``"seq gen iteration ops state [stalled_ms]"`` (state: run, wait, finish or idle;
    stalled_ms: the milliseconds the process was held stopped so far, `schedc.live.stall`, where
    its worker runs the stall clock)."""

    seq: int
    generation: int
    iteration: int
    ops: int
    state: str
    stalled_ms: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Beat | None":
        parts = text.split()
        if len(parts) not in (5, 6):
            return None
        try:
            stalled = int(parts[5]) if len(parts) == 6 else None
            return cls(int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4], stalled)
        except ValueError:
            return None

    def __str__(self) -> str:
        tail = "" if self.stalled_ms is None else f" {self.stalled_ms}"
        return f"{self.seq} {self.generation} {self.iteration} {self.ops} {self.state}{tail}"


def exit_cause(code: int) -> str:
    """`multiprocessing` exit code -> "killed by SIGKILL" / "exited with status 3"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Detector:
    """Watches a set of ranks; `check(now)` returns the newly failed ones (each once)."""

    def __init__(self, *, heartbeat_timeout: float, stall_timeout: float, startup_timeout: float,
                 phi: float = 8.0, beat_interval: float = 0.05):
        self.heartbeat_timeout = heartbeat_timeout  # the floor: no suspicion of silence shorter than this
        self.stall_timeout = stall_timeout
        self.beat_interval = beat_interval  # the workers' heartbeat interval (`--heartbeat-interval`)
        self.startup_timeout = startup_timeout  # the ceiling of a start-up
        self.phi_threshold = phi
        self._since: dict[int, float] = {}  # rank -> when watching began
        self._beat: dict[int, Beat] = {}
        self._beat_at: dict[int, float] = {}  # when the sequence number last changed
        self._gaps: dict[int, deque[tuple[float, float]]] = {}  # rank -> (when it ended, gap) of its last gaps
        self._seqs: dict[int, deque[tuple[float, int]]] = {}  # rank -> (when seen, sequence number), for rates
        self._stalls: dict[int, deque[tuple[float, int]]] = {}  # rank -> (when seen, stalled ms so far)
        self._progress_at: dict[int, float] = {}  # when the op count last changed
        self._declared: set[int] = set()
        self._checked: float | None = None  # when `check` last ran
        self._slowest_start = 0.0  # the longest start-up (watch to first beat) seen so far
        self.stalled_waiting = False
        self.nobody_started = False  # every rank still silent since it started, past `startup_timeout`

    def watch(self, rank: int, now: float) -> None:
        """Start watching `rank` (a worker just started, or a run began)."""
        self._since[rank] = now
        self._beat.pop(rank, None)
        self._beat_at.pop(rank, None)
        self._gaps[rank] = deque(maxlen=WINDOW)
        self._seqs[rank] = deque()
        self._stalls[rank] = deque()
        self._progress_at[rank] = now
        self._declared.discard(rank)

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (failed, fenced, or the run ended)."""
        for d in (self._since, self._beat, self._beat_at, self._progress_at, self._gaps, self._seqs, self._stalls):
            d.pop(rank, None)

    def watching(self) -> set[int]:
        return set(self._since)

    def restart_progress(self, now: float) -> None:
        """A new generation begins: stall time counts from now (reconfiguring is not a stall)."""
        for r in self._progress_at:
            self._progress_at[r] = now
        self.stalled_waiting = False

    def beat(self, rank: int, text: str, now: float) -> None:
        if rank not in self._since:
            return
        beat = Beat.parse(text)
        if beat is None:
            return
        self._forgive_blindness(now)  # (before the gap is measured: blind time is no gap)
        old = self._beat.get(rank)
        if old is None or beat.seq != old.seq:
            last = self._beat_at.get(rank)
            if last is None:
                self._slowest_start = max(self._slowest_start, now - self._since[rank])
            else:
                self._gaps[rank].append((now, now - last))
            self._beat_at[rank] = now
            seqs = self._seqs[rank]
            seqs.append((now, beat.seq))
            while len(seqs) > 2 and seqs[1][0] <= now - RATE_SPAN:
                seqs.popleft()
            if beat.stalled_ms is not None:
                stalls = self._stalls[rank]
                stalls.append((now, beat.stalled_ms))
                while len(stalls) > 2 and stalls[1][0] <= now - STALL_SPAN:
                    stalls.popleft()
        if old is None or beat.ops != old.ops:
            self._progress_at[rank] = now
        self._beat[rank] = beat

    def last_beat(self, rank: int) -> Beat | None:
        return self._beat.get(rank)

    def phi(self, rank: int, silence: float) -> float:
        """phi of a silence of `silence` seconds for `rank`, from its gaps so far."""
        return phi(silence, [g for _, g in self._gaps.get(rank, ())])

    def beat_rates(self, now: float) -> dict[int, float]:
        """Beats per second of each watched rank over about the last `RATE_SPAN` seconds (to
        `now`, so a rank silent now counts as slow), for ranks seen beating that long."""
        out = {}
        for rank, seqs in self._seqs.items():
            if len(seqs) >= 2 and now - seqs[0][0] >= RATE_SPAN / 2 and rank not in self._declared:
                out[rank] = (seqs[-1][1] - seqs[0][1]) / (now - seqs[0][0])
        return out

    def stall_fractions(self, now: float) -> dict[int, float]:
        """The share of about the last `STALL_SPAN` seconds (to `now`) each watched rank's process
        was held stopped, as its heartbeats say (ranks whose beats carry no stall clock, or seen
        for less than half the span, are left out)."""
        out = {}
        for rank, stalls in self._stalls.items():
            if len(stalls) >= 2 and now - stalls[0][0] >= STALL_SPAN / 2 and rank not in self._declared:
                out[rank] = min(1.0, max(0.0, (stalls[-1][1] - stalls[0][1]) / 1000 / (now - stalls[0][0])))
        return out

    def exited(self, rank: int, code: int, now: float) -> Suspect | None:
        """A watched rank's process ended: failed (once)."""
        return self.lost(rank, exit_cause(code), now)

    def lost(self, rank: int, cause: str, now: float, *, out_of_reach: str = "") -> Suspect | None:
        """A watched rank's process is gone or out of reach (`cause` says how): failed (once)."""
        if rank not in self._since or rank in self._declared:
            return None
        self._declared.add(rank)
        return Suspect(rank, cause, fence=False, at=now, out_of_reach=out_of_reach)

    def check(self, now: float, *, running: bool) -> list[Suspect]:
        """Silent ranks, and (while `running`) ranks stuck in compute."""
        self._forgive_blindness(now)
        self.nobody_started = False
        out: list[Suspect] = []
        for rank, since in sorted(self._since.items()):
            if rank in self._declared:
                continue
            last = self._beat_at.get(rank)
            s = self._startup(rank, since, now) if last is None else self._silent(rank, last, now)
            if s is not None:
                out.append(s)
        if running and not out:
            out.extend(self._stalled(now))
        for s in out:
            self._declared.add(s.rank)
        return out

    def _silent(self, rank: int, last: float, now: float) -> Suspect | None:
        silence = now - last
        floor = self.heartbeat_timeout
        if silence <= floor:
            return None
        if silence > SILENCE_CEILING * floor:
            return Suspect(rank, f"no heartbeat for {silence:.1f} s (stopped or hung)", fence=True, at=now, silent=True)
        shared = self._shared(rank, last, now)
        excess = silence - shared
        if excess <= floor:
            return None
        p = self.phi(rank, excess)
        if p < self.phi_threshold:
            return None
        gaps = [g for _, g in self._gaps[rank]]
        seen = (f"; its beats came every {statistics.fmean(gaps) * 1e3:.0f} ms, phi {p:.0f}"
                if len(gaps) >= MIN_SAMPLES and math.isfinite(p) else "")
        peers = f", {shared:.1f} s of it shared by its peers" if shared >= 0.5 else ""
        return Suspect(rank, f"no heartbeat for {silence:.1f} s (stopped or hung{peers}{seen})", fence=True, at=now, silent=True)

    def _shared(self, rank: int, since: float, now: float) -> float:
        """How long `rank`'s peers were silent too since `since` (its last beat): the median over
        the other beating ranks of the longest silence each had after `since`."""
        longest = []
        for peer, at in self._beat_at.items():
            if peer == rank or peer in self._declared:
                continue
            worst = now - max(at, since)  # its silence now (the part after `since`)
            for end, gap in reversed(self._gaps[peer]):
                if end <= since:
                    break
                worst = max(worst, min(gap, end - since))
            longest.append(worst)
        return statistics.median(longest) if longest else 0.0

    def _startup(self, rank: int, since: float, now: float) -> Suspect | None:
        waited = now - since
        peers = [p for p in self._since if p != rank and p not in self._declared]
        started = sum(1 for p in peers if p in self._beat_at)
        if peers and not started:  # the whole host is slow, or nobody can reach the store: blame nobody
            self.nobody_started = self.nobody_started or waited > self.startup_timeout
            return None
        if peers and 2 * started >= len(peers):
            limit = min(self.startup_timeout, max(STARTUP_FLOOR, STARTUP_FACTOR * self._slowest_start))
            why = (f" ({started} of its {len(peers)} peers did, the slowest in {self._slowest_start:.1f} s; "
                   f"allowed {limit:.1f} s)")
        else:  # alone, or most peers not started either: the ceiling
            limit, why = self.startup_timeout, ""
        if waited <= limit:
            return None
        return Suspect(rank, f"sent no heartbeat in {waited:.1f} s since it started{why}", fence=True, at=now, silent=True)

    def _forgive_blindness(self, now: float) -> None:
        """Called whenever the supervisor looks (a beat read, a check): a long gap since it last
        looked was its own blindness."""
        last, self._checked = self._checked, max(now, self._checked or now)
        if last is None or now - last <= self.heartbeat_timeout / 2:
            return
        gap = now - last
        for clock in (self._since, self._beat_at, self._progress_at):
            for rank, t in clock.items():
                clock[rank] = min(t + gap, now)
        for rank, gaps in self._gaps.items():
            self._gaps[rank] = deque(((min(end + gap, now), g) for end, g in gaps), maxlen=WINDOW)

    def _stall_explained_by_silence(self, ranks: list[int], latest: float, now: float) -> bool:
        """Whether a member has gone silent, so the others may be waiting for a dead peer: the
        silence rule, not the stall rule, judges that (a whole host lost leaves its peers waiting
        with no beat to blame, and a --detect-timeout past --stall-timeout would else end the run
        as stuck before the silence is found). Deferred for at most the silence rule's ceiling."""
        if now - latest > self.stall_timeout + SILENCE_CEILING * self.heartbeat_timeout:
            return False
        return any(now - self._beat_at.get(r, now) > self.quiet for r in ranks)

    @property
    def quiet(self) -> float:
        """How long a member may go without a beat before the stall rule waits for the silence rule:
        half the lesser of the two timeouts, and at least `QUIET_BEATS` heartbeat intervals (a
        stall bound of a few beats would else take every ordinary gap between beats for silence)."""
        return max(min(self.heartbeat_timeout, self.stall_timeout) / 2, QUIET_BEATS * self.beat_interval)

    @property
    def finish_timeout(self) -> float:
        """Seconds a finishing rank may go without an op before it counts as stuck."""
        return max(FINISH_STALL_S, 10 * self.stall_timeout)

    def _stalled(self, now: float) -> list[Suspect]:
        # Only ranks inside an iteration can stall it; the others (finished, joining the next
        # generation, catching up on standby) neither stall it nor excuse a rank that does. A rank
        # finishing (writing its last checkpoint and weights: no ops) is stuck only after `finish_timeout`.
        finishing = [Suspect(r, f"stuck finishing (its last checkpoint or weights) for "
                                f"{now - self._progress_at[r]:.1f} s", fence=True, at=now)
                     for r in self._since if r not in self._declared and r in self._beat
                     and self._beat[r].state == "finish" and now - self._progress_at[r] > self.finish_timeout]
        if finishing:
            return finishing
        ranks = [r for r in self._since if r not in self._declared and r in self._beat
                 and self._beat[r].state in ("run", "wait")]
        if not ranks:
            self.stalled_waiting = False
            return []
        latest = max(self._progress_at[r] for r in ranks)
        if now - latest <= self.stall_timeout or self._stall_explained_by_silence(ranks, latest, now):
            self.stalled_waiting = False
            return []
        busy = [r for r in ranks if self._beat[r].state == "run"]
        self.stalled_waiting = not busy
        return [Suspect(r, f"stuck in an op for {now - self._progress_at[r]:.1f} s while the others wait",
                        fence=True, at=now) for r in busy]
