"""Detection: which ranks have failed, and why, from process exits and heartbeats.

Pure bookkeeping on the supervisor's clock (no I/O, so it is tested by
feeding it numbers). Three rules:

1. **Exit**: a worker process that ends (killed, crashed) while the run
   needs it has failed; the agent reports it at once (process sentinels).
2. **Silence**: every worker's heartbeat thread rewrites ``hb/R`` with a
   fresh sequence number every interval. One that has not changed for
   `heartbeat_timeout` seconds belongs to a stopped (SIGSTOP) or wedged
   process: it is failed and must be fenced (killed) before the run goes on.
   A worker that has never beaten gets `startup_timeout`.
3. **Stall**: heartbeats also carry the number of ops a rank has run and
   whether it is blocked in a wait. If every member is inside an iteration
   and none has finished an op for
   `stall_timeout` seconds, the members that are *not* waiting are stuck in
   compute (a hung kernel, an endless loop): failed, fenced. A rank that
   merely waits for a slow or stuck peer is never blamed. (If every member
   waits, nobody is to blame: `stalled_waiting` says so, and the supervisor
   gives up with a diagnostic rather than kill at random.)

Time the supervisor itself did not look (its loop or the store stalled, so
no heartbeat could be read) is not held against the workers: a gap between
two checks longer than half the heartbeat timeout moves every clock forward
by that gap.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Suspect:
    """A rank the detector declares failed."""

    rank: int
    cause: str  # "killed by SIGKILL", "no heartbeat for 3.0 s", ...
    fence: bool  # still alive: kill it before the run goes on
    at: float  # supervisor clock (seconds) when it was declared
    silent: bool = False  # declared for its silence (no heartbeat), which load can cause too


@dataclass(frozen=True)
class Beat:
    """One heartbeat: ``"seq gen iteration ops state"`` (state: run, wait or idle)."""

    seq: int
    generation: int
    iteration: int
    ops: int
    state: str

    @classmethod
    def parse(cls, text: str) -> "Beat | None":
        parts = text.split()
        if len(parts) != 5:
            return None
        try:
            return cls(int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4])
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.seq} {self.generation} {self.iteration} {self.ops} {self.state}"


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

    def __init__(self, *, heartbeat_timeout: float, stall_timeout: float, startup_timeout: float):
        self.heartbeat_timeout = heartbeat_timeout
        self.stall_timeout = stall_timeout
        self.startup_timeout = startup_timeout
        self._since: dict[int, float] = {}  # rank -> when watching began
        self._beat: dict[int, Beat] = {}
        self._beat_at: dict[int, float] = {}  # when the sequence number last changed
        self._progress_at: dict[int, float] = {}  # when the op count last changed
        self._declared: set[int] = set()
        self._checked: float | None = None  # when `check` last ran
        self.stalled_waiting = False

    def watch(self, rank: int, now: float) -> None:
        """Start watching `rank` (a worker just started, or a run began)."""
        self._since[rank] = now
        self._beat.pop(rank, None)
        self._beat_at.pop(rank, None)
        self._progress_at[rank] = now
        self._declared.discard(rank)

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (failed, fenced, or the run ended)."""
        for d in (self._since, self._beat, self._beat_at, self._progress_at):
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
        old = self._beat.get(rank)
        if old is None or beat.seq != old.seq:
            self._beat_at[rank] = now
        if old is None or beat.ops != old.ops:
            self._progress_at[rank] = now
        self._beat[rank] = beat

    def last_beat(self, rank: int) -> Beat | None:
        return self._beat.get(rank)

    def exited(self, rank: int, code: int, now: float) -> Suspect | None:
        """A watched rank's process ended: failed (once)."""
        if rank not in self._since or rank in self._declared:
            return None
        self._declared.add(rank)
        return Suspect(rank, exit_cause(code), fence=False, at=now)

    def check(self, now: float, *, running: bool) -> list[Suspect]:
        """Silent ranks, and (while `running`) ranks stuck in compute."""
        self._forgive_blindness(now)
        out: list[Suspect] = []
        for rank, since in sorted(self._since.items()):
            if rank in self._declared:
                continue
            last = self._beat_at.get(rank)
            if last is None:
                if now - since > self.startup_timeout:
                    out.append(Suspect(rank, f"sent no heartbeat in {now - since:.1f} s since it started",
                                       fence=True, at=now, silent=True))
            elif now - last > self.heartbeat_timeout:
                out.append(Suspect(rank, f"no heartbeat for {now - last:.1f} s (stopped or hung)", fence=True, at=now,
                                   silent=True))
        if running and not out:
            out.extend(self._stalled(now))
        for s in out:
            self._declared.add(s.rank)
        return out

    def _forgive_blindness(self, now: float) -> None:
        last, self._checked = self._checked, now
        if last is None or now - last <= self.heartbeat_timeout / 2:
            return
        gap = now - last
        for clock in (self._since, self._beat_at, self._progress_at):
            for rank, t in clock.items():
                clock[rank] = min(t + gap, now)

    def _stalled(self, now: float) -> list[Suspect]:
        # Only ranks inside an iteration can stall it; the others (finished, joining the next
        # generation, catching up on standby) neither stall it nor excuse a rank that does.
        ranks = [r for r in self._since if r not in self._declared and r in self._beat
                 and self._beat[r].state in ("run", "wait")]
        if not ranks:
            self.stalled_waiting = False
            return []
        latest = max(self._progress_at[r] for r in ranks)
        if now - latest <= self.stall_timeout:
            self.stalled_waiting = False
            return []
        busy = [r for r in ranks if self._beat[r].state == "run"]
        self.stalled_waiting = not busy
        return [Suspect(r, f"stuck in an op for {now - self._progress_at[r]:.1f} s while the others wait",
                        fence=True, at=now) for r in busy]
