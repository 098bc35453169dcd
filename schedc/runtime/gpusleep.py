"""An injected slowdown on a GPU: a sleep kernel queued on the rank's stream.

A GPU op's kernels run after their launch returns, so busying the host thread
(what an injected slowdown does to a CPU rank, `Runtime.slow_down`) would not
slow them as the GPU's own timing events see them (`schedc.live.opclock`).
`sleep(device, us)` queues ``torch.cuda._sleep(cycles)``, a kernel that spins
for a number of GPU clock cycles, on the device's current stream; the cycles
per microsecond are measured once per process and device, with timing events
around sleeps of `CALIBRATION_CYCLES`.
"""

from __future__ import annotations

#: Cycles of each calibration sleep: milliseconds at GPU clocks of 1-2 GHz, long against the
#: events' resolution (about half a microsecond) and a launch. Check the rate it gives with
#: `python bench/cuda_event_overhead.py --device cuda` (its `sleep` figures).
CALIBRATION_CYCLES = 5_000_000
_rates: dict[str, float] = {}  # device -> measured cycles per microsecond


def cycles_per_us(device: str) -> float:
    """The sleep kernel's cycles per microsecond on `device` (measured on the first call)."""
    device = str(device)
    if device not in _rates:
        import torch

        with torch.cuda.device(device):
            torch.cuda._sleep(1000)  # the first launch loads the kernel: not timed
            rates = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(CALIBRATION_CYCLES)
                end.record()
                end.synchronize()
                rates.append(CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e3))
        _rates[device] = sorted(rates)[1]
    return _rates[device]


def sleep(device: str, us: float) -> None:
    """Queue a kernel on `device`'s current stream that keeps it busy for about `us` microseconds
    (the host does not wait for it)."""
    if us <= 0:
        return
    import torch

    cycles = int(us * cycles_per_us(device))
    with torch.cuda.device(str(device)):
        torch.cuda._sleep(cycles)
