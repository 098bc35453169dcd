"""A whole stage killed: the 16-GPU job (4 pipelines x 4 stages) of specs/emulate-4x4.sched in
--emulate mode, every GPU of stage 2 killed (SIGKILL) in the same iteration, under the three ways
`schedc train` goes on:

* `repartition`: no replacement process; the 12 survivors run 4 pipelines of 3 stages, every
  process restarted from the latest checkpoint re-sharded onto the new split;
* `auto` (the default): the lost stage comes back from the latest checkpoint with 4 replacement
  processes (which a cluster that just lost those GPUs may not have);
* `restart`: every process restarts from the latest checkpoint with the GPUs replaced
  (torchelastic).

    python bench/live_stage_loss.py [--iterations N] [--repeats R]

Reports, from the kill: detection, the new plan, reconfigured, the first iteration under the new
plan; the steady period after, measured and as the simulator predicts; the GPUs the job ends on.
In --emulate mode checkpoints hold no tensors, so no checkpoint bytes are read: a real job adds
the checkpoint read (its stage's state per GPU at the disk's bandwidth) to every method.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import schedc  # noqa: E402
from live_recovery import measure  # noqa: E402

KILL = [f"at iteration 5 during B: fail gpu(dp={d}, pp=2)" for d in range(4)]
METHODS = ("repartition", "auto", "restart")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="schedc-stage-loss-"))
    try:
        out = work / "out"
        schedc.compile(ROOT / "specs" / "emulate-4x4.sched").write(out)
        print("| method | detected s | planned s | reconfigured s | first iteration s | period after s "
              "(predicted) | period before s | GPUs after | iterations |")
        print("|---|---|---|---|---|---|---|---|---|")
        for method in METHODS:
            rows = [measure(out, method, KILL, args.iterations) for _ in range(args.repeats)]

            def med(key):
                vals = [r[key] for r in rows if r.get(key) is not None]
                return statistics.median(vals) if vals else float("nan")
            gpus = rows[0]["gpus_after"] if "gpus_after" in rows[0] else "-"
            print(f"| {method} | {med('detect_s'):.2f} | {med('plan_s'):.2f} | {med('reconfigure_s'):.2f} | "
                  f"{med('first_iteration_s'):.2f} | {med('after_s'):.3f} ({med('predicted_after_s'):.3f}) | "
                  f"{med('before_s'):.3f} | {gpus} | {rows[0]['iterations']}"
                  f"{'' if all(r['all_iterations'] and r['ok'] for r in rows) else ' (NOT all done)'} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
