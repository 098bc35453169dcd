"""The op clocks of fail-slow detection (`schedc.live.opclock`): the CPU clock's sums, the GPU
clock's logic on fake timing events (no wait per op, a pool of events reused, totals from the
events' own times), the live worker's use of them, the GPU's injected slowdown (a sleep kernel,
`schedc.runtime.gpusleep`); and, where a GPU is there, the same on real CUDA events."""

from __future__ import annotations

import time
import types

import pytest
import torch

from schedc.live.member import LiveWorker
from schedc.live.opclock import EventClock, HostClock, make_clock
from schedc.runtime import gpusleep
from schedc.runtime.primitives import Runtime

# -- the CPU clock ---------------------------------------------------------------------


class _Now:
    """A settable clock for `HostClock(now=...)`."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_host_clock_sums_each_op_from_start_to_end_and_resets_when_taken():
    now = _Now()
    clock = HostClock(now=now)
    for start, end, us in [(1.0, 1.5, 400), (2.0, 2.25, 300)]:
        now.t = start
        clock.op_started()
        now.t = end
        clock.op_ended(us)
    now.t = 3.0
    clock.op_started()  # an op that is not ended (O: its all-reduce waits for peers) is not counted
    now.t = 9.0
    compute, planned = clock.take_iteration()
    assert compute == pytest.approx(0.75)
    assert planned == pytest.approx(700e-6)
    assert clock.take_iteration() == (0.0, 0.0)


def test_the_host_clock_counts_the_threads_run_queue_wait_inside_its_ops():
    now, delay = _Now(), {"s": 0.0}
    clock = HostClock(now=now, run_delay=lambda: delay["s"])
    for start, end, waited_before, waited_after in [(1.0, 1.5, 0.0, 0.2), (2.0, 2.5, 0.7, 0.75)]:
        now.t, delay["s"] = start, waited_before  # (0.5 s waited between the two ops is not an op's)
        clock.op_started()
        now.t, delay["s"] = end, waited_after
        clock.op_ended(100)
    assert clock.take_iteration()[0] == pytest.approx(1.0)
    assert clock.queued == pytest.approx(0.25)
    clock.take_iteration()
    assert clock.queued == 0.0


def test_the_host_clock_counts_no_wait_where_the_kernel_does_not_say():
    now = _Now()
    clock = HostClock(now=now, run_delay=lambda: None)
    clock.op_started()
    now.t = 2.0
    clock.op_ended(100)
    assert clock.take_iteration()[0] == pytest.approx(2.0) and clock.queued == 0.0


def test_the_host_clock_forgets_an_interrupted_iteration_on_reset():
    now = _Now()
    clock = HostClock(now=now)
    clock.op_started()
    now.t = 4.0
    clock.op_ended(1000)
    clock.reset()
    clock.op_started()
    now.t = 4.5
    clock.op_ended(200)
    assert clock.take_iteration() == (pytest.approx(0.5), pytest.approx(200e-6))


def test_the_host_clock_times_a_call():
    now = _Now()
    clock = HostClock(now=now)

    def work():
        now.t += 0.125

    assert clock.timed(work) == pytest.approx(0.125)


# -- the GPU clock on fake events ------------------------------------------------------


class _FakeGpu:
    """A stream whose kernels run in order: `run(ms)` queues one; an event recorded on the stream
    gets the time the stream reaches it, and is complete only once some `synchronize` waited for
    it or for a later event (as a CUDA event is: the GPU has not run it before)."""

    def __init__(self):
        self.queued_ms = 0.0  # the stream's time once everything queued so far has run
        self.records = 0  # events recorded so far, in stream order
        self.done_upto = 0  # events 1..done_upto are complete
        self.created = 0
        self.event_syncs = 0
        self.device_syncs = 0
        self.stream = object()
        self.stream_asks = 0
        self.log: list[str] = []
        self.run_queue_s = 0.0  # the launching thread's run-queue wait so far (`thread_run_delay`)

    def current_stream(self) -> object:
        self.stream_asks += 1
        return self.stream

    def run(self, ms: float) -> None:
        self.queued_ms += ms

    def event(self) -> "_FakeEvent":
        self.created += 1
        return _FakeEvent(self)

    def synchronize(self) -> None:
        self.device_syncs += 1
        self.done_upto = self.records
        self.log.append("sync")


class _FakeEvent:
    def __init__(self, gpu: _FakeGpu):
        self.gpu = gpu
        self.seq = 0
        self.at_ms = None

    def record(self, stream=None) -> None:
        assert stream is self.gpu.stream, "recorded on another stream than the clock's"
        self.gpu.records += 1
        self.seq = self.gpu.records
        self.at_ms = self.gpu.queued_ms

    def synchronize(self) -> None:
        self.gpu.event_syncs += 1
        self.gpu.done_upto = max(self.gpu.done_upto, self.seq)

    def elapsed_time(self, end: "_FakeEvent") -> float:
        for e in (self, end):
            if e.seq == 0 or e.seq > self.gpu.done_upto:
                raise RuntimeError("CUDA error: device not ready")  # what torch says for an incomplete event
        return end.at_ms - self.at_ms


def _event_clock(gpu: _FakeGpu) -> EventClock:
    import contextlib

    @contextlib.contextmanager
    def use_stream(stream):
        assert stream is gpu.stream
        gpu.log.append("on the probe's stream")
        yield
        gpu.log.append("off it")

    return EventClock("cuda:0", event=gpu.event, stream=gpu.current_stream, new_stream=lambda: gpu.stream,
                      use_stream=use_stream, run_delay=lambda: gpu.run_queue_s)


def _iteration(clock: EventClock, gpu: _FakeGpu, ops: list[tuple[float, float]], idle_ms: float = 0.0) -> None:
    """Time ops of (GPU milliseconds, planned us), with `idle_ms` of other kernels (another rank's
    wait, a transfer) queued between them, outside any op."""
    for ms, us in ops:
        gpu.run(idle_ms)
        clock.op_started()
        gpu.run(ms)
        clock.op_ended(us)


def test_the_event_clock_sums_the_events_times_and_waits_once_per_iteration():
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    _iteration(clock, gpu, [(1.5, 1000), (2.0, 1500), (0.5, 400)], idle_ms=7.0)
    assert gpu.event_syncs == 0 and gpu.device_syncs == 0  # nothing waits for the GPU per op
    compute, planned = clock.take_iteration()
    assert gpu.event_syncs == 1 and gpu.device_syncs == 0
    assert compute == pytest.approx(4.0e-3)  # the idle time between ops is not counted
    assert planned == pytest.approx(2900e-6)


def test_the_event_clock_counts_the_launching_threads_run_queue_wait_as_queued():
    # The thread that launches an op's kernels waits 1 ms for a CPU inside the op (another
    # process had the core): the GPU idles inside the op's events, which time 1 ms more. That
    # millisecond is host load (`queued`), as on a CPU rank, not the GPU's speed. A wait between
    # ops (outside any op's events) is not counted.
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    for ms, waited in ((1.5, 1.0), (2.0, 0.0)):
        gpu.run_queue_s += 0.5e-3  # (between ops)
        clock.op_started()
        gpu.run(ms + waited)  # (the GPU idle while the thread waited)
        gpu.run_queue_s += waited / 1e3
        clock.op_ended(1000)
    compute, _ = clock.take_iteration()
    assert compute == pytest.approx(4.5e-3) and clock.queued == pytest.approx(1.0e-3)
    _iteration(clock, gpu, [(1.0, 100)])
    clock.take_iteration()
    assert clock.queued == 0.0


def test_the_event_clock_resets_when_taken_and_waits_for_nothing_without_ops():
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    _iteration(clock, gpu, [(3.0, 100)])
    clock.take_iteration()
    assert clock.take_iteration() == (0.0, 0.0)
    assert gpu.event_syncs == 1
    _iteration(clock, gpu, [(0.25, 50)], idle_ms=5.0)
    compute, planned = clock.take_iteration()
    assert compute == pytest.approx(0.25e-3) and planned == pytest.approx(50e-6)


def test_the_event_clock_reuses_its_events_once_an_iteration_has_run():
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    _iteration(clock, gpu, [(1.0, 100)] * 5)
    clock.take_iteration()
    assert gpu.created == 10 and clock.pool_size == 5
    for _ in range(3):  # equal op counts: no new event
        _iteration(clock, gpu, [(1.0, 100)] * 5)
        assert clock.take_iteration()[0] == pytest.approx(5e-3)
    _iteration(clock, gpu, [(1.0, 100)] * 3)  # fewer: still none
    assert clock.take_iteration()[0] == pytest.approx(3e-3)
    assert gpu.created == 10
    _iteration(clock, gpu, [(1.0, 100)] * 7)  # more: only the missing pairs
    assert clock.take_iteration()[0] == pytest.approx(7e-3)
    assert gpu.created == 14 and gpu.event_syncs == 6


def test_the_event_clock_forgets_an_interrupted_iteration_on_reset():
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    _iteration(clock, gpu, [(4.0, 900), (4.0, 900)])
    clock.op_started()  # interrupted inside an op
    gpu.run(2.0)
    clock.reset()
    assert gpu.event_syncs == 0  # forgetting waits for nothing
    _iteration(clock, gpu, [(1.0, 300)])
    compute, planned = clock.take_iteration()
    assert compute == pytest.approx(1e-3) and planned == pytest.approx(300e-6)


def test_the_event_clock_records_on_the_stream_current_at_each_iterations_first_op():
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    _iteration(clock, gpu, [(1.0, 100)] * 4)
    clock.take_iteration()
    assert gpu.stream_asks == 1
    gpu.stream = object()  # another stream is current from now on: the fake's events assert it is used
    _iteration(clock, gpu, [(2.0, 100)] * 4)
    assert clock.take_iteration()[0] == pytest.approx(8e-3)
    assert gpu.stream_asks == 2


def test_the_event_clock_times_a_call_by_events_on_a_stream_of_its_own():
    """The probe's kernels, not their launch, and not what else the device runs: no wait for the
    whole device, one for the probe's end event."""
    gpu = _FakeGpu()
    clock = _event_clock(gpu)
    gpu.run(40.0)  # other work queued before: not the probe's

    def probe():
        gpu.log.append("probe")
        gpu.run(7.5)

    assert clock.timed(probe) == pytest.approx(0.0075)
    assert gpu.log == ["on the probe's stream", "probe", "off it"]
    assert (gpu.device_syncs, gpu.event_syncs) == (0, 1)


