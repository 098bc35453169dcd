"""The replay table: the shared spot trace through every recovery policy, on the two GPT-350M jobs.

    python bench/replay_trace.py                       # seeds 0-3, both jobs, a markdown table
    python bench/replay_trace.py --seeds 0 --json out.json
    python bench/replay_trace.py --shadow                # with stage s's state shadowed on stage s + 1

Each cell is the mean over the seeds (and the range): samples trained as % of
what the user's fault-free plan trains in the same 88.7 h, hours stalled (no
plan could run), switches, and hours spent in transitions. The targets of the
re-partitioning work: `auto` at >= 99% on dp 2 x pp 8 and >= 97% on dp 4 x
pp 4, stalled only while the live GPUs cannot hold the model. With
`--shadow` (the model of `schedc train --shadow`, docs/replay.md) the header
of each job says what shadows add to its iteration, and two more columns
count the restarts from the checkpoint and from the survivors' shadows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedc.load import load  # noqa: E402
from schedc.recovery_cost import Costs  # noqa: E402
from schedc.replay import POLICIES, replay  # noqa: E402
from schedc.trace import read_trace  # noqa: E402

JOBS = ("specs/gpt-350m-2x8.sched", "specs/gpt-350m-4x4.sched")
TRACE = "bench/traces/aws-p2-xlarge-16.csv"


def _cell(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1 or max(values) - min(values) < 1e-9:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--jobs", nargs="+", default=list(JOBS))
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--checkpoint-every", type=float, default=Costs().checkpoint_every_s, metavar="S",
                    help="seconds between checkpoints (a restore loses half of it; default %(default)g)")
    ap.add_argument("--shadow", action="store_true",
                    help="model shadows: stage s's state also on stage s + 1's GPUs (docs/replay.md)")
    ap.add_argument("--json", metavar="FILE", help="also write every replay's JSON here")
    args = ap.parse_args(argv)
    trace = read_trace(ROOT / args.trace)
    everything = []
    print(f"trace {args.trace}: {trace.duration_s / 3600:.1f} h, {len(trace.rows)} rows; seeds {args.seeds}; "
          f"checkpoint every {args.checkpoint_every:g} s; shadows {'on' if args.shadow else 'off'}\n")
    for job in args.jobs:
        spec = load(ROOT / job)
        runs = []
        for seed in args.seeds:
            started = time.perf_counter()
            r = replay(spec, trace, seed=seed, costs=Costs(checkpoint_every_s=args.checkpoint_every),
                       shadow=args.shadow)
            runs.append((r, time.perf_counter() - started))
            everything.append(r.to_json())
        wall = [w for _, w in runs]
        first = runs[0][0]
        shadow = ""
        if args.shadow:
            extra = first.shadow_overhead_s
            shadow = ("; shadows do not fit its GPUs" if extra is None else
                      f"; shadows add {extra * 1e3:.2f} ms ({100 * extra / first.fault_free_iteration_s:.1f}%), "
                      f"a local restore writes and reads {first.checkpoint_bytes / 1e9:.2f} GB")
        print(f"### {job} (dp {spec.dp} x pp {spec.pp}, {spec.dp * spec.microbatches} microbatches per iteration; "
              f"fault-free {first.fault_free_iteration_s * 1e3:.1f} ms{shadow}; {first.events} events; "
              f"replay {min(wall):.1f}-{max(wall):.1f} s each)\n")
        restarts = " checkpoint restarts | local restores | moved in place |" if args.shadow else ""
        print("| policy | samples % of fault-free | stalled h | switches | transitions h |" + restarts)
        print("|---|---|---|---|---|" + ("---|---|---|" if args.shadow else ""))
        for name in POLICIES:
            ps = [r.policies[name] for r, _ in runs]
            counts = (f" {_cell([p.checkpoint_restarts for p in ps], '.1f')} | "
                      f"{_cell([p.local_restores for p in ps], '.1f')} | "
                      f"{_cell([p.in_place_moves for p in ps], '.1f')} |") if args.shadow else ""
            print(f"| {name} | {_cell([100 * p.samples_fraction for p in ps], '.2f')} | "
                  f"{_cell([p.stalled_s / 3600 for p in ps], '.2f')} | {_cell([p.switches for p in ps], '.0f')} | "
                  f"{_cell([p.transition_s / 3600 for p in ps], '.2f')} |" + counts)
        print()
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
