"""Profiled against analytic stage costs: GPT models measured by `schedc profile`.

For each GPT below (a spec with a `model` block, fp32, the partition the cost
model balances), `schedc.profile` times F, B, W and the optimizer step per
stage as the runtime runs them and measures the bytes held; the table gives
the measured figures and their ratio to the cost model (docs/costmodel.md).
On a GPU the bytes come from CUDA's caching allocator, on the CPU from the
tensors kept.

    python bench/profile_models.py --device cuda -o /tmp/profile   # a GPU machine
    python bench/profile_models.py --quick                          # the CPU, small models
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schedc  # noqa: E402
from schedc.profile import NOISE_RATIO, profile  # noqa: E402

SPEC = """
model "{name}" {{
    layers = {layers}  hidden = {hidden}  heads = {heads}  seq_len = {seq}  vocab = {vocab}
    microbatch_size = {mb}  precision = fp32
    source = "schedc.models.gpt:build"
}}
cluster {{ dp = 1  pp = {pp}  gpus_per_node = 8
          gpu {{ memory = 80GiB  flops = {flops}  efficiency = {eff} }}
          link {{ latency = 10us  bandwidth = 100GB/s }} }}
train {{ microbatches = 8  optimizer = adam }}
"""
# flops: an H100 SXM's fp32 (non-tensor-core) peak, what torch's default fp32 matmuls use.
GPU_MODELS = [
    dict(name="gpt-125m-fp32", layers=12, hidden=768, heads=12, seq=1024, vocab=50304, mb=4, pp=4),
    dict(name="gpt-350m-fp32", layers=24, hidden=1024, heads=16, seq=1024, vocab=50304, mb=2, pp=4),
]
CPU_MODELS = [
    dict(name="gpt-tiny-fp32", layers=4, hidden=128, heads=4, seq=64, vocab=512, mb=2, pp=2),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="the small CPU models only")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("-o", "--out", type=Path, default=None, help="folder for profile.json")
    args = ap.parse_args(argv)
    models = CPU_MODELS if args.quick or args.device == "cpu" else GPU_MODELS
    flops, eff = ("67TFLOPS", "1.0") if args.device.startswith("cuda") else ("100GFLOPS", "1.0")
    results = []
    for m in models:
        spec = schedc.load(SPEC.format(flops=flops, eff=eff, **m), name=m["name"])
        p = profile(spec, device=args.device, repeats=args.repeats, warmup=3)
        results.append(p.to_json())
        print(f"\n## {m['name']} on {p.device_name} (pp = {m['pp']}, microbatch {m['mb']} x {m['seq']} tokens)")
        print("| stage | layers | F ms | B ms | W ms | B+W / full backward | step ms | activation MiB | stash MiB "
              "| F, B, W vs model | activation, stash vs model |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for st, r in zip(p.stages, p.ratios()):
            bw = (st.backward_input.median + st.backward_weight.median) / st.backward_full.median
            print(f"| {st.pp} | {st.layers[0]}:{st.layers[1]} | {st.forward.median / 1e3:.2f} "
                  f"| {st.backward_input.median / 1e3:.2f} | {st.backward_weight.median / 1e3:.2f} | {bw:.2f} "
                  f"| {st.optimizer_step.median / 1e3:.2f} | {st.activation / 2**20:.1f} | {st.stash / 2**20:.1f} "
                  f"| {r['forward']:.2f}, {r['backward_input']:.2f}, {r['backward_weight']:.2f} "
                  f"| {r['activation']:.2f}, {r['stash']:.3f} |")
        spread = max(max(st.forward.spread, st.backward_input.spread, st.backward_weight.spread) for st in p.stages)
        # What `schedc.profile.NOISE_RATIO` is judged against: the worst median / fastest repeat.
        ratio = max(t.median / t.low for st in p.stages for t in st.offered().values() if t.low > 0)
        print(f"(median of {args.repeats} after 3 warm-up rounds; largest spread (max-min)/median {spread:.0%}; "
              f"largest median/fastest {ratio:.2f} (noisy over {NOISE_RATIO:g}); passes "
              f"{[st.passes for st in p.stages]}; cost model at {flops} x {eff})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
