"""What `schedc train --shadow` costs while nothing fails: the iteration period with and without.

The job is bench/live_gpu.py's GPT (4 layers, hidden 256, sequence 128, Adam, 2 pipelines x 2
stages, stage costs from `schedc profile --device D --write`), trained for N iterations with and
without shadows, alternating, R times each. Reported: the median period (the gap between
iteration ends, the first SKIP iterations left out) of each run, the median over runs, and the
difference; plus the bytes each holder receives per iteration (its shadowed stage's gradient).

    python bench/live_shadow_cost.py [--device cuda] [--iterations N] [--repeats R] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

SKIP = 3  # the first iterations (allocations, first-use set-up) are not the steady period


def period(out: Path, device: str, iterations: int, shadow: bool) -> float:
    from schedc.live import train

    result = train(out, iterations=iterations, device=device, shadow=shadow, fail_slow="off")
    ends = sorted(r.end for r in result.iterations)[SKIP:]
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def gradient_bytes(out: Path) -> dict[int, int]:
    """Stage -> the bytes of its summed gradient (what each of its holders receives per iteration)."""
    from schedc.runtime import load_manifest
    from schedc.runtime.manifest import build_model

    manifest = load_manifest(out)
    layers, _, partition = build_model(manifest)
    sizes = {}
    for s, (a, b) in enumerate(partition):
        sizes[s] = sum(p.numel() * p.element_size() for layer in layers[a:b] for p in layer.parameters()
                       if p.requires_grad)
    return sizes


def main(argv: list[str] | None = None) -> int:
    from live_gpu import prepare

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="schedc-shadow-cost-"))
    out = prepare(root, args.device)
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for shadow in (False, True):
            runs[shadow].append(period(out, args.device, args.iterations, shadow))
    without, with_ = statistics.median(runs[False]), statistics.median(runs[True])
    grads = gradient_bytes(out)
    row = {"device": args.device, "iterations": args.iterations, "repeats": args.repeats,
           "period_s": {"without": runs[False], "with": runs[True]},
           "median_without_s": without, "median_with_s": with_, "overhead": with_ / without - 1,
           "gradient_bytes_per_stage": grads}
    print(f"{args.device}: period without shadows {without * 1e3:.2f} ms (runs "
          f"{', '.join(f'{p * 1e3:.2f}' for p in runs[False])}), with {with_ * 1e3:.2f} ms (runs "
          f"{', '.join(f'{p * 1e3:.2f}' for p in runs[True])}): {row['overhead'] * 100:+.1f}%; "
          f"gradient streamed per holder per iteration: "
          + ", ".join(f"stage {s} {b / 1e6:.2f} MB" for s, b in grads.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
