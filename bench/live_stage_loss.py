"""A whole stage killed: the 16-GPU job (4 pipelines x 4 stages) of specs/emulate-4x4.sched in
--emulate mode, every GPU of stage 2 killed (SIGKILL) in iteration 8 (3 iterations after the
checkpoint of iteration 5), under the ways `schedc train` goes on:

* `repartition`: no replacement process; the 12 survivors are laid out anew (the layout the
  cost model prices cheapest: `RecoveryPolicy.laid_out`), in their own processes, from the
  latest checkpoint re-sharded onto the new split;
* `auto` (the default): the lost stage comes back from the latest checkpoint with 4 replacement
  processes (which a cluster that just lost those GPUs may not have);
* `restart`: every process restarts from the latest checkpoint with the GPUs replaced
  (torchelastic);
* `repartition --shadow`: as `repartition`, but every GPU of stage 3 holds stage 2's shadow
  (`schedc.live.shadow`): the survivors keep their processes and move the layers among
  themselves in place (`schedc.live.relayout`), so nothing restarts and no iteration since the
  last checkpoint is trained again.

    python bench/live_stage_loss.py [--iterations N] [--repeats R] [--real-only]

In --emulate mode no tensor moves. A second table runs real compute on the CPU (gloo): a GPT of
`schedc.models.gpt` (6 layers, hidden 256, Adam) as 2 pipelines x 3 stages, both GPUs of stage 1
killed in iteration 4, and reports the bytes moved in place against the restarts, with the
largest weight difference from single-process training.

Then the grow-back: `repartition` again, and the four GPUs asked back at iteration GROW_AT
(`recover gpu(...)`, named as the job started): reported, from the grow-back's start (the next
complete checkpoint once all are back), the reconfiguration and the first iteration on 16 GPUs,
the iterations run again, and the period after against the simulator's.

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

KILL = [f"at iteration 8 during B: fail gpu(dp={d}, pp=2)" for d in range(4)]
METHODS = (("repartition", "repartition", {}), ("auto", "auto", {}), ("restart", "restart", {}),
           ("repartition --shadow", "repartition", {"shadow": True}))
GROW_AT = 12
BACK = [f"at iteration {GROW_AT}: recover gpu(dp={d}, pp=2)" for d in range(4)]


def grow_back(out: Path, iterations: int) -> dict:
    """The job re-partitioned after the kill, then grown back once the four GPUs are asked back."""
    from live_recovery import CHECKPOINT_EVERY, DETECT_TIMEOUT, periods
    from schedc.live import train

    ckpt = out.parent / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    result = train(out, iterations=iterations, emulate=True, inject=KILL + BACK, recovery="repartition",
                   checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=str(ckpt), detect_timeout=DETECT_TIMEOUT)
    grown = [r for r in result.recoveries if r.method == "grow-back"]
    if not grown:
        return {"ok": False, "iterations": len(result.iterations)}
    rec, last = grown[-1], result.generations[-1]
    return {"ok": result.ok, "iterations": len(result.iterations), "gpus_after": len(last.members),
            "reconfigure_s": rec.t_ready - rec.t_detect, "first_iteration_s": rec.t_first - rec.t_detect,
            "redone": sum(r.runs - 1 for r in result.iterations if r.generation == last.number),
            "after_s": statistics.median(periods(result, last.number, skip_first=True)),
            "predicted_after_s": last.predicted_iteration_time_us / 1e6}


REAL_SPEC = """
model "gpt-small" {
    layers = 6  hidden = 256  heads = 4  seq_len = 64  vocab = 512
    microbatch_size = 2  precision = fp32
    source = "schedc.models.gpt:build"
}
cluster { dp = 2  pp = 3  gpus_per_node = 3
          gpu { memory = 80GiB  flops = 60TFLOPS  efficiency = 0.5 }
          link { latency = 10us  bandwidth = 10GB/s } }
