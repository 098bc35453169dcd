"""Live recovery on GPUs against the CPU, for the same job: a GPT trained through a killed rank.

The job: the GPT of `schedc.models.gpt` from a spec's `model` block (4 layers, hidden 256,
sequence 128, Adam), 2 pipelines x 2 stages, its stage costs measured by `schedc profile
--device D --write` (the plan is made from what the device really takes). For each device:

* `inject` (the figures): `schedc train --device D` with a SIGKILL injected at a fixed
  moment (iteration 3, during a backward of pipeline 1's first stage), so both devices lose
  the same work; reports the steady iteration time before the fault and the milestones from
  the kill (detected, new plan, every survivor reconfigured, first iteration done), and the
  largest weight difference from single-process training on that device.
* `outside` (the evidence that a kill nobody announced is survived): `schedc train` as a
  command, one of its worker processes SIGKILLed from outside once iteration 2 is printed;
  the run must end with every iteration and the weights of single-process training.

    python bench/live_gpu.py [--device cuda] [--json FILE] [--iterations N]

On a machine without a GPU it runs the CPU rows only. Every worker of a GPU run shares the
machine's GPUs (rank i on GPU i mod the GPU count), over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPEC = """
model "gpt-small" {
    layers = 4  hidden = 256  heads = 4  seq_len = 128  vocab = 512
    microbatch_size = 4  precision = fp32
    source = "schedc.models.gpt:build"
}
cluster { dp = 2  pp = 2  gpus_per_node = 2
          gpu { memory = 80GiB  flops = 60TFLOPS  efficiency = 0.5 }
          link { latency = 10us  bandwidth = 10GB/s } }
train { microbatches = 4  optimizer = adam  lr = 0.001 }
schedule { solver = greedy }
"""
INJECT = "at iteration 3 during B 1: fail gpu(dp=1, pp=0)"


def _schedc(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "schedc", *args], capture_output=True, text=True, env=env,
                          check=True, **kw)


def prepare(root: Path, device: str) -> Path:
    """The spec with the device's measured stage costs, compiled: OUT."""
    spec = root / f"gpt-{device.replace(':', '')}.sched"
    spec.write_text(SPEC)
    _schedc("profile", str(spec), "--device", device, "--repeats", "5", "--write")
    out = root / f"out-{device.replace(':', '')}"
    _schedc("compile", str(spec), "-o", str(out))
    return out


def _max_diff(state: dict, out: Path, iterations: int, device: str) -> float:
    from schedc.runtime import load_manifest, reference_train

    ref, _ = reference_train(load_manifest(out), iterations, device=device)
    return max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)


def injected(out: Path, device: str, iterations: int) -> dict:
    """A run with the kill injected at a fixed moment: steady period and recovery milestones."""
    from schedc.live import train

    result = train(out, iterations=iterations, inject=[INJECT], want_weights=True, device=device)
    (rec,) = result.recoveries
    before = [r.end - r.start for r in result.iterations if r.iteration < 3 and r.iteration >= 1]
    d = rec.durations()
    return {"device": device, "mode": "inject", "iterations": len(result.iterations),
            "iteration_s": round(sorted(before)[len(before) // 2], 4),
            "detect_s": d["detect"], "plan_s": d["plan"], "reconfigure_s": d["reconfigure"],
            "first_iteration_s": d["first_iteration"], "undone": rec.undone,
            "max_weight_diff": _max_diff(result.state_dict, out, iterations, device)}


def _workers(root_pid: int) -> list[int]:
    """Worker processes under `root_pid`: the forkserver's children (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    servers = [p for p, pp in parent.items() if pp == root_pid]
    return sorted(p for p, pp in parent.items() if pp in servers)


def outside(out: Path, device: str, iterations: int, root: Path, timeout: float = 240.0) -> dict:
    """`schedc train` as a command; one worker SIGKILLed from outside after iteration 2."""
    import torch

    log, weights = root / f"log-{device.replace(':', '')}.json", root / f"w-{device.replace(':', '')}.pt"
    stdout = root / f"stdout-{device.replace(':', '')}.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with stdout.open("w") as o:
        proc = subprocess.Popen([sys.executable, "-m", "schedc", "train", str(out), "--device", device,
                                 "--iterations", str(iterations), "--log", str(log), "--save-weights", str(weights)],
                                stdout=o, stderr=subprocess.STDOUT, text=True, env=env)
    victim = None
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if victim is None and "iteration    2" in stdout.read_text():
                workers = _workers(proc.pid)
                if workers:
                    victim = workers[len(workers) // 2]
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = stdout.read_text()
    row = {"device": device, "mode": "outside", "rc": proc.returncode, "killed_pid": victim}
    if proc.returncode != 0 or victim is None:
        row["output_tail"] = text[-2000:]
        return row
    result = json.loads(log.read_text())
    (rec,) = result["recoveries"]
    row.update(iterations=len(result["iterations"]), failed_ranks=rec["failed"], causes=rec["causes"],
               since_detection_s=rec["durations_s"],
               max_weight_diff=_max_diff(torch.load(weights, weights_only=True), out, iterations, device))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", default=None,
                        help="devices to compare (default: cpu, and cuda where there is one)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    import torch

    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="schedc-live-gpu-") as tmp:
        root = Path(tmp)
        for device in devices:
            out = prepare(root, device)
            for run in (lambda: injected(out, device, args.iterations),
                        lambda: outside(out, device, args.iterations, root)):
                row = run()
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'device':8} {'iteration s':>11} {'detected':>9} {'planned':>8} {'reconfig.':>9} "
          f"{'1st iter.':>9} {'max diff':>9}   (seconds after the injected kill)")
    for r in rows:
        if r["mode"] == "inject":
            print(f"{r['device']:8} {r['iteration_s']:11.3f} {r['detect_s']:9.3f} {r['plan_s']:8.3f} "
                  f"{r['reconfigure_s']:9.3f} {r['first_iteration_s']:9.3f} {r['max_weight_diff']:9.2e}")
    for r in rows:
        if r["mode"] == "outside":
            ok = r["rc"] == 0 and r.get("iterations") == args.iterations
            print(f"{r['device']}: worker pid {r['killed_pid']} SIGKILLed from outside: "
                  + (f"run finished, {r['iterations']} iterations, rank(s) {r['failed_ranks']} lost "
                     f"({'; '.join(r['causes'].values())}), max weight diff {r['max_weight_diff']:.2e}"
                     if ok else f"FAILED (rc {r['rc']})"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r.get("rc", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
