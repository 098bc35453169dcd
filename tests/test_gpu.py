"""The CUDA paths on a real GPU: skipped where torch sees none (CI has none; see docs/runtime.md).

- `schedc profile --device cuda`: bytes from CUDA's caching allocator; the GPT's stash (what a
  rank holds from B to W) is the cost model's 16sbh*e per layer.
- `schedc run --device cuda`: every rank computes on a GPU. With fewer GPUs than ranks the
  ranks share them and talk over gloo through the CPU; with one GPU per rank, NCCL (one rank
  here unless the machine has more GPUs). Weights match single-process CPU training.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import schedc
from schedc.codegen import write_programs
from schedc.profile import profile
from schedc.runtime import launch, load_manifest, reference_train
from schedc.schedule_io import read_schedule
from test_runtime_support import max_weight_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parent.parent
GPT = """
model "gpt-small" {{
    layers = 4  hidden = 256  heads = 4  seq_len = 128  vocab = 512
    microbatch_size = 4  precision = fp32
    source = "schedc.models.gpt:build"
}}
cluster {{ dp = {dp}  pp = {pp}  gpus_per_node = 8
          gpu {{ memory = 80GiB  flops = 60TFLOPS  efficiency = 0.5 }}
          link {{ latency = 10us  bandwidth = 100GB/s }} }}
