"""Fail-slow and rejoin benchmark: the 16-GPU job of bench/live_recovery.py (4 pipelines x 4
stages, --emulate) with one GPU slowed for a window of iterations, and a GPU failing and
coming back; plus catch-up against model size with real tensors (2 x 2, compute mode).

Reported:

* **detection**: the iteration the slowdown was confirmed at, against the one it began
  (iterations and seconds), and false alarms (speed changes reported) over a long run with
  no injected slowdown, only the host's own noise;
* **throughput** over the slow window: no slowdown / slowed, detected but not acted on
  (``--fail-slow detect``) / slowed and mitigated (``--fail-slow act``), and the share of
  the slowdown's cost that mitigation saved: (unmitigated - mitigated) / (unmitigated - none),
  in wall time over the window;
* **rejoin**: catch-up time and bytes, the survivors' stall at the switch, the period
  before the failure, without the GPU and after it is back, each against the simulator;
* **catch-up against model size** (real weights and Adam state through the store);
* a plot of useful throughput over wall time per slow case, with the injected window and
  the supervisor's decisions marked.

    python bench/live_slowness.py [-o DIR] [--quiet-iterations N] [--quick]
    python bench/live_slowness.py --replot DIR/report.json [-o DIR]   # the plots again, no run

docs/figures/live-slow-0.5.svg and live-slow-0.8.svg are this script's
slow-0.5.svg and slow-0.8.svg; report.json keeps what they are drawn from, and
docs/figures/live-slowness.json is the slow rows of the run they come from
(``--replot docs/figures/live-slowness.json -o DIR`` draws them again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedc  # noqa: E402
from bench.live_recovery import SPEC, fmt, useful_throughput  # noqa: E402
from schedc.bench.chart import Chart  # noqa: E402
from schedc.live import train  # noqa: E402

SLOW_GPU = "gpu(dp=1, pp=1)"  # rank 5
SLOW_RANK = 5
FROM, UNTIL = 30, 70  # the slow window: iterations FROM .. UNTIL-1
ITERATIONS = 100
WIDTHS = (256, 1024, 2048)  # catch-up: hidden width of the 2 x 2 MLP (Adam)


def run(out: Path, iterations: int, inject: list[str], fail_slow: str = "act") -> dict:
    t = time.time()
    result = train(out, emulate=True, iterations=iterations, inject=inject, fail_slow=fail_slow)
    doc = result.to_json()
    doc["bench_wall_s"] = time.time() - t
    return doc


def ends(doc: dict) -> dict[int, float]:
    """Iteration -> the end of its last run."""
    return {r["iteration"]: r["end"] for r in doc["iterations"]}


def window_s(doc: dict) -> float:
    """Wall time of the slow window: from the end of iteration FROM-1 to the end of UNTIL-1."""
    e = ends(doc)
    return e[UNTIL - 1] - e[FROM - 1]


def slow_events(doc: dict) -> list[dict]:
    return [e for e in doc["events"] if e["kind"] == "slow" and "speed" in e]


def detection(doc: dict) -> dict:
    """When the slowdown was confirmed, in iterations and seconds after the window began."""
    found = [e for e in slow_events(doc) if e["speed"] < 0.88 and e["rank"] == SLOW_RANK]
    if not found:
        return {"delay_iterations": None, "delay_s": None, "since": None}
    first = found[0]
    start = {r["iteration"]: r["start"] for r in doc["iterations"]}[FROM]
    return {"delay_iterations": first["seen"] - FROM + 1, "delay_s": first["t"] - start,
            "since": first["since"], "speed": first["speed"]}


def steady(doc: dict, lo: int, hi: int) -> float:
    """Median gap between successive iteration ends in [lo, hi)."""
    e = ends(doc)
    return statistics.median(e[i] - e[i - 1] for i in range(lo + 1, hi) if i in e and i - 1 in e)


def plot(docs: dict[str, dict], title: str) -> str:
    """Useful throughput over wall time (from the window's start), the window shaded, decisions marked."""
    t0 = {k: {r["iteration"]: r["start"] for r in d["iterations"]}[FROM] for k, d in docs.items()}
    pts = {k: useful_throughput([(r["end"], r["iteration"]) for r in d["iterations"]], t0[k]) for k, d in docs.items()}
    xs = [x for p in pts.values() for x, _ in p]
    ys = [y for p in pts.values() for _, y in p]
    chart = Chart((min(xs), max(xs)), (0.0, max(ys) * 1.2), title=title, width=760, height=380,
                  margins=(60, 170, 40, 45),
                  xlabel=f"seconds since the slowdown began (iteration {FROM})", ylabel="useful iterations per second")
    if "unmitigated" in docs:  # the slow window, as the unmitigated run lived it
        start = {r["iteration"]: r["start"] for r in docs["unmitigated"]["iterations"]}
        chart.band(0.0, start[UNTIL] - t0["unmitigated"], "GPU slowed (unmitigated run)", "#f4e6d7", "#a0522d")
    colours = {"no slowdown": "#2ca02c", "unmitigated": "#ff7f0e", "mitigated": "#1f77b4"}
    for k, p in pts.items():
        chart.line(p, k, colours.get(k, "#555"))
    if "mitigated" in docs:  # the mitigated run's detections and switches
        d = docs["mitigated"]
        marks = [(e["t"] - t0["mitigated"], f"seen {e['speed']:.2f}", "#9467bd") for e in slow_events(d)]
        marks += [(s["t_decide"] - t0["mitigated"], s["kind"], "#d62728") for s in d["switches"]]
        for j, (x, label, colour) in enumerate(sorted(marks)):
            chart.marker(x, label, colour, row=1 + j % 4)
    return chart.svg()


def plot_title(speed: float) -> str:
    return f"16 GPUs (4 x 4, emulated): GPU (1, 1) at speed {speed} for iterations {FROM}-{UNTIL - 1}"


def plotted(doc: dict) -> dict:
    """What `plot` reads of a run: iteration times, slow reports, switches (kept in report.json)."""
    return {"iterations": [{k: r[k] for k in ("iteration", "start", "end")} for r in doc["iterations"]],
            "events": [{k: e[k] for k in ("kind", "t", "speed", "rank")} for e in slow_events(doc)],
            "switches": [{k: s[k] for k in ("kind", "t_decide")} for s in doc["switches"]]}


def slow_cases(out: Path, quick: bool) -> tuple[list[dict], dict]:
    iterations = 80 if quick else ITERATIONS
    none = run(out, iterations, [])
    rows, docs_all = [], {"no slowdown": none}
    for speed in (0.5, 0.8):
        inject = [f"at iteration {FROM}: slow {SLOW_GPU} speed = {speed} until iteration {UNTIL}"]
        un = run(out, iterations, inject, fail_slow="detect")
        mi = run(out, iterations, inject, fail_slow="act")
        w_none, w_un, w_mi = window_s(none), window_s(un), window_s(mi)
        share = (w_un - w_mi) / (w_un - w_none) if w_un > w_none else None
        det = detection(mi)
        rows.append({"speed": speed, "detect": det, "detect_unmitigated": detection(un),
                     "window_s": {"none": w_none, "unmitigated": w_un, "mitigated": w_mi},
                     "throughput": {k: (UNTIL - FROM) / v for k, v in
                                    (("none", w_none), ("unmitigated", w_un), ("mitigated", w_mi))},
                     "share_mitigated": share,
                     "switches": [{k: s[k] for k in ("kind", "start_at", "predicted_before_us", "predicted_after_us",
                                                    "stall_s")} for s in mi["switches"]],
                     "decisions": [{k: d[k] for k in ("verdict", "action", "speed", "gain_us", "reason")}
                                   for d in mi["decisions"]],
                     "false_alarms": [e["message"] for e in slow_events(mi) if e["rank"] != SLOW_RANK],
                     "plotted": {k: plotted(d) for k, d in (("no slowdown", none), ("unmitigated", un),
                                                            ("mitigated", mi))}})
        (out.parent / f"slow-{speed}.svg").write_text(plot(rows[-1]["plotted"], plot_title(speed)))
        docs_all[f"slow {speed} unmitigated"] = un
        docs_all[f"slow {speed} mitigated"] = mi
        print(f"slow {speed}: detected after {det['delay_iterations']} iteration(s) "
              f"({fmt(det['delay_s'])} s); window {w_none:.2f} / {w_un:.2f} / {w_mi:.2f} s "
              f"(none / unmitigated / mitigated); share mitigated {fmt(share)}", flush=True)
    return rows, docs_all


def quiet(out: Path, iterations: int) -> dict:
    doc = run(out, iterations, [], fail_slow="detect")
    alarms = slow_events(doc)
    speeds = [s for r in doc["iterations"] for s in r["speeds"].values()]
    print(f"quiet run: {iterations} iterations, {len(alarms)} false alarm(s); measured speed p1/p50/p99 "
          f"{_pct(speeds, 1):.3f}/{_pct(speeds, 50):.3f}/{_pct(speeds, 99):.3f}", flush=True)
    return {"iterations": iterations, "false_alarms": [e["message"] for e in alarms],
            "speed_p1": _pct(speeds, 1), "speed_p50": _pct(speeds, 50), "speed_p99": _pct(speeds, 99),
            "decisions": len(doc["decisions"]), "switches": len(doc["switches"])}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


def rejoin(out: Path, quick: bool) -> dict:
    iterations = 50 if quick else 60
    inject = [f"at iteration 10: fail {SLOW_GPU}", f"at iteration 25: recover {SLOW_GPU}"]
    doc = run(out, iterations, inject)
    (sw,) = [s for s in doc["switches"] if s["kind"] == "rejoin"]
    (rec,) = doc["recoveries"]
    gen_fail = rec["to_generation"]
    res = {"catch_up_s": sw["catch_up_s"], "catch_up_bytes": sw["catch_up_bytes"], "stall_s": sw["stall_s"],
           "switch_at": sw["start_at"], "announce_to_first_s": sw["t_first"] - sw["t_announce"],
           "period_before_s": steady(doc, 2, 10), "predicted_before_s": rec["predicted_before_us"] / 1e6,
           "period_without_s": steady(doc, rec["resumed_at"] + 2, sw["start_at"]),
           "predicted_without_s": rec["predicted_after_us"] / 1e6,
           "period_after_s": steady(doc, sw["start_at"] + 2, iterations),
           "predicted_after_s": sw["predicted_after_us"] / 1e6, "generation_without": gen_fail}
    print(f"rejoin: caught up in {fmt(res['catch_up_s'])} s, survivors' stall {fmt(res['stall_s'])} s; period "
          f"{res['period_before_s']:.3f} ({res['predicted_before_s']:.3f}) -> {res['period_without_s']:.3f} "
          f"({res['predicted_without_s']:.3f}) -> {res['period_after_s']:.3f} ({res['predicted_after_s']:.3f}) s",
          flush=True)
    return res


def catch_up_by_size(root: Path, quick: bool) -> list[dict]:
    rows = []
    for width in WIDTHS[:2] if quick else WIDTHS:
        spec = f"""
model "m" {{ source = "bench.catchup_models:build_{width}"  data = "schedc.models.mlp:batch" }}
cluster {{ dp = 2  pp = 2  gpus_per_node = 2  gpu {{ memory = 8GiB }}  link {{ latency = 50us  bandwidth = 1GB/s }} }}
stages {{ all {{ forward = 2ms  backward_input = 2ms  backward_weight = 1ms  optimizer = 0.5ms
               activation = 4MiB  stash = 1MiB  static = 16MiB  send = 64KiB }} }}
train {{ microbatches = 3  optimizer = adam  lr = 0.001  iterations = 30 }}
schedule {{ solver = greedy }}
"""
        out = root / f"w{width}"
        schedc.compile(spec).write(out)
        t = time.time()
        result = train(out, iterations=30, inject=["at iteration 4: fail gpu(dp=1, pp=0)",
                                                   "at iteration 10: recover gpu(dp=1, pp=0)"])
        doc = result.to_json()
        (sw,) = [s for s in doc["switches"] if s["kind"] == "rejoin"]
        row = {"width": width, "stage_bytes": sw["catch_up_bytes"], "catch_up_s": sw["catch_up_s"],
               "stall_s": sw["stall_s"], "run_s": time.time() - t}
        rows.append(row)
        print(f"catch-up, width {width}: {sw['catch_up_bytes'] / 2**20:.1f} MiB in {fmt(sw['catch_up_s'])} s, "
              f"survivors' stall {fmt(sw['stall_s'])} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default="bench/results/live-slowness", help="where results go")
    ap.add_argument("--quiet-iterations", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes (a smoke run)")
    ap.add_argument("--replot", metavar="JSON", help="draw the plots from a report.json, run nothing")
    args = ap.parse_args(argv)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    if args.replot:
        for row in json.loads(Path(args.replot).read_text())["slow"]:
            path = root / f"slow-{row['speed']}.svg"
            path.write_text(plot(row["plotted"], plot_title(row["speed"])))
            print(f"wrote {path}")
        return 0
    out = root / "plan"
    schedc.compile(SPEC).write(out)
    report = {"spec": SPEC, "slow_rank": SLOW_RANK, "window": [FROM, UNTIL]}
    report["slow"], docs = slow_cases(out, args.quick)
    trace = {"slow_rank": SLOW_RANK, "from": FROM, "until": UNTIL, "ranks": {}}
    import math
    for r in docs["slow 0.5 unmitigated"]["iterations"]:
        for rank, s in r["speeds"].items():
            if int(rank) in (SLOW_RANK, 4, 6, 9):
                trace["ranks"].setdefault(rank, []).append(round(math.log(s), 5))
    (root / "slow_trace.json").write_text(json.dumps(trace))
    report["rejoin"] = rejoin(out, args.quick)
    report["catch_up"] = catch_up_by_size(root, args.quick)
    report["quiet"] = quiet(out, 100 if args.quick else args.quiet_iterations)
    (root / "report.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {root / 'report.json'}, {root / 'slow-0.5.svg'}, {root / 'slow-0.8.svg'}, {root / 'slow_trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
