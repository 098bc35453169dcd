"""Live recovery benchmark: a 16-GPU job (4 pipelines x 4 stages) in --emulate mode through
failures, under schedc's re-routing and the two alternatives in the same harness.

For every scenario (one GPU killed, two GPUs killed in one iteration, a node
killed, a GPU hung) and method (`reroute`: schedc; `drop-pipeline`: the
failed GPU's pipeline leaves, as FT-HSDP/torchft; `restart`: every process
restarts from the latest checkpoint with the GPU replaced, as torchelastic),
it runs `schedc train --emulate` (ops sleep for their planned cost; messages
and process groups are real) and reports:

* recovery milestones, from the kill: detected, new plan, reconfigured
  (every survivor has new process groups and rolled back), first iteration
  completed under the new plan (with two faults, under the last plan);
* the steady period before and after, measured and as the simulator
  predicts for each plan;
* work lost: iterations run twice, and the stall (the wall time from the
  last iteration completed before the fault to the first after it, minus one
  period of the new plan);
* a plot per scenario of useful throughput (iterations that advance
  training, per second, over a sliding window) against time since the
  fault, one line per method.

    python bench/live_recovery.py [-o DIR] [--iterations N] [--quick] [--scenario NAME ...]
    python bench/live_recovery.py --replot DIR/live_recovery.json [-o DIR]   # the plots again, no run

docs/figures/live-one-gpu.svg and live-node.svg are this script's
throughput-one-GPU.svg and throughput-a-node.svg (`--scenario "one GPU"
--scenario "a node"`, a few minutes).

Assumptions, stated: checkpoints in --emulate mode hold no tensors, so
`restart` pays process start-up and a lost partial interval of K
iterations, but no checkpoint I/O and no replacement-node provisioning; in
a real job those add seconds to minutes. Nothing is assumed for `reroute`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedc  # noqa: E402
from schedc.bench.chart import Chart  # noqa: E402
from schedc.live import train  # noqa: E402

SPEC = (Path(__file__).resolve().parents[1] / "specs" / "emulate-4x4.sched").read_text()

FAULT_AT = 7  # the iteration the faults hit
SCENARIOS = {
    "one GPU": [f"at iteration {FAULT_AT} during B: fail gpu(dp=1, pp=2)"],
    "two GPUs": [f"at iteration {FAULT_AT} during B: fail gpu(dp=1, pp=2)",
                 f"at iteration {FAULT_AT} during B: fail gpu(dp=3, pp=1)"],
    "a node": [f"at iteration {FAULT_AT} during B: fail node 1"],
    "a hung GPU": [f"at iteration {FAULT_AT} during B: hang gpu(dp=3, pp=1)"],
}
METHODS = ["reroute", "drop-pipeline", "restart"]
CHECKPOINT_EVERY = 5
DETECT_TIMEOUT = 1.0  # for the hang: seconds of silence before a rank counts as hung


def periods(result, generation: int, skip_first: bool) -> list[float]:
    """Gaps between successive iteration ends completed by `generation`."""
    ends = [r.end for r in result.iterations if r.generation == generation]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return gaps[1:] if skip_first and len(gaps) > 2 else gaps


def measure(out: Path, method: str, inject: list[str], iterations: int, **options) -> dict:
    """One emulated run of `out` through `inject` under `method` (and `options` of `schedc.live.train`)."""
    ckpt = out.parent / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # every run writes its own
    result = train(out, iterations=iterations, emulate=True, inject=inject, recovery=method,
                   checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=str(ckpt), detect_timeout=DETECT_TIMEOUT,
                   **options)
    gens = result.generations
    before = periods(result, gens[0].number, skip_first=True)
    after = periods(result, gens[-1].number, skip_first=True)
    row = {"method": method, "ok": result.ok, "iterations": len(result.iterations),
           "all_iterations": [r.iteration for r in result.iterations] == list(range(iterations)),
           "before_s": statistics.median(before), "after_s": statistics.median(after),
           "predicted_before_s": gens[0].predicted_iteration_time_us / 1e6,
           "predicted_after_s": gens[-1].predicted_iteration_time_us / 1e6,
           "redone": sum(r.runs - 1 for r in result.iterations), "wall_s": result.wall_s,
           "gpus_after": len(gens[-1].members),
           "series": [(r.end, r.iteration) for r in result.history]}
    recs = result.recoveries
    row["recoveries"] = len(recs)
    if recs:
        # Two faults may land in one generation (one recovery) or the second in the next (two):
        # milestones count from the first fault; the plan, reconfiguration and first iteration
        # are those of the last recovery, under the plan the run ends with.
        first, last = recs[0], recs[-1]
        t0 = first.t_fault if first.t_fault is not None else first.t_detect
        row.update({"detect_s": first.t_detect - t0, "plan_s": last.t_plan - t0,
                    "reconfigure_s": last.t_ready - t0, "first_iteration_s": last.t_first - t0})
        row["stall_s"] = (last.t_first - first.t_last_complete) - row["after_s"] if first.t_last_complete else None
        row["t_fault"] = t0
        row["solver"] = [r.solver for r in recs]
    return row


WINDOW = 2.0  # seconds of the sliding window the plotted throughput averages over


def useful_throughput(series: list[tuple[float, int]], t0: float) -> list[tuple[float, float]]:
    """Iterations per second that advance training (an iteration run again counts nothing): the
    growth over the last WINDOW seconds of progress interpolated linearly between completions,
    sampled every 0.05 s; times relative to `t0`."""
    points, best = [], -1
    for t, it in sorted(series):
        if it > best:
            points.append((t, len(points) + 1))
            best = it

    def progress(t: float) -> float:
        if t <= points[0][0]:
            return points[0][1]
        for (ta, pa), (tb, pb) in zip(points, points[1:]):
            if ta <= t <= tb:
                return pa + (pb - pa) * (t - ta) / (tb - ta)
        return points[-1][1]

    out, t = [], points[0][0] + WINDOW
    while t <= points[-1][0] + 1e-9:
        out.append((t - t0, (progress(t) - progress(t - WINDOW)) / WINDOW))
        t += 0.05
    return out


def plot(series: dict[str, list[tuple[float, int]]], fault: dict[str, float], title: str) -> str:
    """Useful throughput over time since the fault, one line per method; the fault at 0."""
    pts = {m: useful_throughput(s, fault.get(m, 0.0)) for m, s in series.items()}
    xs = [x for p in pts.values() for x, _ in p]
    ys = [y for p in pts.values() for _, y in p]
    chart = Chart((min(xs + [0.0]), max(xs)), (0.0, max(ys) * 1.15), title=title, xlabel="seconds since the fault",
                  ylabel=f"useful iterations per second ({WINDOW:g} s window)")
    chart.marker(0.0, "fault", "#d62728")
    colours = {"reroute": "#1f77b4", "drop-pipeline": "#ff7f0e", "restart": "#2ca02c"}
    for m, p in pts.items():
        chart.line(p, m, colours.get(m, "#555"))
    chart.note("an iteration run")
    chart.note("again counts 0")
    return chart.svg()


def plot_file(out: Path, name: str, series: dict, faults: dict) -> Path:
    path = out / f"throughput-{name.replace(' ', '-')}.svg"
    path.write_text(plot(series, faults, f"16 GPUs, --emulate: {name} killed at iteration {FAULT_AT}"))
    return path


def replot(rows: list[dict], out: Path) -> list[Path]:
    """The plots of a live_recovery.json's rows (each row keeps the series it was drawn from)."""
    by: dict[str, tuple[dict, dict]] = {}
    for row in rows:
        series, faults = by.setdefault(row["scenario"], ({}, {}))
        series[row["method"]] = [tuple(p) for p in row["series"]]
        if row.get("t_fault") is not None:
            faults[row["method"]] = row["t_fault"]
    return [plot_file(out, name, series, faults) for name, (series, faults) in by.items()]


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = ("| scenario | method | recoveries | detect s | plan s | reconfigure s | first iteration s | "
            "period before s (sim) | period after s (sim) | after / sim | redone | stall s |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        ratio = r["after_s"] / r["predicted_after_s"]
        lines.append(f"| {r['scenario']} | {r['method']} | {r['recoveries']} | {fmt(r.get('detect_s'))} | "
                     f"{fmt(r.get('plan_s'))} | "
                     f"{fmt(r.get('reconfigure_s'))} | {fmt(r.get('first_iteration_s'))} | "
                     f"{r['before_s']:.3f} ({r['predicted_before_s']:.3f}) | {r['after_s']:.3f} "
                     f"({r['predicted_after_s']:.3f}) | {ratio:.3f} | {r['redone']} | {fmt(r.get('stall_s'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", default="bench/results/live", help="where results go")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one scenario, reroute and restart only")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(map(repr, SCENARIOS))}")
    parser.add_argument("--replot", metavar="JSON", help="draw the plots from a live_recovery.json, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        for path in replot(json.loads(Path(args.replot).read_text()), out):
            print(f"wrote {path}")
        return 0
    plan_dir = out / "plan"
    schedc.compile(SPEC).write(plan_dir)
    scenarios = {"one GPU": SCENARIOS["one GPU"]} if args.quick else SCENARIOS
    if args.scenario:
        scenarios = {name: SCENARIOS[name] for name in args.scenario}
    methods = ["reroute", "restart"] if args.quick else METHODS
    rows = []
    for name, inject in scenarios.items():
        series, faults = {}, {}
        for method in methods:
            if method != "reroute" and name == "a hung GPU":
                continue  # the alternatives detect a hang the same way; nothing new to learn
            started = time.monotonic()
            row = measure(plan_dir, method, inject, args.iterations)
            row["scenario"] = name
            rows.append(row)
            series[method] = row["series"]
            if row.get("t_fault") is not None:
                faults[method] = row["t_fault"]
            print(f"{name:10s} {method:14s} first iteration {fmt(row.get('first_iteration_s'))} s after the fault, "
                  f"after/sim {row['after_s'] / row['predicted_after_s']:.3f}, all iterations: "
                  f"{row['all_iterations']} ({time.monotonic() - started:.0f} s)", flush=True)
        plot_file(out, name, series, faults)
    text = table(rows)
    (out / "live_recovery.md").write_text(text + "\n")
    (out / "live_recovery.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print()
    print(text)
    print(f"\nwrote {out / 'live_recovery.md'}, live_recovery.json and throughput-*.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
