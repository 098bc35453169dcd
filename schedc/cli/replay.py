"""`schedc replay SPEC TRACE.csv`: replay an availability trace through the planner and the
recovery policies (docs/replay.md); the replay itself is `schedc.replay.replay`.

Prints a header (the job, the trace, how GPUs are picked, the cost model) and
one row per policy: samples trained as a share of what the fault-free plan
trains in the same time, hours stalled, switches, seconds in transitions.
`--json` prints the same as JSON, `--plot FILE.svg` draws throughput over time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Sequence

from schedc.limits import MAX_COST_SECONDS
from schedc.recovery_cost import Costs

#: Time buckets of the plot: each policy's line is its throughput averaged over each bucket, so a
#: trace of any length gives an SVG of a few tens of KB.
PLOT_BUCKETS = 400


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from schedc.replay import POLICIES

    d = Costs()
    parser.add_argument("spec", metavar="SPEC", help="the job's spec file, or - to read standard input")
    parser.add_argument("trace", metavar="TRACE.csv",
                        help="availability trace: `seconds,available` rows, one per change (docs/replay.md)")
    parser.add_argument("--seed", type=_whole, default=0,
                        help="seed of the random picks of lost and returning GPUs, and of the planner (default 0)")
    parser.add_argument("--policy", dest="policies", action="extend", type=_names, metavar="NAME",
                        help=f"a recovery policy to replay: {', '.join(POLICIES)} (repeatable or a comma "
                             "list; default all)")
    parser.add_argument("--gpus-per-instance", type=_whole, default=1, metavar="K",
                        help="GPUs an instance of the trace holds (default 1)")
    spec_or = "default: the spec's `recovery` block, else"
    parser.add_argument("--checkpoint-every", type=_seconds, default=None, metavar="SECONDS",
                        help="checkpoint interval; a restore loses half of it on average "
                             f"({spec_or} {d.checkpoint_every_s:g})")
    parser.add_argument("--restart-cost", type=_seconds, default=None, metavar="SECONDS",
                        help=f"fixed cost of a restart from a checkpoint ({spec_or} {d.restart_s:g})")
    parser.add_argument("--reconfigure-cost", type=_seconds, default=None, metavar="SECONDS",
                        help=f"cost of every switch of plan: detect, agree, new groups ({spec_or} {d.reconfigure_s:g})")
    parser.add_argument("--horizon", type=_seconds, default=None, metavar="SECONDS",
                        help="expected time to the next event until two events give a mean gap "
                             f"({spec_or} {d.horizon_s:g})")
    parser.add_argument("--shadow", action="store_true",
                        help="model `schedc train --shadow`: every GPU of stage s+1 also holds stage s's state, "
                             "kept exact by streaming its gradient; a stage lost while a holder lives restarts from "
                             "the survivors' states without losing work (docs/replay.md)")
    parser.add_argument("--plot", metavar="FILE.svg",
                        help="draw each policy's throughput and the live GPUs over time as SVG")
    parser.add_argument("--decisions", action="store_true",
                        help="list every decision (with --json: in each policy's `decisions`)")
    parser.add_argument("--json", action="store_true", help="print machine-readable output")


def _whole(text: str) -> int | float:
    """An argparse type: a number, whole when it can be (`check_options` refuses the rest, exit 1);
    text that is no number at all is a usage error (exit 2)."""
    try:
        return int(text)
    except ValueError:
        return _seconds(text)


def _seconds(text: str) -> float:
    """An argparse type: a number (`check_options` says which are in range)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None


def check_options(args: argparse.Namespace) -> None:
    """E206 for option values out of range (a negative cost or seed, a zero horizon, nan), all
    at once, before anything is read: values, not usage (they were argparse's exit 2)."""
    from schedc.diagnostics import RunError, error

    problems = []
    for option, value, low in (("--seed", args.seed, 0), ("--gpus-per-instance", args.gpus_per_instance, 1)):
        if not (isinstance(value, int) and value >= low):
            problems.append(error("E206", f"{option} must be a whole number >= {low}, got {value:g}"))
    for option, value, strict in (("--checkpoint-every", args.checkpoint_every, False),
                                  ("--restart-cost", args.restart_cost, False),
                                  ("--reconfigure-cost", args.reconfigure_cost, False),
                                  ("--horizon", args.horizon, True)):
        if value is not None and not (math.isfinite(value) and (value > 0 if strict else value >= 0)
                                      and value <= MAX_COST_SECONDS):
            problems.append(error("E206", f"{option} must be a number of seconds {'>' if strict else '>='} 0 "
                                          f"(at most {MAX_COST_SECONDS:g}), got {value:g}"))
    if problems:
        raise RunError(problems)


