"""How long a rank's computed ops take: what fail-slow detection (`schedc.live.slowness`) judges.

A live worker (`schedc.live.member`) calls `op_started` once an op's input is
there (waiting for a peer is not this GPU's speed), `op_ended` once its sends
are posted, with the op's planned duration, and `take_iteration` at the end
of an iteration: the measured and the planned seconds of its timed ops,
summed, both reset for the next.

- `HostClock` (a CPU rank): ``time.perf_counter`` around each op. The host
  thread does the work, so the host's clock is the op's time. It also counts
  how much of that time the thread waited on a run queue for a CPU
  (``/proc/self/task/TID/schedstat``, `schedc.live.stall.thread_run_delay`),
  as `queued`: on a host that other processes load, a rank the scheduler
  runs less than its peers computes slower by exactly that wait, which is the
  host's load, not the GPU's speed (`schedc.live.slowness` tells them apart).
- `EventClock` (a GPU rank): a kernel runs after its launch returns, so the
  host's clock would time launches only. Each op gets a pair of timing events
  recorded on the rank's current stream; nothing waits for the GPU per op.
  `take_iteration` waits for the last recorded event (every earlier one on
  the stream is then complete) and sums each pair's GPU time. The pairs come
  from a pool that grows only when an iteration times more ops than any
  before: no allocation per op once the first iteration has run. The host
  thread's run-queue wait between an op's two events counts as `queued`, as
  on a CPU rank: an op's kernels are launched by that thread, and while it
  waits for a CPU the GPU idles inside the op's events (host load, not a
  slow GPU; gloo's sends go through host memory, so the stream is empty at
  each op's start).

`timed` (the probe of an excluded or compute-less GPU, and its healthy time
at start-up) times one call: on a CPU by the host's clock; on a GPU by a
pair of events around it on a stream of the probe's own, waited for at the
end, so it times the probe's kernels, not their launch, and not the other
work queued on the device meanwhile (a compute-less member's optimizer
step, the rollback copy) that a wait for the whole device would count.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol


class OpClock(Protocol):
    """Times a rank's computed ops, per iteration (see the module docstring)."""

    def op_started(self) -> None: ...

    def op_ended(self, planned_us: float) -> None:
        """The op started last has ended; `planned_us`: its duration in the plan, microseconds."""

    def reset(self) -> None:
        """Forget the ops timed so far (an interrupted iteration's)."""

    def take_iteration(self) -> tuple[float, float]:
        """(measured, planned) seconds of the ops ended since the last take or reset; resets both.
        `queued` is then the part of `measured` spent waiting for a CPU (0 where not known)."""

    queued: float

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds that `fn()` takes, its device work included."""


def make_clock(device) -> OpClock:
    """The clock for a rank computing on `device` (``cpu``, ``cuda``, ``cuda:N``, or a torch.device)."""
    if str(device).startswith("cuda"):
        return EventClock(str(device))
    return HostClock()


class HostClock:
    """A CPU rank's clock: the host's time from `op_started` to `op_ended`, and the calling
    thread's run-queue wait meanwhile (`run_delay`: its total so far, None where not known)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter,
                 run_delay: Callable[[], float | None] | None = None):
        if run_delay is None:
            from schedc.live.stall import thread_run_delay as run_delay
        self._now = now
        self._run_delay = run_delay
        self._started = 0.0
        self._delay: float | None = None  # the thread's run-queue wait at `op_started`
        self._compute = self._planned = self._queued = 0.0
        self.queued = 0.0  # of the iteration taken last

    def op_started(self) -> None:
        self._delay = self._run_delay()
        self._started = self._now()

    def op_ended(self, planned_us: float) -> None:
        self._compute += self._now() - self._started
        self._planned += planned_us / 1e6
        delay = self._run_delay() if self._delay is not None else None
        if delay is not None:
            self._queued += max(0.0, delay - self._delay)

    def reset(self) -> None:
        self._compute = self._planned = self._queued = 0.0

    def take_iteration(self) -> tuple[float, float]:
        totals = (self._compute, self._planned)
        self.queued = min(self._queued, self._compute)
        self.reset()
        return totals

    def timed(self, fn: Callable[[], object]) -> float:
        started = self._now()
        fn()
        return self._now() - started