def test_a_rank_gets_the_clock_of_its_device():
    assert isinstance(make_clock("cpu"), HostClock)
    assert isinstance(make_clock(torch.device("cpu")), HostClock)
    assert isinstance(make_clock("cuda"), EventClock)
    assert isinstance(make_clock("cuda:1"), EventClock)


def test_the_live_worker_times_its_computed_ops_and_not_the_optimizer_step():
    """`LiveWorker.op_ready` / `op_done` on just the state they use, with a GPU clock on fake events:
    F and B are timed from ready to done; O (its all-reduce waits for peers) is not."""
    gpu = _FakeGpu()
    state = types.SimpleNamespace(trigger=None, _clock=_event_clock(gpu), ops=0, iteration=0)
    ready, done = (types.MethodType(getattr(LiveWorker, name), state) for name in ("op_ready", "op_done"))
    for kind, ms, us in [("F", 2.0, 1000), ("B", 3.0, 2000), ("O", 50.0, 500)]:
        ready(kind, 0, None if kind == "O" else 0)
        gpu.run(ms)
        done(kind, 0, None if kind == "O" else 0, us)
    assert state.ops == 3
    compute, planned = state._clock.take_iteration()
    assert compute == pytest.approx(5e-3) and planned == pytest.approx(3000e-6)


