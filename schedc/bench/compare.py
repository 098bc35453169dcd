"""The comparison behind `schedc bench`: every method on every scenario, and the report.

    schedc bench [-o bench/results] [--quick] [--time-limit S] [--seeds N] [--no-scale]
    run_benchmark(Path("bench/results"), quick=True)

The methods (`METHODS`: schedc's cpsat and greedy, the baselines) plan each
scenario of `schedc.bench.scenarios`; then the scale points are planned for
latency, and an ablation turns decoupled backward and the staggered optimizer
off. Every schedule is verified before it is counted. Writes to the output
directory:

- `results.md`: the tables (quality, latency, ablation);
- `results.csv`, `latency.csv`, `ablation.csv`: one row per run;
- `throughput.svg`: throughput relative to fault-free against the number of
  failed GPUs, one line per method; `latency.svg`: solve time against GPU count
  (the median per count, a whisker from the fastest run to the slowest).

`python bench/run.py` runs the same.
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from schedc.bench.chart import line_chart
from schedc.schedule import PLAN_SPACE, status_text
from schedc.bench.scenarios import Scenario, scale_scenarios, scenarios

#: schedc's planners first, then the baselines (docs/baselines.md); tables and charts keep this order.
METHODS = ("cpsat", "greedy", "reroute-1f1b", "drop-pipeline", "redundant")


# -- running -------------------------------------------------------------------


@dataclass
class Run:
    scenario: Scenario
    method: str
    iteration_time: int | None = None
    wall_s: float | None = None
    status: str = ""
    peak_memory: int | None = None
    memory_limit: int | None = None
    lower_bound: float | None = None
    #: The best proven lower bound: cpsat's own (`SolverInfo.bound`), else `period_lower_bound`.
    proven_bound: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def run_method(instance, method: str, time_limit: float, seed: int = 0):
    """Solve, verify and simulate one method on one instance: (schedule, sim, wall) or an error."""
    from schedc.simulate import simulate
    from schedc.solvers import SolveOptions, get_solver
    from schedc.verify import verify_schedule

    started = time.perf_counter()
    schedule = get_solver(method)(instance, SolveOptions(time_limit=time_limit, seed=seed))
    wall = time.perf_counter() - started
    verify_schedule(schedule)
    return schedule, simulate(schedule), wall


def _measure(sc: Scenario, methods: Iterable[str], time_limit: float, log: Callable[[str], None]) -> list[Run]:
    from schedc.diagnostics import SchedcError
    from schedc.instance import from_spec
    from schedc.load import load
    from schedc.solvers.cpsat_bound import period_lower_bound

    inst = from_spec(load(sc.spec_text(), name=sc.name))
    runs = []
    try:
        proven = float(period_lower_bound(inst))
    except (ValueError, OverflowError):  # a stage with no live GPU: every method fails (E301/E311)
        proven = None
    for method in methods:
        run = Run(sc, method, lower_bound=inst.lower_bound, memory_limit=inst.gpu_memory,
                  proven_bound=proven)
        try:
            schedule, sim, wall = run_method(inst, method, time_limit, sc.seed)
            run.iteration_time = sim.iteration_time
            run.wall_s = wall
            run.status = schedule.solver.status
            run.peak_memory = max(sim.peak_memory.values(), default=0)
            if method == "cpsat" and schedule.solver.bound is not None:
                run.proven_bound = max(run.proven_bound or 0.0, schedule.solver.bound)
        except SchedcError as exc:
            run.error = exc.diagnostics[0].code if exc.diagnostics else type(exc).__name__
        runs.append(run)
    cp = next((r for r in runs if r.method == "cpsat"), runs[0])
    log(f"{sc.name:44s} lb={inst.lower_bound / 1000:8.1f}ms " + " ".join(
        f"{r.method}={'-' if r.iteration_time is None else f'{r.iteration_time / 1000:.1f}'}" for r in runs)
        + (f"  [{status_text(cp.status)}, {cp.wall_s:.2f}s]" if cp.wall_s is not None else ""))
    return runs


def _fault_free(runs: list[Run]) -> dict[tuple, int]:
    """Fault-free iteration time (cpsat) per shape."""
    out = {}
    for r in runs:
        sc = r.scenario
        if not sc.failures and r.method == "cpsat" and r.iteration_time:
            out[(sc.model, sc.dp, sc.pp, sc.microbatches, sc.decouple_backward, sc.stagger_optimizer)] = \
                r.iteration_time
    return out


def _shape(sc: Scenario) -> tuple:
    return (sc.model, sc.dp, sc.pp, sc.microbatches, sc.decouple_backward, sc.stagger_optimizer)


# -- output --------------------------------------------------------------------


def _ms(t: int | None) -> str:
    return "-" if t is None else f"{t / 1000:.2f}"


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of `xs`."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def quality_table(runs: list[Run]) -> tuple[str, list[dict]]:
    ff = _fault_free(runs)
    by_sc: dict[str, dict[str, Run]] = {}
    order: list[Scenario] = []
    for r in runs:
        if r.scenario.name not in by_sc:
            order.append(r.scenario)
        by_sc.setdefault(r.scenario.name, {})[r.method] = r
    head = ("| scenario | GPUs | failed | slow | fault-free ms | " + " | ".join(f"{m} ms" for m in METHODS)
            + f" | cpsat / LB | cpsat / proven bound ({PLAN_SPACE}) | cpsat vs greedy | vs reroute | vs drop | vs redundant | cpsat status | "
              "cpsat solve s | peak mem / limit |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = []
    for sc in order:
        rs = by_sc[sc.name]
        cp = rs["cpsat"]
        fft = ff.get(_shape(sc))
        rel = []
        for m in METHODS[1:]:
            t = rs[m].iteration_time if m in rs else None
            rel.append(f"{t / cp.iteration_time:.3f}x" if t and cp.iteration_time else "-")
        ratio = cp.iteration_time / cp.lower_bound if cp.iteration_time and cp.lower_bound else None
        proven = cp.iteration_time / cp.proven_bound if cp.iteration_time and cp.proven_bound else None
        mem = f"{cp.peak_memory / cp.memory_limit:.2f}" if cp.peak_memory else "-"
        lines.append(f"| {sc.name} | {sc.gpus} | {sc.n_failed} | {sc.n_slow} | {_ms(fft)} | "
                     + " | ".join(_ms(rs[m].iteration_time) if m in rs else "-" for m in METHODS)
                     + f" | {'-' if ratio is None else f'{ratio:.3f}'} | {'-' if proven is None else f'{proven:.3f}'} | "
                     + " | ".join(rel)
                     + f" | {cp.status or cp.error} | {'-' if cp.wall_s is None else f'{cp.wall_s:.2f}'} | {mem} |")
        row = {"scenario": sc.name, "model": sc.model, "dp": sc.dp, "pp": sc.pp,
               "microbatches": sc.microbatches, "gpus": sc.gpus, "failed": sc.n_failed, "slow": sc.n_slow,
               "seed": sc.seed, "fault_free_us": fft, "lower_bound_us": round(cp.lower_bound or 0, 1),
               "proven_bound_us": cp.proven_bound,
               "cpsat_status": cp.status, "cpsat_solve_s": None if cp.wall_s is None else round(cp.wall_s, 4),
               "peak_memory": cp.peak_memory, "memory_limit": cp.memory_limit}
        for m in METHODS:
            r = rs.get(m)
            row[f"{m}_us"] = r.iteration_time if r else None
            row[f"{m}_error"] = r.error if r else ""
        rows.append(row)
    return "\n".join(lines), rows


def summary(runs: list[Run]) -> str:
    """Median and worst cpsat / lower bound where microbatches >= 2 pp (against the per-stage work bound and
    against the best proven one), and cpsat vs greedy."""
    ratios, proven, vs_greedy = [], [], []
    by: dict[str, dict[str, Run]] = {}
    for r in runs:
        by.setdefault(r.scenario.name, {})[r.method] = r
    for rs in by.values():
        cp, gr = rs.get("cpsat"), rs.get("greedy")
        sc = cp.scenario
        if cp.iteration_time and sc.microbatches >= 2 * sc.pp and sc.failures:
            ratios.append((cp.iteration_time / cp.lower_bound, sc.name))
            if cp.proven_bound:
                proven.append((cp.iteration_time / cp.proven_bound, sc.name))
        if gr and gr.iteration_time and cp.iteration_time:
            vs_greedy.append(gr.iteration_time / cp.iteration_time)
    if not ratios:
        return ""
    worst = max(ratios)
    out = (f"- cpsat iteration time / lower bound (per-stage work) over {len(ratios)} failure scenarios with microbatches "
           f">= 2 x pp: median {statistics.median(r for r, _ in ratios):.3f}, worst {worst[0]:.3f} ({worst[1]})\n")
    if proven:
        pw = max(proven)
        at = sum(1 for r, _ in proven if r <= 1.0)
        out += (f"- cpsat / best proven bound ({PLAN_SPACE}) over the same {len(proven)}: median "
                f"{statistics.median(r for r, _ in proven):.3f}, worst {pw[0]:.3f} ({pw[1]}); "
                f"proven optimal among {PLAN_SPACE} in {at}\n")
    return (out +
            f"- cpsat never slower than greedy: {all(v >= 1.0 for v in vs_greedy)} "
            f"(greedy / cpsat: min {min(vs_greedy):.3f}, max {max(vs_greedy):.3f})\n")


def latency_table(runs: list[Run]) -> tuple[str, list[dict]]:
    by_gpus: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if r.wall_s is not None:
            by_gpus.setdefault((r.method, r.scenario.gpus), []).append(r.wall_s)
    lines = ["| method | GPUs | runs | min s | solve p50 s | solve p95 s | max s |", "|---|---|---|---|---|---|---|"]
    rows = []
    for (method, n), ws in sorted(by_gpus.items(), key=lambda kv: (kv[0][1], METHODS.index(kv[0][0])
                                                                     if kv[0][0] in METHODS else 99)):
        p50, p95 = statistics.median(ws), percentile(ws, 0.95)
        lines.append(f"| {method} | {n} | {len(ws)} | {min(ws):.3f} | {p50:.3f} | {p95:.3f} | {max(ws):.3f} |")
        rows.append({"method": method, "gpus": n, "runs": len(ws), "min_s": round(min(ws), 4), "p50_s": round(p50, 4),
                     "p95_s": round(p95, 4), "max_s": round(max(ws), 4)})
    return "\n".join(lines), rows


def ablation_table(runs: list[Run]) -> tuple[str, list[dict]]:
    lines = ["| scenario | decouple | stagger | cpsat ms | cpsat / LB | vs both on |", "|---|---|---|---|---|---|"]
    rows = []
    base: dict[str, int] = {}
    for r in runs:
        sc = r.scenario
        if sc.decouple_backward and sc.stagger_optimizer and r.iteration_time:
            base[sc.name.split("|")[0]] = r.iteration_time
    for r in runs:
        sc = r.scenario
        key = sc.name.split("|")[0]
        b = base.get(key)
        rel = f"{r.iteration_time / b:.3f}x" if b and r.iteration_time else "-"
        lb = f"{r.iteration_time / r.lower_bound:.3f}" if r.iteration_time else "-"
        lines.append(f"| {key} | {sc.decouple_backward} | {sc.stagger_optimizer} | {_ms(r.iteration_time)} "
                     f"| {lb} | {rel} |")
        rows.append({"scenario": key, "decouple_backward": sc.decouple_backward,
                     "stagger_optimizer": sc.stagger_optimizer, "cpsat_us": r.iteration_time,
                     "lower_bound_us": round(r.lower_bound or 0, 1)})
    return "\n".join(lines), rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# -- the throughput chart ------------------------------------------------------


def throughput_notes(runs: list[Run]) -> list[str]:
    """What `throughput_series` averages, and where (and why) a method's line stops."""
    counts: dict[int, set] = {}
    plans: dict[str, set[int]] = {}
    for r in runs:
        sc = r.scenario
        if sc.n_slow or not sc.failures:
            continue
        counts.setdefault(sc.n_failed, set()).add(sc.name)
        if r.iteration_time:
            plans.setdefault(r.method, set()).add(sc.n_failed)
    notes = ["each point: the mean over the fail-stop scenarios with that many failed GPUs ("
             + ", ".join(f"{k}: {len(v)}" for k, v in sorted(counts.items()))
             + "); their models and shapes differ"]
    top = max(counts, default=0)
    for m, ks in plans.items():
        if ks and max(ks) < top:
            notes.append(f"{m}: no plan beyond {max(ks)} failed GPUs (a stage lost every replica, "
                         "or it refuses that failure set)")
    return notes


