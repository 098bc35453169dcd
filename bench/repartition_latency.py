"""How long planning a re-partition takes (`schedc.repartition.repartition`), per cluster size.

    python bench/repartition_latency.py              # 16 and 64 GPUs at 0.1 s, 16,384 GPUs at 1 s
    python bench/repartition_latency.py --states 20

For each job, `--states` random states (a seeded share of the GPUs lost, up to a quarter) are
re-partitioned one after another in one process, as a launcher would on successive events (the
first call also pays the imports and the per-model slice table: it is reported apart). Prints
p50 / p95 / max wall seconds, the deadline, and which solver planned the chosen layout.
Targets: within the replan deadlines, 0.1 s at 64 GPUs and 1 s at 16,384.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedc.load import load_text  # noqa: E402
from schedc.repartition import repartition  # noqa: E402

GPT = ('model "gpt" {{ layers = {layers}  hidden = {hidden}  heads = {heads}  seq_len = 2048  vocab = 50304 }}\n'
       'cluster {{ dp = {dp}  pp = {pp}  gpus_per_node = 8\n'
       '          gpu {{ memory = 80GiB  flops = 312TFLOPS  efficiency = 0.45 }}\n'
       '          link {{ latency = 20us  bandwidth = 25GB/s }} }}\n'
       'train {{ microbatches = {mb} }}\n')
JOBS = {  # name: (spec text, deadline s)
    "16 GPUs (GPT-350M, 2 x 8)": (GPT.format(layers=24, hidden=1024, heads=16, dp=2, pp=8, mb=16), 0.1),
    "64 GPUs (GPT-1.3B, 8 x 8)": (GPT.format(layers=24, hidden=2048, heads=16, dp=8, pp=8, mb=16), 0.1),
    "16,384 GPUs (GPT-13B-like, 512 x 32)": (GPT.format(layers=64, hidden=4096, heads=32, dp=512, pp=32, mb=8), 1.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print("| job | deadline s | first call s | p50 s | p95 s | max s | layouts chosen (solver) |")
    print("|---|---|---|---|---|---|---|")
    for name, (text, deadline) in JOBS.items():
        spec = load_text(text, name=name)
        n = spec.dp * spec.pp
        rng = random.Random(args.seed)
        walls, chosen, first = [], {}, None
        for i in range(args.states + 1):
            lost = set(rng.sample(range(n), rng.randint(1, max(1, n // 4))))
            live = [r for r in range(n) if r not in lost]
            started = time.perf_counter()
            r = repartition(spec, live, deadline=deadline)
            wall = time.perf_counter() - started
            if i == 0:
                first = wall
                continue
            walls.append(wall)
            key = f"{r.layout.dp}x{r.layout.pp} ({r.plan.schedule.solver.name})"
            chosen[key] = chosen.get(key, 0) + 1
        walls.sort()
        p95 = walls[min(len(walls) - 1, int(round(0.95 * (len(walls) - 1))))]
        print(f"| {name} | {deadline} | {first:.3f} | {statistics.median(walls):.3f} | {p95:.3f} | {walls[-1]:.3f} | "
              + ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items())) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
