"""The comparison benchmark behind `schedc bench`: schedc's planner against the baselines.

    schedc bench [-o bench/results] [--quick] [--time-limit S] [--seeds N] [--no-scale]
    run_benchmark(Path("bench/results"), quick=True)

Scenarios (a fixed, seeded matrix; see `scenarios`): GPT-3-like models
(Medium, 1.3B, 2.7B; costs derived by the cost model from a `model` block)
and explicit-cost specs, 16 to 64 GPUs, 1-10% of GPUs failed at seeded random
places, whole nodes failed, and slow GPUs at 0.5-0.8 speed; then scale
points (256, 1024, 4096 GPUs) for planning latency, and an ablation of
decoupled backward and staggered optimizer. Every schedule is verified
before it is counted. Writes to the output directory:

- `results.md`: the tables (quality, latency, ablation);
- `results.csv`, `latency.csv`, `ablation.csv`: one row per run;
- `throughput.svg`: throughput relative to fault-free against the number of
  failed GPUs, one line per method; `latency.svg`: solve time against GPU count.

`python bench/run.py` runs the same.
"""

from __future__ import annotations

import csv
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

METHODS = ("cpsat", "greedy", "reroute-1f1b", "drop-pipeline", "redundant")

#: GPT-3 family shapes (Brown et al. 2020, table 2.1): layers, hidden, heads.
MODELS = {
    "gpt3-medium": (24, 1024, 16),
    "gpt3-1.3b": (24, 2048, 16),
    "gpt3-2.7b": (32, 2560, 32),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # a key of MODELS, or "explicit"
    dp: int
    pp: int
    microbatches: int
    failures: tuple[str, ...] = ()  # statements of the failures block
    seed: int = 0
    decouple_backward: bool = True
    stagger_optimizer: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.pp

    @property
    def n_failed(self) -> int:
        return sum(8 if f.startswith("fail node") else 1 for f in self.failures if f.startswith("fail"))

    @property
    def n_slow(self) -> int:
        return sum(1 for f in self.failures if f.startswith("slow"))

    def spec_text(self) -> str:
        """The scenario as spec text (so the parser, validator and cost model are on the path)."""
        head = [f"# schedc bench scenario {self.name}"]
        if self.model == "explicit":
            head.append("stages {\n    all { forward = 1.0ms  backward_input = 1.0ms  backward_weight = 0.8ms"
                        "  optimizer = 0.4ms\n          activation = 2GiB  stash = 512MiB  static = 12GiB"
                        "  send = 16MiB }\n"
                        f"    stage 0 {{ forward = 1.2ms }}\n    stage {self.pp - 1} {{ forward = 1.4ms"
                        "  backward_input = 1.5ms }\n}")
            gpu = "gpu { memory = 40GiB }"
        else:
            layers, hidden, heads = MODELS[self.model]
            head.append(f'model "{self.model}" {{\n    layers = {layers}  hidden = {hidden}  heads = {heads}'
                        "  seq_len = 2048  vocab = 50304\n    microbatch_size = 1  precision = bf16\n}")
            gpu = "gpu { memory = 80GiB  flops = 312TFLOPS  efficiency = 0.45 }"
        head.append(f"cluster {{\n    dp = {self.dp}  pp = {self.pp}  gpus_per_node = 8\n    {gpu}\n"
                    "    link { latency = 20us  bandwidth = 25GB/s }\n}")
        head.append(f"train {{ microbatches = {self.microbatches} }}")
        if self.failures:
            head.append("failures {\n" + "\n".join(f"    {f}" for f in self.failures) + "\n}")
        head.append(f"schedule {{ decouple_backward = {str(self.decouple_backward).lower()}"
                    f"  stagger_optimizer = {str(self.stagger_optimizer).lower()} }}")
        return "\n".join(head) + "\n"


# -- the matrix ------------------------------------------------------------------


def _random_failures(dp: int, pp: int, n: int, rng: random.Random) -> list[str]:
    """`n` failed GPUs at random places, never a whole stage."""
    gpus = [(d, s) for d in range(dp) for s in range(pp)]
    while True:
        picked = sorted(rng.sample(gpus, n))
        lost = {s for s in range(pp) if sum(1 for _, t in picked if t == s) >= dp}
        if not lost:
            return [f"fail gpu(dp={d}, pp={s})" for d, s in picked]


def _failure_sets(dp: int, pp: int, seed: int) -> list[tuple[str, tuple[str, ...]]]:
    rng = random.Random(seed * 1000 + dp * 31 + pp)
    n = dp * pp
    sets: list[tuple[str, tuple[str, ...]]] = [("fault-free", ())]
    counts = sorted({1, max(1, round(0.05 * n)), max(1, round(0.10 * n))})
    for k in counts:
        sets.append((f"{k}-failed", tuple(_random_failures(dp, pp, k, rng))))
    if n >= 16 and dp >= 3:
        sets.append(("node-failed", (f"fail node {rng.randrange(n // 8)}",)))
    slow = rng.sample([(d, s) for d in range(dp) for s in range(pp)], 2)
    speeds = [rng.choice([0.5, 0.6, 0.7, 0.8]) for _ in slow]
    sets.append(("2-slow", tuple(f"slow gpu(dp={d}, pp={s}) speed = {v}" for (d, s), v in zip(slow, speeds))))
    return sets


def scenarios(quick: bool, seeds: int) -> list[Scenario]:
    """The quality matrix: (model, dp, pp, microbatches) x failure sets x seeds."""
    if quick:
        shapes = [("explicit", 4, 4, 8), ("gpt3-1.3b", 4, 4, 16)]
    else:
        shapes = [("explicit", 4, 4, 8), ("explicit", 8, 4, 16), ("gpt3-medium", 4, 4, 16),
                  ("gpt3-1.3b", 2, 8, 16), ("gpt3-1.3b", 8, 4, 16), ("gpt3-2.7b", 4, 8, 32),
                  ("gpt3-2.7b", 8, 8, 32)]
    out = []
    for model, dp, pp, mb in shapes:
        for seed in range(seeds):
            for label, fails in _failure_sets(dp, pp, seed):
                if seed > 0 and label == "fault-free":
                    continue  # the fault-free point does not depend on the seed
                out.append(Scenario(f"{model}-{dp}x{pp}x{mb}-{label}-s{seed}", model, dp, pp, mb,
                                    fails, seed))
    return out


def scale_scenarios(quick: bool) -> list[Scenario]:
    """Latency points: 1% of GPUs failed, pp = 8, 16 microbatches per pipeline."""
    sizes = [64, 256] if quick else [64, 256, 1024, 4096]
    out = []
    for n in sizes:
        dp, pp = n // 8, 8
        fails = _random_failures(dp, pp, max(1, n // 100), random.Random(n))
        out.append(Scenario(f"scale-{n}", "explicit", dp, pp, 16, tuple(fails)))
    return out


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
        + (f"  [{cp.status}, {cp.wall_s:.2f}s]" if cp.wall_s is not None else ""))
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
            + " | cpsat / LB | cpsat / proven bound | cpsat vs greedy | vs reroute | vs drop | vs redundant | cpsat status | "
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
        out += (f"- cpsat / best proven bound over the same {len(proven)}: median "
                f"{statistics.median(r for r, _ in proven):.3f}, worst {pw[0]:.3f} ({pw[1]}); "
                f"proven optimal in {at}\n")
    return (out +
            f"- cpsat never slower than greedy: {all(v >= 1.0 for v in vs_greedy)} "
            f"(greedy / cpsat: min {min(vs_greedy):.3f}, max {max(vs_greedy):.3f})\n")


def latency_table(runs: list[Run]) -> tuple[str, list[dict]]:
    by_gpus: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if r.wall_s is not None:
            by_gpus.setdefault((r.method, r.scenario.gpus), []).append(r.wall_s)
    lines = ["| method | GPUs | runs | solve p50 s | solve p95 s | max s |", "|---|---|---|---|---|---|"]
    rows = []
    for (method, n), ws in sorted(by_gpus.items(), key=lambda kv: (kv[0][1], METHODS.index(kv[0][0])
                                                                     if kv[0][0] in METHODS else 99)):
        p50, p95 = statistics.median(ws), percentile(ws, 0.95)
        lines.append(f"| {method} | {n} | {len(ws)} | {p50:.3f} | {p95:.3f} | {max(ws):.3f} |")
        rows.append({"method": method, "gpus": n, "runs": len(ws), "p50_s": round(p50, 4),
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


# -- SVG line charts, written by hand (no plotting library is a dependency) ------

_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
               *, log_x: bool = False, log_y: bool = False, notes: list[str] = ()) -> str:
    """A small SVG line chart: one polyline with markers per series, axes with five ticks each.

    Series are drawn first to last with shrinking widths and their own dash patterns, so one
    that lies on another stays visible; `notes` are printed under the chart (what a point
    averages, why a line stops)."""
    w, h, ml, mr, mt, mb = 640, 400 + 16 * len(notes), 70, 150, 40, 50 + 16 * len(notes)
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"></svg>\n'
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(max(v, 1e-6))) if log_y else (lambda v: v)
    xs, ys = [fx(x) for x, _ in pts], [fy(y) for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if not log_y:
        y0 = min(y0, 0.0)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - (pad if log_y else 0), y1 + pad

    def px(x):
        return ml + (fx(x) - x0) / (x1 - x0) * (w - ml - mr)

    def py(y):
        return h - mb - (fy(y) - y0) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           *(f'<text x="{ml}" y="{h - 16 * (len(notes) - k) + 4}" font-size="11" fill="#444">{_xml(n)}</text>'
             for k, n in enumerate(notes)),
           f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
           f'<text x="{(ml + w - mr) / 2}" y="{h - mb + 36}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{(mt + h - mb) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 16 {(mt + h - mb) / 2})">{ylabel}</text>']
    for i in range(5):
        tv = y0 + (y1 - y0) * i / 4
        v = 10 ** tv if log_y else tv
        y = h - mb - (tv - y0) / (y1 - y0) * (h - mt - mb)
        out.append(f'<line x1="{ml - 4}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for xv in sorted({x for x, _ in pts}):
        out.append(f'<text x="{px(xv):.1f}" y="{h - mb + 16}" text-anchor="middle">{xv:g}</text>')
    dashes = ["", "7,4", "2,3", "9,3,2,3", "4,4"]
    n = len(series)
    for i, (name, s) in enumerate(series.items()):
        c = _COLOURS[i % len(_COLOURS)]
        width = 2 + 1.5 * (n - 1 - i)  # the first series widest, drawn first: later ones lie on top
        dash = dashes[i % len(dashes)]
        style = f' stroke-dasharray="{dash}"' if dash else ""
        s = sorted(s)
        if len(s) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s)
            out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="{width:g}"{style} '
                       'stroke-opacity="0.85"/>')
        for x, y in s:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{2 + (n - 1 - i) * 0.7:.1f}" fill="{c}"/>')
        ly = mt + 18 * i
        out.append(f'<line x1="{w - mr + 10}" y1="{ly}" x2="{w - mr + 30}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="{min(width, 4):g}"{style}/>')
        out.append(f'<text x="{w - mr + 35}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


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
          "every schedule verified); `vs X` is cpsat's throughput relative to X (X's time / cpsat's).\n",
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
        "throughput / fault-free", notes=throughput_notes(quality)))
    lat_series: dict[str, list[tuple[float, float]]] = {}
    for row in lrows:
        lat_series.setdefault(f"{row['method']} p95", []).append((row["gpus"], row["p95_s"]))
    (out / "latency.svg").write_text(line_chart(lat_series, "Planning latency", "GPUs", "solve time p95 (s)",
                                                log_x=True, log_y=True))
    return written