def throughput_series(runs: list[Run]) -> dict[str, list[tuple[float, float]]]:
    """Mean throughput relative to fault-free per number of failed GPUs (fail-stop scenarios only)."""
    ff = _fault_free(runs)
    acc: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        sc = r.scenario
        fft = ff.get(_shape(sc))
        if sc.n_slow or not fft or not r.iteration_time:
            continue
        acc.setdefault(r.method, {}).setdefault(sc.n_failed, []).append(fft / r.iteration_time)
    return {m: [(k, statistics.mean(v)) for k, v in sorted(acc[m].items())] for m in METHODS if m in acc}


# -- the run -------------------------------------------------------------------


def run_benchmark(out: Path, *, quick: bool = False, time_limit: float = 1.0, scale_time_limit: float = 10.0,
                  seeds: int | None = None, scale: bool = True, ablation: bool = True, limit: int | None = None,
                  command: str = "schedc bench", log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """Run the benchmark into `out`: results.md, the CSVs and the charts; returns their paths.
    `log` gets one line per scenario, prefixed with the count done and an estimate of the time left."""
    from schedc.solvers.cpsat import warm_up

    warm_up()  # OR-Tools' import is not part of any solve time
    out.mkdir(parents=True, exist_ok=True)
    seeds = seeds if seeds is not None else (1 if quick else 2)
    started = time.perf_counter()
    matrix = scenarios(quick, seeds)[:limit]
    jobs: list[tuple[str, Scenario, tuple[str, ...], float]] = [("quality", sc, METHODS, time_limit) for sc in matrix]
    if scale:
        jobs += [("scale", sc, ("greedy", "cpsat"), scale_time_limit) for sc in scale_scenarios(quick)]
    if ablation:
        picks = [sc for sc in matrix if sc.failures and not sc.n_slow][:1 if quick else 4]
        for sc in picks:
            for dec in (True, False):
                for stg in (True, False):
                    v = replace(sc, name=f"{sc.name}|d{int(dec)}s{int(stg)}", decouple_backward=dec,
                                stagger_optimizer=stg)
                    jobs.append(("ablation", v, ("cpsat",), time_limit))
    runs: dict[str, list[Run]] = {"quality": [], "scale": [], "ablation": []}
    for k, (bucket, sc, methods, tl) in enumerate(jobs):
        elapsed = time.perf_counter() - started
        left = f", ~{elapsed / k * (len(jobs) - k):.0f} s left" if k else ""

        def counted(msg: str, k=k, left=left) -> None:
            log(f"[{k + 1}/{len(jobs)}{left}] {msg}")

        runs[bucket].extend(_measure(sc, methods, tl, counted))
    quality, ablation_runs = runs["quality"], runs["ablation"]
    qtab, qrows = quality_table(quality)
    lat_runs = [r for r in quality if r.method in ("cpsat", "greedy")] + runs["scale"]
    ltab, lrows = latency_table(lat_runs)
    atab, arows = ablation_table(ablation_runs)
    md = [f"# schedc bench results\n\nCommand: `{command}`; cpsat/greedy time limit {time_limit} s "
          f"(scale points {scale_time_limit} s); {len(matrix)} quality scenarios; total "
          f"{time.perf_counter() - started:.0f} s. Times are steady-state iteration times (simulated, "
          "every schedule verified); `vs X` is cpsat's throughput relative to X (X's time / cpsat's). "
          f"cpsat's status `optimal`, its proven bound and the lower bounds hold among {PLAN_SPACE} (the plans "
          "it searches: "
          "failed GPUs' work moved to their data-parallel peers); a plan of another kind, such as "
          "`redundant`'s, can be faster.\n",
          "## Quality\n", qtab, "", summary(quality), "## Planning latency (solve time, seconds)\n", ltab, ""]
    if ablation_runs:
        md += ["## Ablation: decoupled backward and staggered optimizer (cpsat)\n", atab, ""]
    written = [out / n for n in ("results.md", "results.csv", "latency.csv", "ablation.csv", "throughput.svg",
                                 "latency.svg")]
    (out / "results.md").write_text("\n".join(md) + "\n")
    _write_csv(out / "results.csv", qrows)
    _write_csv(out / "latency.csv", lrows)
    _write_csv(out / "ablation.csv", arows)
    (out / "throughput.svg").write_text(line_chart(
        throughput_series(quality), "Throughput under failures", "failed GPUs",
        "throughput / fault-free", integer_x=True, footnotes=throughput_notes(quality)))
    (out / "latency.svg").write_text(latency_chart(lrows))
    return written


def latency_chart(rows: list[dict]) -> str:
    """Solve time against GPU count per method: the median of the runs at each count, and a whisker
    from the fastest to the slowest run (one slow run, e.g. a fallback on a loaded machine, shows as
    a long whisker, not as the line)."""
    series: dict[str, list[tuple[float, float]]] = {}
    spread: dict[str, list[tuple[float, float, float]]] = {}
    for row in rows:
        series.setdefault(row["method"], []).append((row["gpus"], row["p50_s"]))
        spread.setdefault(row["method"], []).append((row["gpus"], row["min_s"], row["max_s"]))
    runs = sorted({row["runs"] for row in rows})
    count = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}-{runs[-1]}" if runs else "0"
    notes = [f"each point: the median solve time of the {count} run(s) at that GPU count; whiskers: "
             "fastest to slowest run"]
    return line_chart(series, "Planning latency", "GPUs", "solve time (s)", log_x=True, log_y=True,
                      spread=spread, footnotes=notes)