# -- an injected slowdown on a GPU -----------------------------------------------------


def test_an_injected_slowdown_on_a_gpu_queues_a_sleep_of_the_planned_time(monkeypatch):
    sleeps = []
    monkeypatch.setattr(gpusleep, "sleep", lambda device, us: sleeps.append((device, us)))
    gpu_rank = types.SimpleNamespace(slowdown=2.5, device="cuda:1")
    Runtime.slow_down(gpu_rank, 0.0, 400)
    assert sleeps == [("cuda:1", pytest.approx(600.0))]
    Runtime.slow_down(types.SimpleNamespace(slowdown=1.0, device="cuda:1"), 0.0, 400)  # not slowed
    cpu_rank = types.SimpleNamespace(slowdown=1.5, device="cpu")
    Runtime.slow_down(cpu_rank, time.perf_counter(), 400)  # the host thread is busied, no sleep kernel
    assert len(sleeps) == 1


# -- on a GPU ------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_the_event_clock_times_kernels_on_a_gpu():
    a = torch.randn(1024, 1024, device="cuda")
    clock = make_clock("cuda")
    assert isinstance(clock, EventClock)
    # Untimed first: cuBLAS's set-up, the sleep kernel's loading, the clock's first events. Events
    # time the GPU from one record to the next, idle gaps included, and a first call's host-side
    # set-up is such a gap (10 ms and more around a first matmul, where the timed ones take 1 ms).
    for _ in range(2):
        clock.op_started()
        a @ a
        torch.cuda._sleep(1000)
        clock.op_ended(100)
        clock.take_iteration()
    totals = []
    for cycles in (0, 2_000_000, 20_000_000):
        clock.op_started()
        b = a @ a
        if cycles:
            torch.cuda._sleep(cycles)
        clock.op_ended(100)
        totals.append(clock.take_iteration())
    assert torch.isfinite(b).all()
    assert all(planned == pytest.approx(100e-6) for _, planned in totals)
    matmul, short, long = (compute for compute, _ in totals)
    assert 0 < matmul < short < long  # the times grow with the sleep the ops queued


@needs_gpu
def test_the_event_clock_waits_for_a_probe_on_a_gpu():
    clock = make_clock("cuda")
    end = torch.cuda.Event()

    def probe():
        torch.cuda._sleep(20_000_000)
        end.record()

    assert clock.timed(probe) > 0
    assert end.query()  # the probe's kernel has run when `timed` returns: it timed the kernel, not its launch


@needs_gpu
def test_an_injected_slowdown_on_a_gpu_shows_in_its_events():
    assert gpusleep.cycles_per_us("cuda") > 0
    clock = make_clock("cuda")
    a = torch.randn(256, 256, device="cuda")
    a @ a  # (cuBLAS set up, not timed)
    times = []
    for slowdown in (1.0, 2.0, 6.0):
        rank = types.SimpleNamespace(slowdown=slowdown, device="cuda")
        clock.op_started()
        a @ a
        Runtime.slow_down(rank, 0.0, 2000)  # planned 2 ms: sleeps of 0, 2 and 10 ms
        clock.op_ended(2000)
        times.append(clock.take_iteration()[0])
    assert times[0] < times[1] < times[2]
