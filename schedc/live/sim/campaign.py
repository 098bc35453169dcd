"""A campaign of simulated runs: ``python -m schedc.live.sim --schedules N [--first S] [--jobs J]``.

Runs seeds S..S+N-1 (`schedc.live.sim.run.simulate`) on J processes,
prints every run that broke an invariant with the seed that replays it
(``--first SEED --schedules 1 -v`` prints that run's whole story), and a
tally of outcomes. Exit status 1 if any run broke an invariant.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def run_seeds(first: int, count: int, verbose: bool = False) -> list[tuple[int, str, list[str], str]]:
    """(seed, outcome, violations, story) of seeds first..first+count-1; the story is empty
    for a clean run unless `verbose`."""
    from schedc.live.sim.run import simulate

    out = []
    for seed in range(first, first + count):
        o = simulate(seed)
        result = o.result + (f" {o.code}" if o.code else "")
        out.append((seed, result, o.violations, o.describe() if (o.violations or verbose) else ""))
    return out


def campaign(first: int, count: int, jobs: int = 1, verbose: bool = False):
    """Every seed's (seed, outcome, violations, story), in seed order, run on `jobs` processes."""
    if jobs <= 1:
        return run_seeds(first, count, verbose)
    size = max(1, min(50, -(-count // (jobs * 4))))
    chunks = [(s, min(size, first + count - s)) for s in range(first, first + count, size)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = pool.map(run_seeds, [c[0] for c in chunks], [c[1] for c in chunks], [verbose] * len(chunks))
        return [row for part in parts for row in part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schedc.live.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=200, help="how many seeds to run (default 200)")
    parser.add_argument("--first", "--seed", type=int, default=0, dest="first", help="the first seed (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="processes to run them on (default 1)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run's story, not only failures")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = campaign(args.first, args.schedules, args.jobs, args.verbose)
    tally = collections.Counter(result for _, result, _, _ in rows)
    bad = [seed for seed, _, violations, _ in rows if violations]
    for _, _, _, story in rows:
        if story:
            print(story, flush=True)
    wall = time.perf_counter() - started
    print(f"{args.schedules} schedules (seeds {args.first}..{args.first + args.schedules - 1}) in {wall:.1f} s: "
          + ", ".join(f"{n} {what}" for what, n in sorted(tally.items()))
          + f"; {len(bad)} with violations" + (f" (seeds {bad[:20]})" if bad else ""))
    return 1 if bad else 0