class EventClock:
    """A GPU rank's clock: a pair of timing events per op on the current stream, resolved once
    per iteration.

    `event` makes one timing event (``torch.cuda.Event(enable_timing=True)``: it has
    ``record(stream)``, ``synchronize()`` and ``elapsed_time(end)`` in milliseconds), `stream`
    gives the stream to record on (the rank's device's current stream), `new_stream` makes the
    probe's own stream and `use_stream(s)` is a context in which kernels go to stream `s`
    (`timed`). All default to torch's for `device`; tests give their own, so that this logic
    runs without a GPU.
    """

    def __init__(self, device: str = "cuda", *, event: Callable[[], object] | None = None,
                 stream: Callable[[], object] | None = None, new_stream: Callable[[], object] | None = None,
                 use_stream: Callable[[object], object] | None = None,
                 run_delay: Callable[[], float | None] | None = None):
        if run_delay is None:
            from schedc.live.stall import thread_run_delay as run_delay
        self._run_delay = run_delay
        self._delay: float | None = None  # the thread's run-queue wait at `op_started`
        self._queued = 0.0
        if event is None or stream is None or new_stream is None or use_stream is None:
            import torch

            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            stream = stream or (lambda: torch.cuda.current_stream(device))
            new_stream = new_stream or (lambda: torch.cuda.Stream(device))
            use_stream = use_stream or torch.cuda.stream
        self._event, self._stream = event, stream
        self._new_stream, self._use_stream = new_stream, use_stream
        self._probe_stream = None
        self.queued = 0.0  # of the iteration taken last: the launching thread's run-queue wait inside ops
        self._pairs: list[tuple[object, object]] = []  # the pool: (start, end) per op, reused every iteration
        self._ops = 0  # pairs of this iteration whose end is recorded
        self._planned = 0.0
        # The stream of this iteration's ops, asked for at its first op (asking per op costs
        # microseconds per op: `python bench/cuda_event_overhead.py --device cuda`).
        self._on = None

    def op_started(self) -> None:
        if self._ops == len(self._pairs):
            self._pairs.append((self._event(), self._event()))
        if self._on is None:
            self._on = self._stream()
        self._delay = self._run_delay()
        self._pairs[self._ops][0].record(self._on)

    def op_ended(self, planned_us: float) -> None:
        self._pairs[self._ops][1].record(self._on)
        self._ops += 1
        self._planned += planned_us / 1e6
        delay = self._run_delay() if self._delay is not None else None
        if delay is not None:
            self._queued += max(0.0, delay - self._delay)

    def reset(self) -> None:
        # An event recorded again before the GPU reached it is simply re-recorded: no wait needed.
        self._ops = 0
        self._planned = self._queued = 0.0
        self._on = None

    def take_iteration(self) -> tuple[float, float]:
        ops, planned, queued = self._ops, self._planned, self._queued
        self.reset()
        self.queued = 0.0
        if ops == 0:
            return 0.0, planned
        self._pairs[ops - 1][1].synchronize()  # the last end: every earlier event on the stream is done too
        seconds = sum(start.elapsed_time(end) for start, end in self._pairs[:ops]) / 1e3
        self.queued = min(queued, seconds)
        return seconds, planned

    @property
    def pool_size(self) -> int:
        """Event pairs allocated so far (the most ops any iteration timed)."""
        return len(self._pairs)

    def timed(self, fn: Callable[[], object]) -> float:
        if self._probe_stream is None:
            self._probe_stream = self._new_stream()
        on = self._probe_stream
        start, end = self._event(), self._event()
        with self._use_stream(on):  # (also makes the stream's device the thread's current one)
            start.record(on)
            fn()
            end.record(on)
        end.synchronize()
        return start.elapsed_time(end) / 1e3