train { microbatches = 3  optimizer = adam  lr = 0.001 }
schedule { solver = greedy }
"""
REAL_KILL = [f"at iteration 4 during B: fail gpu(dp={d}, pp=1)" for d in range(2)]
REAL_METHODS = (("repartition --shadow (in place)", "repartition", {"shadow": True}),
                ("repartition (restore in place, checkpoint every 2)", "repartition", {"checkpoint_every": 2}),
                ("auto --shadow (dump, replacements)", "auto", {"shadow": True}))


def real(work: Path, iterations: int) -> None:
    """The real-compute table (see the module docstring)."""
    from schedc.live import train
    from schedc.runtime import load_manifest, reference_train

    out = work / "real"
    schedc.compile(REAL_SPEC).write(out)
    ref, _ = reference_train(load_manifest(out), iterations)
    print("| method (real compute, 2 x 3 GPT) | first iteration s | moved in place (all / most to one rank) "
          "| iterations run again | GPUs after | max weight diff |")
    print("|---|---|---|---|---|---|")
    for label, method, options in REAL_METHODS:
        ckpt = work / "real-ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        result = train(out, iterations=iterations, inject=REAL_KILL, recovery=method, want_weights=True,
                       checkpoint_dir=str(ckpt), **options)
        rec = result.recoveries[-1]
        t0 = result.recoveries[0].t_fault
        diff = max(float((result.state_dict[k] - ref[k]).abs().max()) for k in ref)
        moved = (f"{rec.moved_bytes / 2**20:.2f} / {rec.moved_max_bytes / 2**20:.2f} MiB" if rec.moved_bytes
                 else "-")
        print(f"| {label} | {rec.t_first - t0:.2f} | {moved} | {sum(r.runs - 1 for r in result.iterations)} "
              f"| {len(result.generations[-1].members)} | {diff:.1e} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--real-only", action="store_true", help="only the real-compute table")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="schedc-stage-loss-"))
    try:
        if args.real_only:
            real(work, 8)
            return 0
        out = work / "out"
        schedc.compile(ROOT / "specs" / "emulate-4x4.sched").write(out)
        print("| method | detected s | planned s | reconfigured s | first iteration s | period after s "
              "(predicted) | period before s | GPUs after | iterations | run again |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for label, method, options in METHODS:
            rows = [measure(out, method, KILL, args.iterations, **options) for _ in range(args.repeats)]

            def med(key):
                vals = [r[key] for r in rows if r.get(key) is not None]
                return statistics.median(vals) if vals else float("nan")
            gpus = rows[0]["gpus_after"] if "gpus_after" in rows[0] else "-"
            print(f"| {label} | {med('detect_s'):.2f} | {med('plan_s'):.2f} | {med('reconfigure_s'):.2f} | "
                  f"{med('first_iteration_s'):.2f} | {med('after_s'):.3f} ({med('predicted_after_s'):.3f}) | "
                  f"{med('before_s'):.3f} | {gpus} | {rows[0]['iterations']}"
                  f"{'' if all(r['all_iterations'] and r['ok'] for r in rows) else ' (NOT all done)'} | "
                  f"{med('redone'):g} |")
        g = [grow_back(out, args.iterations + 8) for _ in range(args.repeats)]
        ok = [r for r in g if r.get("ok")]
        print()
        print("| grow back | reconfigured s | first iteration s | iterations run again | period after s (predicted) "
              "| GPUs after |")
        print("|---|---|---|---|---|---|")
        if ok:
            med = lambda key: statistics.median(r[key] for r in ok)  # noqa: E731
            print(f"| 4 GPUs back at iteration {GROW_AT} | {med('reconfigure_s'):.2f} | {med('first_iteration_s'):.2f} | "
                  f"{med('redone'):g} | {med('after_s'):.3f} ({med('predicted_after_s'):.3f}) | {ok[0]['gpus_after']} |")
        else:
            print(f"| 4 GPUs back at iteration {GROW_AT} | did not grow back | | | | |")
        print()
        real(work, 8)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
