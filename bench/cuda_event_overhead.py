"""What timing each op costs a live rank (`schedc.live.opclock`), on a loop of small ops.

    python bench/cuda_event_overhead.py --device cpu
    python bench/cuda_event_overhead.py --device cuda --json out/opclock.json

One iteration is `--ops` matmuls of `--size` x `--size` (the kind of short op
where a per-op cost shows most), run without a clock and with the device's
clock (`make_clock`: perf_counter on CPU, a pair of CUDA events per op on a
GPU), alternately, `--iterations` times each after one warm-up of each. The
wall time of an iteration is taken between two device synchronisations.
Printed: the median wall time per iteration of each, the clock's cost per op
(the difference over the op count: on a loaded host its noise can exceed the
cost), the clock's calls alone per op (`op_started` and `op_ended` with no op
between; and the `take_iteration` of such an iteration over its op count), and the clock's own total of the ops'
times against the synchronised wall time of the iteration (near 1: the
events see the whole iteration's work; the rest is the loop's own time
between ops). On CUDA also the sleep kernel of injected slowdowns
(`schedc.runtime.gpusleep`): its calibrated rate and a planned 1 ms sleep
as the events time it. Takes seconds on a GPU, about ten on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from schedc.live.opclock import EventClock, make_clock  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _iteration(a: torch.Tensor, ops: int, device: str, clock=None) -> tuple[float, float]:
    """(synchronised wall seconds, the clock's compute seconds or 0) of one iteration."""
    _sync(device)
    started = time.perf_counter()
    for _ in range(ops):
        if clock is not None:
            clock.op_started()
        a @ a
        if clock is not None:
            clock.op_ended(1)
    measured = clock.take_iteration()[0] if clock is not None else 0.0
    _sync(device)
    return time.perf_counter() - started, measured


def _calls_only(clock, ops: int, device: str) -> tuple[float, float]:
    """Seconds per op of the clock's own calls, on `ops` empty ops: (op_started and op_ended,
    the iteration's take_iteration)."""
    _sync(device)
    started = time.perf_counter()
    for _ in range(ops):
        clock.op_started()
        clock.op_ended(1)
    ended = time.perf_counter()
    clock.take_iteration()
    return (ended - started) / ops, (time.perf_counter() - ended) / ops


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no GPU")
    if device == "cpu":
        torch.set_num_threads(1)  # as a live CPU rank runs
    a = torch.randn(args.size, args.size, device=device) / args.size ** 0.5
    clock = make_clock(device)
    _iteration(a, args.ops, device)  # warm-ups (cuBLAS set up, the event pool filled)
    _iteration(a, args.ops, device, clock)
    bare, timed, ratio, calls = [], [], [], []
    for _ in range(args.iterations):
        bare.append(_iteration(a, args.ops, device)[0])
        wall, measured = _iteration(a, args.ops, device, clock)
        timed.append(wall)
        ratio.append(measured / wall)
        calls.append(_calls_only(clock, args.ops, device))
    result = {
        "device": str(torch.cuda.get_device_name(device)) if device.startswith("cuda") else "cpu",
        "clock": type(clock).__name__, "ops": args.ops, "size": args.size, "iterations": args.iterations,
        "no_clock_s": statistics.median(bare), "clock_s": statistics.median(timed),
        "overhead_us_per_op": (statistics.median(timed) - statistics.median(bare)) / args.ops * 1e6,
        "clock_op_calls_us_per_op": statistics.median(c[0] for c in calls) * 1e6,
        "clock_take_us_per_op": statistics.median(c[1] for c in calls) * 1e6,
        "clock_total_over_wall": statistics.median(ratio),
        "clock_total_over_wall_range": [min(ratio), max(ratio)],
    }
    if isinstance(clock, EventClock):
        result["event_pairs"] = clock.pool_size
        from schedc.runtime import gpusleep

        result["sleep_cycles_per_us"] = gpusleep.cycles_per_us(device)
        slept = []
        for _ in range(5):
            clock.op_started()
            gpusleep.sleep(device, 1000)
            clock.op_ended(1000)
            slept.append(clock.take_iteration()[0] * 1e3)
        result["sleep_1ms_measured_ms"] = statistics.median(slept)
    for key, value in result.items():
        print(f"{key:30} {value:.4g}" if isinstance(value, float) else f"{key:30} {value}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
