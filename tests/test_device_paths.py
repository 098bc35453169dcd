"""The GPU code paths that can run without a GPU: placement of ranks on devices and backends,
and NCCL's way of matching messages (by the sender's program order, no tags), run over gloo.

tests/test_gpu.py runs the CUDA paths themselves where a GPU exists.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import schedc
from schedc.codegen import write_programs
from schedc.diagnostics import RunError
from schedc.runtime import launch, load_manifest, reference_train
from schedc.runtime import placement
from schedc.runtime.channels import ACTIVATION, GRADIENT, receive_order
from schedc.schedule_io import read_schedule
from test_runtime_support import max_weight_diff

ROOT = Path(__file__).resolve().parent.parent
REORDERED = Path(__file__).parent / "data" / "reordered_3x3.schedule.json"


def _wanted_order(schedule, rank):
    """What `rank` receives, per (sender, kind), in the order its own program asks for it."""
    pp = schedule.instance.pp
    executor = {(op.dp, op.mb, op.pp): op.rank for op in schedule.ops if op.kind == "F"}
    out: dict = {}
    for op in schedule.programs[rank]:
        if op.kind == "F" and op.pp > 0:
            out.setdefault((executor[(op.dp, op.mb, op.pp - 1)], ACTIVATION), []).append((op.dp, op.mb))
        elif op.kind == "B" and op.pp < pp - 1:
            out.setdefault((executor[(op.dp, op.mb, op.pp + 1)], GRADIENT), []).append((op.dp, op.mb))
    return {k: tuple(v) for k, v in out.items()}


def test_receive_order_lists_every_message_once_in_the_senders_order():
    schedule, _ = read_schedule(REORDERED)
    differs = 0
    for rank in schedule.programs:
        order = receive_order(schedule, rank)
        wanted = _wanted_order(schedule, rank)
        assert set(order.sequences) == set(wanted)
        for key, seq in wanted.items():
            assert sorted(order.sent_to_me(*key)) == sorted(seq)
            differs += order.sent_to_me(*key) != seq
    assert differs >= 1, "the case must have a receiver that wants messages in another order than sent"


@pytest.mark.e2e
def test_matching_by_program_order_is_exact_when_receivers_want_another_order(tmp_path):
    """The protocol NCCL needs, over gloo with one tag per direction: a receiver that wants
    microbatch 5 before 3 from a sender that sends 3 first still gets each its own tensor."""
    spec = schedc.load(ROOT / "specs" / "slow-gpu.sched")  # 3 x 3, two slow GPUs; the MLP
    schedule, _ = read_schedule(REORDERED)
    write_programs(spec, schedule, tmp_path)
    shutil.copy(REORDERED, tmp_path / "schedule.json")
    result = launch(tmp_path, iterations=2, want_weights=True, ordered=True, timeout=30)
    ref, ref_losses = reference_train(load_manifest(tmp_path), 2)
    assert max_weight_diff(result.state_dict, ref) <= 1e-5
    assert result.losses == pytest.approx(ref_losses, abs=1e-6)


def test_program_order_needs_the_schedule_beside_the_programs(tmp_path):
    spec = schedc.load(ROOT / "specs" / "mlp-2x2.sched")
    write_programs(spec, schedc.compile(spec).schedule, tmp_path)
    with pytest.raises(RunError) as exc:
        launch(tmp_path, iterations=1, ordered=True, timeout=10)
    assert exc.value.diagnostics[0].code == "E522" and "schedule.json" in exc.value.diagnostics[0].message


def test_cpu_placement_is_gloo_and_refuses_nccl():
    p = placement.place("cpu", "auto", 4)
    assert p.devices == ("cpu",) * 4 and p.backend == "gloo" and not p.ordered
    with pytest.raises(RunError) as exc:
        placement.place("cpu", "nccl", 4)
    assert exc.value.diagnostics[0].code == "E581"


@pytest.mark.parametrize("gpus, backend, want", [
    (4, "auto", ("nccl", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))),
    (2, "auto", ("gloo", ("cuda:0", "cuda:1", "cuda:0", "cuda:1"))),  # NCCL refuses two ranks on a GPU
    (4, "gloo", ("gloo", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))),
    (2, "nccl", "E581"),
    (0, "auto", "E580"),
])
def test_cuda_placement(monkeypatch, gpus, backend, want):
    monkeypatch.setattr(placement, "gpu_count", lambda: gpus)
    monkeypatch.setattr(placement, "nccl_available", lambda: True)
    if isinstance(want, str):
        with pytest.raises(RunError) as exc:
            placement.place("cuda", backend, 4)
        assert exc.value.diagnostics[0].code == want
    else:
        p = placement.place("cuda", backend, 4)
        assert (p.backend, p.devices) == want and p.ordered == (want[0] == "nccl")


def test_one_named_gpu_holds_every_rank_over_gloo(monkeypatch):
    monkeypatch.setattr(placement, "gpu_count", lambda: 2)
    assert placement.place("cuda:1", "auto", 3).devices == ("cuda:1",) * 3
    for bad, code in (("cuda:2", "E580"), ("tpu", "E580"), ("cuda:x", "E580")):
        with pytest.raises(RunError) as exc:
            placement.place(bad, "auto", 3)
        assert exc.value.diagnostics[0].code == code


def test_run_cli_refuses_cuda_without_a_gpu(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    spec = schedc.load(ROOT / "specs" / "mlp-2x2.sched")
    write_programs(spec, schedc.compile(spec).schedule, tmp_path)
    out = subprocess.run([sys.executable, "-m", "schedc", "run", str(tmp_path), "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "error[E580]" in out.stderr and "Traceback" not in out.stderr


# -- `schedc train --device`: a live run's placement -------------------------------------------------

@pytest.mark.parametrize("gpus, device, backend, want", [
    (1, "cuda", "auto", ("gloo", ("cuda:0",) * 4)),  # several ranks share the GPU
    (4, "cuda", "auto", ("gloo", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))),  # gloo, not NCCL, in a live run
    (2, "cuda:1", "gloo", ("gloo", ("cuda:1",) * 4)),
    (4, "cuda", "nccl", "E581"),  # enough GPUs, but a live run does not rebuild NCCL communicators
    (1, "cuda", "nccl", "E581"),
    (0, "cuda", "nccl", "E580"),  # no GPU: said first
    (0, "cuda", "auto", "E580"),
    (0, "cpu", "nccl", "E581"),
])
def test_live_placement_talks_over_gloo_and_refuses_nccl_with_the_reason(monkeypatch, gpus, device, backend, want):
    monkeypatch.setattr(placement, "gpu_count", lambda: gpus)
    monkeypatch.setattr(placement, "nccl_available", lambda: True)
    if isinstance(want, str):
        with pytest.raises(RunError) as exc:
            placement.place_live(device, backend, 4)
        diag = exc.value.diagnostics[0]
        assert diag.code == want and diag.hint
        if want == "E581" and device != "cpu":
            assert "gloo only" in diag.message
    else:
        p = placement.place_live(device, backend, 4)
        assert (p.backend, p.devices) == want
        assert tuple(placement.rank_device(device, i) for i in range(4)) == want[1]


def test_a_live_worker_without_a_gpu_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(placement, "gpu_count", lambda: 0)
    assert placement.own_device("cpu", 3) == "cpu"
    with pytest.raises(RunError) as exc:
        placement.own_device("cuda:0", 3)
    assert exc.value.diagnostics[0].code == "E580" and "rank 3" in exc.value.diagnostics[0].message


@pytest.mark.parametrize("args, code", [
    (["--device", "cuda"], "E580"),  # no GPU here
    (["--backend", "nccl"], "E581"),
    (["--device", "cuda", "--emulate"], "E555"),
    (["--device", "npu"], "E580"),
])
def test_train_cli_refuses_devices_it_cannot_use_before_starting_anything(tmp_path, args, code):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available() and code == "E580" and args[1] == "cuda":
        pytest.skip("this machine has a GPU")
    schedc.compile(schedc.load(ROOT / "specs" / "mlp-2x2.sched")).write(tmp_path / "out")
    out = subprocess.run([sys.executable, "-m", "schedc", "train", str(tmp_path / "out"), "--iterations", "2", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"error[{code}]" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "out" / "checkpoints").exists() and "iteration" not in out.stdout  # nothing ran
