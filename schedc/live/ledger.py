"""Which iterations of a live run are done: the ranks' `IterationDone` reports, gathered.

An iteration of generation g is done when every rank that runs it has
reported it (`add` with those ranks). One a rank died before reporting is
done all the same once the next generation resumes after it: every survivor
applied its step (`commit_before`). An iteration run again after a rollback
gets a new record (`runs` counts them); `history` keeps every completion,
the per-rank detail of the newest `DETAIL_KEPT` only. Pure bookkeeping on
the supervisor's clock: no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from schedc.live.protocol import IterationDone
from schedc.live.slowness import cpu_share, measured_speed
from schedc.runtime.result import IterationRecord


#: Completions whose per-rank detail (`speeds`, `on_cpu`) is kept; older records keep their loss
#: and times only. Per rank and iteration that detail costs about 80 bytes (84 KiB an iteration
#: at 1,024 ranks): kept for every iteration, a run of 100,000 would hold 8 GB in the supervisor.
DETAIL_KEPT = 1000


class Ledger:
    def __init__(self, t0: float, *, with_loss: bool = True):
        self.t0 = t0  # the clock's zero (reports carry `time.time()`)
        self.with_loss = with_loss  # False with --emulate: no loss is computed
        self.records: dict[int, IterationRecord] = {}  # the latest completion of each iteration
        self.history: list[IterationRecord] = []  # every completion, in order
        self.first: int | None = None  # where the run started (a resumed run: the checkpoint's)
        self._reports: dict[tuple[int, int], dict[int, IterationDone]] = {}  # (generation, iteration) -> rank ->
        # Records are only ever added (an iteration run again replaces its own), so the newest one and
        # the first gap from the start only move forward: kept, not searched for on every tick.
        self._newest = -1
        self._gap = 0

    @property
    def completed(self) -> int:
        """Iterations completed so far (the next one to complete)."""
        return self._newest + 1

    @property
    def now(self) -> int:
        """The next iteration to complete as the run goes now: after the latest completion. After
        a rollback to an older checkpoint it is behind `completed` (the furthest ever done) until
        the iterations run again pass it; a planned switch starts, and a joiner catches up, from here."""
        return self.history[-1].iteration + 1 if self.history else (self.first or 0)

    def add(self, msg: IterationDone, members, speeds: dict[int, float]) -> IterationRecord | None:
        """One rank's report; the iteration's record once every one of `members` has reported.
        `speeds` are the speeds the generation's plan assumes (rank -> speed)."""
        reps = self._reports.setdefault((msg.gen, msg.it), {})
        reps[msg.rank] = msg
        if members is None or not set(reps) >= set(members):
            return None
        del self._reports[(msg.gen, msg.it)]
        return self._record(msg.it, msg.gen, reps, speeds)

    def commit_before(self, start: int, speeds_of) -> list[IterationRecord]:
        """A generation resumes at `start`: every iteration before it is committed. Records those
        whose last reports never came (from the reports that did), and drops what is left."""
        if self.first is None:
            self.first = start
        out = []
        for it in range(self.first, start):
            if it not in self.records:
                for (g, i), reps in sorted(self._reports.items(), reverse=True):
                    if i == it and reps:
                        del self._reports[(g, i)]
                        out.append(self._record(it, g, reps, speeds_of(g)))
                        break
        for key in [key for key in self._reports if key[1] < start]:
            del self._reports[key]
        return out

    def missing(self, iterations: int, limit: int | None = None) -> list[int]:
        """Iterations of the run not completed yet (the first `limit` of them, if given). From the
        first gap on: a run of a million iterations checked on every tick of the supervisor's
        loop took 0.1 s a tick when every iteration was looked up each time."""
        i = self._gap = max(self._gap, self.first or 0)
        while i in self.records:
            i += 1
        self._gap = i
        out: list[int] = []
        for i in range(i, iterations):
            if i not in self.records:
                out.append(i)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def _record(self, it: int, gen: int, reps: dict[int, IterationDone], speeds: dict[int, float]) -> IterationRecord:
        # The last stage sums the loss over its GPUs as it steps: each of its reports has all of it.
        losses = [r.loss for r in reps.values() if r.loss is not None]
        loss = losses[0] if losses and self.with_loss else None
        start = min(r.t0 for r in reps.values()) - self.t0
        end = max(r.t1 for r in reps.values()) - self.t0
        old = self.records.get(it)
        measured = {r: measured_speed(rep, speeds.get(r, 1.0)) for r, rep in sorted(reps.items())}
        record = IterationRecord(it, gen, loss, round(start, 4), round(end, 4), runs=(old.runs + 1) if old else 1,
                                 speeds={r: round(v, 4) for r, v in measured.items() if v is not None},
                                 on_cpu={r: round(cpu_share(rep), 4) for r, rep in sorted(reps.items())
                                         if rep.compute > 0 and rep.queued > 0})
        self.records[it] = record
        self._newest = max(self._newest, it)
        self.history.append(record)
        if len(self.history) > DETAIL_KEPT:
            old = self.history[-DETAIL_KEPT - 1]
            if old.speeds or old.on_cpu:
                bare = self.history[-DETAIL_KEPT - 1] = replace(old, speeds={}, on_cpu={})
                if self.records.get(old.iteration) is old:
                    self.records[old.iteration] = bare
        return record