train {{ microbatches = 4  optimizer = sgd  lr = 0.05 }}
{failures}
schedule {{ solver = greedy }}
"""


def _gpt(dp=2, pp=2, failures=""):
    return schedc.load(GPT.format(dp=dp, pp=pp, failures=failures))


def test_profile_on_cuda_measures_the_planned_stash():
    spec = _gpt()
    p = profile(spec, device="cuda", repeats=5, warmup=2)
    assert p.memory_from == "the CUDA caching allocator"
    for st, model in zip(p.stages, p.analytic):
        assert st.forward.median > 0 and st.backward_input.median > 0 and st.backward_weight.median > 0
        # The allocator's figure, against the cost model's 16sbh*e per layer (what the W entries
        # hold, exactly, counted on the CPU): within 10% (measured: +0 to +2 sbh of a stage).
        assert st.stash == pytest.approx(model.stash, rel=0.10), f"stage {st.pp}"
        assert st.stash <= st.activation


def _run_and_compare(out: Path, **kw) -> float:
    result = launch(out, iterations=2, want_weights=True, timeout=60, **kw)
    ref, ref_losses = reference_train(load_manifest(out), 2)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    return max_weight_diff(result.state_dict, ref)


@pytest.mark.parametrize("failures", ["", "failures { fail gpu(dp=1, pp=0) }"])
def test_ranks_on_a_gpu_train_exactly(tmp_path, failures):
    spec = _gpt(failures=failures)
    write_programs(spec, schedc.compile(spec).schedule, tmp_path)
    assert _run_and_compare(tmp_path, device="cuda", backend="gloo") <= 1e-5


def test_one_rank_over_nccl_trains_exactly(tmp_path):
    from schedc.schedule_io import write_schedule

    spec = _gpt(dp=1, pp=1)
    schedule = schedc.compile(spec).schedule
    write_programs(spec, schedule, tmp_path)
    write_schedule(tmp_path / "schedule.json", schedule)  # NCCL orders messages by it
    assert _run_and_compare(tmp_path, device="cuda", backend="nccl") <= 1e-5


def test_nccl_across_gpus_with_a_receiver_that_wants_another_order(tmp_path):
    """The 3 x 3 cpsat schedule of specs/slow-gpu.sched, where one receiver wants microbatch 5
    before 3 from a sender that sends 3 first; needs a GPU per rank (9)."""
    if torch.cuda.device_count() < 9:
        pytest.skip(f"needs 9 GPUs for NCCL across ranks, this machine has {torch.cuda.device_count()}")
    data = Path(__file__).parent / "data" / "reordered_3x3.schedule.json"
    spec = schedc.load(ROOT / "specs" / "slow-gpu.sched")
    schedule, _ = read_schedule(data)
    write_programs(spec, schedule, tmp_path)
    shutil.copy(data, tmp_path / "schedule.json")
    assert _run_and_compare(tmp_path, device="cuda", backend="nccl") <= 1e-5


# -- `schedc train --device cuda`: live recovery with the ranks on a GPU --------------------------

LIVE_GPT = GPT.replace("optimizer = sgd  lr = 0.05", "optimizer = adam  lr = 0.001")


@pytest.mark.parametrize("inject, checkpoint_every", [
    # A rank killed in its backward: its pipeline's work is re-routed to the survivors.
    (["at iteration 2 during B 1: fail gpu(dp=1, pp=0)"], 0),
    # Stage 0 runs the last W of an iteration after later stages stepped: a survivor of stage 1
    # that stepped goes back to its copy in pinned host memory (`schedc.live.rollback`).
    (["at iteration 2 during W 3: fail gpu(dp=0, pp=0)"], 0),
    # Both GPUs of stage 1: the run restarts from the latest checkpoint, written from the GPU.
    (["at iteration 3 during F: fail gpu(dp=0, pp=1)", "at iteration 3 during F: fail gpu(dp=1, pp=1)"], 1),
])
def test_live_training_on_a_gpu_survives_killed_ranks_exactly(tmp_path, inject, checkpoint_every):
    from schedc.live import train

    iterations = 5
    out = tmp_path / "out"
    schedc.compile(schedc.load(LIVE_GPT.format(dp=2, pp=2, failures=""))).write(out)
    result = train(out, iterations=iterations, inject=inject, want_weights=True, device="cuda",
                   checkpoint_every=checkpoint_every, max_restarts=1)
    assert result.recoveries, "the injected failure must have happened"
    if "during W 3" in inject[0]:  # the scenario happened: a step was undone from the copy
        assert sum(rec.undone for rec in result.recoveries) >= 1, result.recoveries
    assert [r.iteration for r in result.iterations] == list(range(iterations))
    # Against single-process training on the GPU (fp32, TF32 off: torch's default for matmuls).
    # The pipeline sums a microbatch's gradients in another order than one process does (per
    # rank, then over the stage's ranks), so the last bits differ: 1e-5, as on the CPU (what a GPU
    # gave: `bash bench/gpu_checks.sh`, its live-gpu step).
    assert not torch.backends.cuda.matmul.allow_tf32
    ref, ref_losses = reference_train(load_manifest(out), iterations, device="cuda")
    assert max_weight_diff(result.state_dict, ref) <= 1e-5
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    # And against the CPU, looser: cuBLAS and the CPU's kernels round differently, and Adam divides
    # each gradient by its running norm, which turns last-bit differences of near-zero gradients
    # into differences of up to lr per step (5 steps of 1e-3 at worst; docs/live.md has what a GPU gave).
    cpu, _ = reference_train(load_manifest(out), iterations, device="cpu")
    assert max_weight_diff(result.state_dict, cpu) <= 1e-4


def test_live_shadows_on_a_gpu_bring_a_lost_stage_back_with_no_work_lost(tmp_path):
    # --shadow with the ranks on a GPU: stage 0's GPUs hold stage 1's shadow (on the GPU, stepped
    # with the gradient stage 1 streams through host memory); both GPUs of stage 1 are killed and
    # the two survivors keep their processes and their GPU state: each takes the whole model (its
    # stage and the shadow) in place and goes on from the state after 3 steps (no checkpoint).
    from schedc.live import train

    iterations = 5
    out = tmp_path / "out"
    schedc.compile(schedc.load(LIVE_GPT.format(dp=2, pp=2, failures=""))).write(out)
    result = train(out, iterations=iterations, want_weights=True, device="cuda", shadow=True,
                   recovery="repartition", checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 3 during B: fail gpu(dp=0, pp=1)",
                           "at iteration 3 during B: fail gpu(dp=1, pp=1)"])
    story = [(e["kind"], e["message"]) for e in result.events]
    assert any(k == "repartition" and "move the layers among themselves" in m for k, m in story), story
    assert result.generations[-1].restore is None and len(result.generations[-1].members) == 2, story
    assert result.recoveries[-1].method == "repartition" and result.recoveries[-1].resumed_at == 3, story
    assert [r.iteration for r in result.iterations] == list(range(iterations))
    ref, ref_losses = reference_train(load_manifest(out), iterations, device="cuda")
    assert max_weight_diff(result.state_dict, ref) <= 1e-5  # (the same bound as above, and why)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)


def test_live_training_on_a_gpu_grows_back_in_place_after_a_re_partition(tmp_path):
    # Stage 1 of 2 x 3 lost: the 4 survivors run in the layout the cost model picks (2 x 2 or
    # 3 x 1), re-sharded from the checkpoint (on their
    # GPUs: a re-partitioned rank computes on its survivor's GPU). Both GPUs asked back: the job
    # grows onto 2 x 3 in place, the layers moving from GPU to GPU through host memory, exactly.
    from schedc.live import train

    iterations = 8
    out = tmp_path / "out"
    schedc.compile(schedc.load(LIVE_GPT.format(dp=2, pp=3, failures="").replace("layers = 4", "layers = 6"))
                   ).write(out)
    result = train(out, iterations=iterations, want_weights=True, device="cuda", recovery="repartition",
                   checkpoint_every=1, checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 3 during B: fail gpu(dp=0, pp=1)",
                           "at iteration 3 during B: fail gpu(dp=1, pp=1)",
                           "at iteration 5: recover gpu(dp=0, pp=1)", "at iteration 5: recover gpu(dp=1, pp=1)"])
    story = [(e["kind"], e["message"]) for e in result.events]
    assert [r.method for r in result.recoveries] == ["repartition", "grow-back"], story
    last = result.generations[-1]
    assert len(last.members) == 6 and last.restore is None and last.reason == "grow back (in place)", story
    assert result.recoveries[-1].moved_bytes > 0
    assert [r.iteration for r in result.iterations] == list(range(iterations))
    ref, ref_losses = reference_train(load_manifest(out), iterations, device="cuda")
    assert max_weight_diff(result.state_dict, ref) <= 1e-5  # (the same bound as above, and why)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
