"""Speed of the verifier on valid schedules (the path every compile and replan takes).

Instances from `make_instance` with one failed and one slow GPU, scheduled by
`greedy`; each size is verified `--repeat` times and the best wall time is
reported, for `check_schedule` (what schedc runs) and, with `--reference`,
for the rule-by-rule checker that builds the diagnostics (the verifier before
the fast path; it still runs whenever a schedule is rejected).

    python bench/verify_speed.py [--repeat 5] [--reference] [--sizes 2x4x8,8x8x32]

Sizes are DPxPPxM; a trailing ``c`` (``8x8x512c``) turns decoupling off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_SIZES = "2x4x8,8x8x32,16x8x64,8x8x512c,8x8x512"


def build(size: str):
    """A greedy schedule for `size` (one failed GPU, one slow GPU)."""
    from schedc.instance import make_instance
    from schedc.solvers import SolveOptions, get_solver

    coupled = size.endswith("c")
    dp, pp, m = (int(x) for x in size.rstrip("c").split("x"))
    inst = make_instance(dp, pp, m, forward=1000, backward_input=1000, backward_weight=800,
                         optimizer=300, send=1 << 20, latency=10, decouple_backward=not coupled,
                         failed=[(dp - 1, pp // 2)], slow={(0, pp - 1): 0.7})
    return get_solver("greedy")(inst, SolveOptions(time_limit=60.0))


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(sizes: list[str], repeat: int, reference: bool) -> list[dict]:
    from schedc import verify

    rows = []
    for size in sizes:
        sched = build(size)
        assert verify.check_schedule(sched) == [], f"greedy produced an invalid schedule for {size}"
        row = {"size": size, "ops": len(sched.ops),
               "check_s": round(best_of(lambda: verify.check_schedule(sched), repeat), 5)}
        if reference:
            row["diagnose_s"] = round(best_of(lambda: verify.diagnose(sched), repeat), 5)
            row["speedup"] = round(row["diagnose_s"] / row["check_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--reference", action="store_true",
                        help="also time the rule-by-rule checker that builds diagnostics")
    args = parser.parse_args(argv)
    measure(args.sizes.split(","), args.repeat, args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