def _names(text: str) -> list[str]:
    """`--policy a,b` or `--policy a`: the names, blanks dropped (checked later, E645)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a policy name, not {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    from schedc.cli.terminal import status
    from schedc.load import load_argument
    from schedc.plan import check_output_file
    from schedc.replay import POLICIES, check_policies, replay
    from schedc.trace import check_fits, read_trace

    # Every check that needs no planner first: a mistake costs no waiting.
    check_options(args)
    policies = check_policies(args.policies or POLICIES)
    if args.plot:
        check_output_file(args.plot, "--plot")
    spec, _ = load_argument(args.spec)
    trace = read_trace(args.trace)
    check_fits(trace, spec.dp * spec.pp, args.gpus_per_instance, spec.source_name)
    costs = Costs.of(spec.recovery, reconfigure_s=args.reconfigure_cost, restart_s=args.restart_cost,
                     checkpoint_every_s=args.checkpoint_every, horizon_s=args.horizon)
    with status(f"replaying {len(trace.rows):,} rows of {trace.name} under {len(policies)} policies"):
        result = replay(spec, trace, seed=args.seed, per_instance=args.gpus_per_instance, policies=policies,
                        costs=costs, shadow=args.shadow)
    if args.plot:
        write_atomically(Path(args.plot), plot_svg(result))
    if args.json:
        out = {"ok": True, **result.to_json(decisions=args.decisions)}
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
        return 0
    print(header(result, spec))
    print()
    print(table(result))
    if args.decisions:
        print()
        print(decisions(result))
    if args.plot:
        print(f"\nwrote {args.plot}")
    return 0


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:,.0f} s"


def header(result, spec) -> str:
    """What was replayed, and under which assumptions."""
    c = result.costs
    k = result.per_instance
    instances = result.gpus // k
    ignored = f"; its {len(spec.failures)} failure statement(s) ignored: the job starts with every GPU up" \
        if spec.failures else ""
    rows = [
        ("spec", f"{result.spec}: {spec.dp} x {spec.pp} = {result.gpus} GPUs, {result.global_microbatches} "
                 f"microbatches an iteration, fault-free iteration {_duration(result.fault_free_iteration_s)} "
                 f"(greedy){ignored}"),
        ("trace", f"{result.trace}: {result.duration_s / 3600:.1f} h, {result.events} event(s), "
                  f"{instances} instance(s) x {k} GPU(s)"),
        ("GPUs picked", f"uniformly at random, seed {result.seed}: a loss takes instances among the live ones, a "
                        "return brings back instances among the lost ones"
                        + (f"; instance i holds GPUs {k}i..{k}i+{k - 1}" if k > 1 else "")),
        ("horizon", result.horizon),
        ("costs", f"reconfigure {c.reconfigure_s:g} s a switch (a loss also loses the running iteration); "
                  f"restore from a checkpoint: restart {c.restart_s:g} s + {c.lost_work_s:g} s of lost work "
                  f"(checkpoint every {c.checkpoint_every_s:g} s); moved state at the link's bandwidth"),
    ]
    if result.shadow:
        extra = result.shadow_overhead_s
        on_user = ("the user's layout has no room for them (it runs without)" if extra is None else
                   f"+{_duration(extra)} an iteration on the user's layout "
                   f"({100 * extra / result.fault_free_iteration_s:.1f}%)")
        rows.append(("shadows", f"stage s's state also on stage s+1's GPUs: {on_user}; a stage lost while a "
                                f"holder lives: restart {c.restart_s:g} s + {result.checkpoint_bytes / 1e9:.2f} GB "
                                f"written and read at {c.disk_bandwidth / 1e9:g} GB/s, no work lost"))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


def table(result) -> str:
    """One row per policy."""
    head = ("policy", "samples % of fault-free", "stalled h", "switches", "transitions s")
    rows = [(name, f"{100 * p.samples_fraction:.1f}", f"{p.stalled_s / 3600:.2f}", f"{p.switches:,}",
             f"{p.transition_s:,.1f}") for name, p in result.policies.items()]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    def line(r: Sequence[str]) -> str:
        return "  ".join([r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])])
    return "\n".join([line(head), *(line(r) for r in rows)])


def decisions(result) -> str:
    """Every decision of every policy, one line each."""
    out = []
    for name, p in result.policies.items():
        out.append(f"{name}:")
        for d in p.decisions:
            o = d.chosen
            it = "stalled" if o.iteration_s is None else f"{_duration(o.iteration_s)}/iteration"
            detail = f" ({o.detail})" if o.detail else ""
            out.append(f"  {d.t / 3600:8.3f} h  {d.live:>5} live  {o.method} {it}, transition "
                       f"{o.transition_s:.1f} s{detail}: {d.reason}")
    return "\n".join(out)


# -- the plot ----------------------------------------------------------------------------------------


def bucket_means(segments: Sequence[tuple[float, float, float]], t0: float, t1: float, n: int) -> list[float]:
    """The time average of a piecewise-constant value over each of `n` equal buckets of [t0, t1]
    (0 where no segment covers the time)."""
    width = (t1 - t0) / n
    sums = [0.0] * n
    for a, b, v in segments:
        a, b = max(a, t0), min(b, t1)
        if b <= a or not v:
            continue
        i = min(int((a - t0) / width), n - 1)
        while i < n:
            lo, hi = t0 + i * width, t0 + (i + 1) * width
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                sums[i] += overlap * v
            if hi >= b:
                break
            i += 1
    return [s / width for s in sums]


def steps(values: Sequence[float], t0: float, width: float) -> list[tuple[float, float]]:
    """A step line through per-bucket values, runs of equal values merged (x in hours)."""
    points: list[tuple[float, float]] = []
    for i, v in enumerate(values):
        if points and points[-1][1] == v:
            points[-1] = ((t0 + (i + 1) * width) / 3600, v)
        else:
            points += [((t0 + i * width) / 3600, v), ((t0 + (i + 1) * width) / 3600, v)]
    return points


def plot_svg(result, buckets: int = PLOT_BUCKETS) -> str:
    """Each policy's throughput (a share of the fault-free plan's, 0 while stalled or in a
    transition) averaged per time bucket, the live GPUs' share as a step line, and a tick per event."""
    from schedc.bench.chart import COLOURS, DASHES, Chart

    t0 = result.live[0][0]
    t1 = t0 + max(result.duration_s, 1e-9)
    width = (t1 - t0) / buckets
    lines = {name: steps(bucket_means(p.segments, t0, t1, buckets), t0, width)
             for name, p in result.policies.items()}
    live = [(t, n / result.gpus) for t, n in result.live]
    changes = [(t, f) for k, (t, f) in enumerate(live) if k == 0 or f != live[k - 1][1]]
    if len(changes) <= 2 * buckets:
        live_line: list[tuple[float, float]] = []
        for t, f in changes:
            if live_line:
                live_line.append((t / 3600, live_line[-1][1]))
            live_line.append((t / 3600, f))
        live_line.append((t1 / 3600, live_line[-1][1]))
    else:  # too many changes to draw each: the live share averaged per bucket too
        spans = [(t, changes[k + 1][0] if k + 1 < len(changes) else t1, f) for k, (t, f) in enumerate(changes)]
        live_line = steps(bucket_means(spans, t0, t1, buckets), t0, width)
    events = [t / 3600 for k, (t, f) in enumerate(changes) if k > 0 or f != 1.0]
    top = max([1.0] + [v for pts in lines.values() for _, v in pts]) * 1.05  # the chart rounds it up to a tick
    notes = [f"Each policy: its throughput averaged over {_duration(width)} buckets, as a share of the fault-free "
             "plan's (0 while stalled or in a transition).",
             f"{result.gpus} GPUs; lost and returning GPUs picked uniformly at random (seed {result.seed}); "
             f"{result.events} event(s), ticked on the time axis."]
    title = f"Replay of {Path(result.trace).name} on {Path(result.spec).name}"
    chart = Chart((t0 / 3600, t1 / 3600), (0.0, top), title=title, xlabel="hours",
                  ylabel="share of fault-free throughput", width=960, height=440,
                  margins=(60, 190, 40, 50), footnotes=notes)
    n = len(lines)
    for i, (name, pts) in enumerate(lines.items()):
        # The first line widest, drawn first: where policies agree, the later ones lie on top of it.
        chart.line(pts, name, COLOURS[i % len(COLOURS)], width=1.2 + 1.2 * (n - 1 - i),
                   dash=DASHES[i % len(DASHES)], opacity=0.85)
    chart.line(live_line, "live GPUs (share)", "#555555", width=1, dash="2,2")
    chart.rug(events, "event", "#d62728")
    return chart.svg()


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed into place: never a half-written file."""
    from schedc.diagnostics import RunError, error

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise RunError([error("E558", f"cannot write --plot `{path}`: {exc.strerror or exc}")]) from None
    finally:
        tmp.unlink(missing_ok=True)
