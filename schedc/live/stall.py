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

A CPU quota (a container's limit: CFS bandwidth control, cgroup v1's
``cpu.cfs_quota_us``, v2's ``cpu.max``) holds a process another way: its
threads stay queued, so their wait counts as run queue, and the clock above
would take it for load. The kernel counts it too, per cgroup: ``cpu.stat``'s
``throttled_time`` (v1, ns) or ``throttled_usec`` (v2). So the run-queue
wait of a wake-up, up to the time the process's cgroup was throttled
meanwhile, counts as held too (`CgroupThrottle`; the group is looked up
again every second: a process can be moved into a limited group while it
runs). A quota on a group that holds every worker (the whole job's
container) holds every rank alike, and slowness is judged against peers.
Measured (`python bench/live_false_alarms.py --loops --throttle-loops 0 2
--throttle-kind quota`: rank 4 limited to 0.1 CPU for 60 iterations): with
the run queue alone, found after 23 iterations (1.94 s) with no other load
(its stalled fraction read 0.02 median, as healthy ranks'), and with two
busy loops never found as slow: declared failed instead ("no heartbeat for
3.1 s") and taken back through rejoin. With the cgroup's count: medians
0.38 and 0.15 (peers 0.03), found after 19 iterations (1.77 s) and 16
(1.23 s), not declared failed.

A thread can also wake late without waiting on a run queue while its
process runs on: it woke, but another thread of its process held the
interpreter's lock (the GIL) through a long call, or was itself preempted
holding it. The process was not stopped then, it ran. So a wake-up counts
as held no more than the part of its interval in which the process used no
CPU at all (`process_time`, every thread's CPU time): a process stopped from
outside uses none, one whose main thread holds the GIL uses as much as the
interval. (Under two busy loops one healthy rank read 0.70 stalled over a
second, and was reported at speed 0.40, before this bound.)

`StallClock.tick` is the bookkeeping of one wake-up (fed numbers in tests);
`StallClock.start` runs it on a daemon thread. `stalled` is the total so far,
seconds, which the heartbeat carries (`schedc.live.detect.Beat.stalled_ms`).
Where the kernel gives no schedstat the clock stays at 0 (and says nothing).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: How long the clock's thread sleeps between wake-ups, seconds. A stop shorter than this can fall
#: between two wake-ups unseen, and of a longer one up to this much goes uncounted; shorter costs
#: more wake-ups (each reads one small /proc file). Re-measure with bench/live_false_alarms.py
#: (the throttled rank's stalled fraction against its peers', printed per throttle run).
STALL_PERIOD = 0.01


class _Schedstat:
    """One thread's schedstat file, open (closed with the thread's locals when it ends)."""

    def __init__(self, tid: int):
        self.tid = tid
        self.fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)

    def run_delay(self) -> float:
        return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9

    def __del__(self):
        try:
            os.close(self.fd)
        except Exception:  # (at interpreter shutdown os may be half gone)
            pass


_schedstat = threading.local()  # per thread: its `_Schedstat`


def thread_run_delay() -> float | None:
    """The calling thread's run-queue wait so far, seconds (None where the kernel does not say).

    Each thread keeps its schedstat file open and re-reads it in place: a CPU rank's op clock
    asks twice per op, and an open, read and close took 45 us on a loaded host against 7 us for
    a re-read (`python -m timeit` on both). The thread's id is checked on every call: a forked
    process's thread inherits its parent thread's locals, and with them a file of another thread."""
    tid = threading.get_native_id()
    try:
        held = getattr(_schedstat, "file", None)
        if held is None or held.tid != tid:
            held = _schedstat.file = _Schedstat(tid)
        return held.run_delay()
    except (OSError, ValueError, IndexError):
        return None


#: Seconds between two look-ups of the process's cpu cgroup (`CgroupThrottle`).
CGROUP_LOOKUP_EVERY = 1.0
_CGROUP_ROOTS = {  # where each cgroup version mounts the cpu controller's hierarchy
    "v1": ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpuacct,cpu"),
    "v2": ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"),
}


def cgroup_cpu_stat() -> str | None:
    """The `cpu.stat` file of this process's cpu cgroup (v1 or v2), None where there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2 (unified)
            roots = _CGROUP_ROOTS["v2"]
        elif "cpu" in controllers.split(","):
            roots = _CGROUP_ROOTS["v1"]
        else:
            continue
        for root in roots:
            stat = os.path.join(root, path.lstrip("/"), "cpu.stat")
            if os.path.exists(stat):
                return stat
    return None


class CgroupThrottle:
    """Seconds this process's cpu cgroup has been throttled by its CPU quota so far (None where
    the kernel does not say); the group is looked up again every `CGROUP_LOOKUP_EVERY` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._looked = -float("inf")
        self._path: str | None = None  # the group's cpu.stat
        self._base = 0.0  # its throttled seconds when this process was first seen in it
        self._total = 0.0  # throttled seconds counted in the groups this process has left

    def __call__(self) -> float | None:
        now = self._clock()
        if now - self._looked >= CGROUP_LOOKUP_EVERY:
            self._looked = now
            path = cgroup_cpu_stat()
            if path != self._path:  # (first seen, or moved): keep what the old group counted
                self._total = self._reading() or self._total
                base = None if path is None else _throttled_s(path)
                self._path, self._base = (path, base) if base is not None else (None, 0.0)
        return self._reading()

    def _reading(self) -> float | None:
        value = None if self._path is None else _throttled_s(self._path)
        return None if value is None else self._total + value - self._base


def _throttled_s(stat: str) -> float | None:
    try:
        with open(stat) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "throttled_time":
                    return int(value) / 1e9
                if key == "throttled_usec":
                    return int(value) / 1e6
    except (OSError, ValueError):
        return None
    return None


@dataclass
class StallClock:
    """Time this process was held stopped, from one thread's wake-ups (module docstring)."""

    period: float = STALL_PERIOD
    clock: Callable[[], float] = time.monotonic
    run_delay: Callable[[], float | None] = thread_run_delay
    throttled: Callable[[], float | None] = lambda: None  # the cgroup's quota throttling so far (`CgroupThrottle`)
    process_time: Callable[[], float | None] = lambda: None  # the process's CPU time so far, every thread's
    # (`time.process_time`; None: not known, nothing bounds a wake-up's held time)
    stalled: float = 0.0  # seconds held stopped so far
    _last: tuple[float, float, float | None, float | None] | None = field(default=None, repr=False)  # (clock,
    # run delay, throttled, process time) at the last wake-up

    def tick(self) -> None:
        """One wake-up (after sleeping `period` since the last): its lateness that the run
        queue does not explain is added to `stalled`, and so is its run-queue wait up to the
        time its cgroup's CPU quota held the process meanwhile; all of it at most the part of
        the interval in which the process used no CPU (module docstring)."""
        now, delay, throttled, cpu = self.clock(), self.run_delay(), self.throttled(), self.process_time()
        if delay is None:
            self._last = None
            return
        if self._last is not None:
            t0, d0, h0, c0 = self._last
            late = max(0.0, (now - t0) - self.period)
            queued = max(0.0, delay - d0)
            held = 0.0 if throttled is None or h0 is None else max(0.0, throttled - h0)
            idle = late if cpu is None or c0 is None else max(0.0, (now - t0) - (cpu - c0))
            self.stalled += min(late, max(0.0, late - queued) + min(queued, held), idle)
        self._last = (now, delay, throttled, cpu)

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
