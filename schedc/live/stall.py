"""A worker's stall clock: how much of the wall time its process was held stopped.

A process that something outside stops now and then (SIGSTOP/SIGCONT, a
cgroup freezer: a "throttle") and one that other processes' load starves
both run less than their peers, and both beat less often; their heartbeat
rates overlap (a throttled rank at 0.58-0.78 of its peers', a healthy one
under two busy loops at 0.65 for seconds). What tells them apart is where
the lost time goes. A thread whose timer expires while its process is
starved waits on the CPU's run queue, which the kernel counts
(``/proc/self/task/TID/schedstat``, second field: run-queue wait); a
thread of a stopped process is neither running nor waiting on a run queue
until it is continued. So a thread that sleeps `STALL_PERIOD` over and over
and takes, from each wake-up's lateness, the run-queue wait it accrued
meanwhile, is left with the time its process was held stopped (and little
else: timer slack, a GIL hand-over).

Measured in `schedc train` (bench/live_false_alarms.py: 3 x 3 ranks on two
cores, one rank stopped at 50% duty in 50 ms halves) over the last second:
the throttled rank read 0.29-0.49 stalled (10th percentile to max, six
runs) with no other load and 0.08-0.56 under two busy loops (medians
0.33-0.44), its peers at most 0.08; in
fault-free runs under two and four busy loops the ranks read 0.01-0.04
(10th-90th percentile), single readings up to 0.18. A loaded host blurs a
stop (a thread must get the CPU to stop, and that wait counts as run
queue), so the fraction reads below the duty cycle.

`StallClock.tick` is the bookkeeping of one wake-up (fed numbers in tests);
`StallClock.start` runs it on a daemon thread. `stalled` is the total so far,
seconds, which the heartbeat carries (`schedc.live.detect.Beat.stalled_ms`).
Where the kernel gives no schedstat the clock stays at 0 (and says nothing).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: How long the clock's thread sleeps between wake-ups, seconds. A stop shorter than this can fall
#: between two wake-ups unseen, and of a longer one up to this much goes uncounted; shorter costs
#: more wake-ups (each reads one small /proc file). Re-measure with bench/live_false_alarms.py
#: (the throttled rank's stalled fraction against its peers', printed per throttle run).
STALL_PERIOD = 0.01


def thread_run_delay() -> float | None:
    """The calling thread's run-queue wait so far, seconds (None where the kernel does not say)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class StallClock:
    """Time this process was held stopped, from one thread's wake-ups (module docstring)."""

    period: float = STALL_PERIOD
    clock: Callable[[], float] = time.monotonic
    run_delay: Callable[[], float | None] = thread_run_delay
    stalled: float = 0.0  # seconds held stopped so far
    _last: tuple[float, float] | None = field(default=None, repr=False)  # (clock, run delay) at the last wake-up

    def tick(self) -> None:
        """One wake-up (after sleeping `period` since the last): its lateness that the run
        queue does not explain is added to `stalled`."""
        now, delay = self.clock(), self.run_delay()
        if delay is None:
            self._last = None
            return
        if self._last is not None:
            t0, d0 = self._last
            late = (now - t0) - self.period
            self.stalled += max(0.0, late - max(0.0, delay - d0))
        self._last = (now, delay)

    def start(self, halt: threading.Event) -> "StallClock":
        """Tick every `period` on a daemon thread until `halt` is set (nothing where the kernel
        gives no schedstat)."""
        if thread_run_delay() is None:
            return self

        def loop() -> None:
            while not halt.wait(self.period):
                self.tick()

        def first() -> None:
            self.tick()
            loop()

        threading.Thread(target=first, name="schedc-stall-clock", daemon=True).start()
        return self
