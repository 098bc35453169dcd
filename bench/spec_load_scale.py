"""Time `schedc.load` (and rendering its diagnostics) on large and long-lined inputs.

The cases the fuzzer found slow: a long pipeline with a failed GPU (E301), every replica of a
stage failed by its own `fail` line on one long line (E301 with a note per line), a bad value
in each of thousands of `stage N { }` blocks on one line (E206 per block). Each size is run
`--repeat` times and the best process CPU time is printed (CPU time: another job on the machine
does not inflate it). tests/test_spec_growth.py checks the work is linear without timing it.

    python bench/spec_load_scale.py [--sizes 1000,10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import sys

STAGES = ("stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 1ms\n"
          "  activation = 1MiB  stash = 1MiB  static = 1MiB  send = 1KiB } %s }\n")
CASES = {
    "dp=1 pp=N, one GPU failed": lambda n: (
        f"cluster {{ dp = 1  pp = {n}  gpus_per_node = 8  gpu {{ memory = 80GiB }} }}\n" + STAGES % ""
        + "train { microbatches = 4 }\nfailures { fail gpu(dp=0, pp=5) }\n"),
    "dp=N pp=1, N fail lines, one line": lambda n: (
        f"cluster {{ dp = {n}  pp = 1  gpus_per_node = 8  gpu {{ memory = 80GiB }} }}\n" + STAGES % ""
        + "train { microbatches = 4 }\nfailures { " + " ".join(f"fail gpu(dp={d}, pp=0)" for d in range(n))
        + " }\n"),
    "pp=N, a bad value per stage block": lambda n: (
        f"cluster {{ dp = 1  pp = {n}  gpus_per_node = 8  gpu {{ memory = 80GiB }} }}\n"
        + STAGES % " ".join(f"stage {s} {{ forward = 0ms }}" for s in range(n)) + "train { microbatches = 4 }\n"),
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    import schedc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000", help="values of N, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'case':36s} " + " ".join(f"{'N=' + str(n):>16s}" for n in sizes))
    for name, make in CASES.items():
        cells = []
        for n in sizes:
            text, best, outcome = make(n), float("inf"), ""
            for _ in range(args.repeat):
                t0 = _cpu()
                try:
                    schedc.load(text)
                    outcome = "ok"
                except schedc.SchedcError as exc:
                    str(exc)  # the rendering, as shown
                    outcome = exc.codes[0]
                best = min(best, _cpu() - t0)
            cells.append(f"{best:9.3f} s {outcome:>4s}")
        print(f"{name:36s} " + " ".join(f"{c:>16s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
