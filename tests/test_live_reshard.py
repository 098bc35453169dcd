"""Resuming a checkpoint onto another split of the model into stages (same dp and microbatches).

The re-sharder alone (no processes): a checkpoint written under split A and
re-sharded to split B equals the state trained directly under split B, for
SGD (with and without momentum), Adam and AdamW; the refusals. Then real
runs: a dp 2 x pp 3 plan trains with checkpoints, a dp 2 x pp 2 and a dp 2 x
pp 4 plan of the same model resume from its checkpoint, and the final
weights are those of single-process training.
"""

from __future__ import annotations

import copy
import os
import zlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import schedc
from live_support import TOLERANCE, spec_text
from schedc.live import checkpoint, train
from schedc.live.checkpoint import check_resumable, split_differs
from schedc.live.reshard import reshard_stage
from schedc.runtime import load_manifest, reference_train
from schedc.runtime.manifest import build_layers, stage_layer_keys
from schedc.runtime.primitives import optimized_names
from test_runtime_support import max_weight_diff

LAYERS = 7  # schedc.models.mlp
SPLITS = {
    "pp3": ((0, 2), (2, 4), (4, 7)),  # even_partition(7, 3)
    "pp2": ((0, 3), (3, 7)),
    "pp4": ((0, 1), (1, 3), (3, 5), (5, 7)),
    "pp2-uneven": ((0, 5), (5, 7)),
    "pp1": ((0, 7),),
}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.001),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.001),
}
STEPS = 3


def _trained_stages(split, optimizer: str) -> list[tuple[torch.nn.Sequential, dict]]:
    """Each stage of `split` (its module and `stage_state`-like state) after STEPS optimizer steps
    whose gradients are a function of the global parameter key and the step only: the same
    training whichever split runs it (optimizers work parameter by parameter)."""
    layers, _, _ = build_layers("schedc.models.mlp:build", {}, split, len(split))
    out = []
    for stage, (a, b) in enumerate(split):
        module = torch.nn.Sequential(*copy.deepcopy(layers[a:b]))
        params = [p for p in module.parameters() if p.requires_grad]
        opt = OPTIMIZERS[optimizer](params)
        full = dict(stage_layer_keys(layers, split, stage))
        named = dict(module.named_parameters())
        for step in range(STEPS):
            for name in optimized_names(module):
                g = torch.Generator().manual_seed(zlib.crc32(f"{full[name]} {step}".encode()))
                named[name].grad = torch.randn(named[name].shape, generator=g)
            opt.step()
        state = {"steps": STEPS, "model": {k: v.clone() for k, v in module.state_dict().items()},
                 "optimizer": copy.deepcopy(opt.state_dict()), "params": optimized_names(module)}
        out.append((module, state))
    return out


def _checkpoint(root: Path, split, optimizer: str, meta: dict | None = None) -> checkpoint.Checkpoint:
    for stage, (_, state) in enumerate(_trained_stages(split, optimizer)):
        checkpoint.write_stage(root, STEPS, stage, state)
    if meta is None:
        meta = {"optimizer": optimizer, "emulate": False, "dp": 2, "microbatches": 3,
                "partition": [list(p) for p in split], "model_layers": LAYERS}
    return checkpoint.complete(root, STEPS, len(split), meta)


def _same(a, b) -> bool:
    """Equal state, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# -- the re-sharder alone ----------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("source, target", [("pp3", "pp2"), ("pp3", "pp4"), ("pp2", "pp2-uneven"), ("pp4", "pp1")])
def test_a_resharded_stage_is_the_stage_trained_under_the_new_split(tmp_path, optimizer, source, target):
    found = _checkpoint(tmp_path, SPLITS[source], optimizer)
    for stage, (module, want) in enumerate(_trained_stages(SPLITS[target], optimizer)):
        got = reshard_stage(found, SPLITS[target][stage], module)
        assert got["steps"] == STEPS
        assert _same(got["model"], want["model"])
        assert _same(got["optimizer"], want["optimizer"]), (stage, got["optimizer"], want["optimizer"])
        if optimizer != "sgd":  # per-parameter state was there to move, and every parameter has it
            assert len(got["optimizer"]["state"]) == len(want["params"])
        module.load_state_dict(got["model"])  # what Runtime.load_stage_state does with it
        OPTIMIZERS[optimizer]([p for p in module.parameters() if p.requires_grad]).load_state_dict(got["optimizer"])


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("source, target", [("pp3", "pp2"), ("pp2", "pp4"), ("pp4", "pp1")])
def test_a_stage_cut_to_the_layers_a_receiver_takes_assembles_the_same(optimizer, source, target):
    # An in-place move sends each receiver only the layers it takes from a stage (`trim`): the
    # stage it assembles is the same, bit for bit, and nothing of other layers is sent.
    from schedc.live.reshard import assemble, trim

    old = [state for _, state in _trained_stages(SPLITS[source], optimizer)]
    for stage, (module, want) in enumerate(_trained_stages(SPLITS[target], optimizer)):
        layers = SPLITS[target][stage]
        cut = [trim(state, SPLITS[source][t][0], [layers]) for t, state in enumerate(old)]
        got = assemble(SPLITS[source], cut.__getitem__, STEPS, layers, module, "the survivors' state")
        assert _same(got["model"], want["model"]) and _same(got["optimizer"], want["optimizer"])
        for t, (a, b) in enumerate(SPLITS[source]):
            kept = {int(k.split(".")[0]) + a for k in cut[t]["model"]}
            assert kept == set(range(max(a, layers[0]), min(b, layers[1]))), (t, kept)
            assert len(cut[t]["optimizer"]["state"]) <= len(old[t]["optimizer"]["state"])


def test_an_emulated_checkpoint_carries_only_its_steps(tmp_path):
    for stage in range(3):
        checkpoint.write_stage(tmp_path, 4, stage, {"steps": 4, "model": {}, "optimizer": None, "params": []})
    found = checkpoint.complete(tmp_path, 4, 3, {"emulate": True, "dp": 2, "microbatches": 3, "partition": None,
                                                 "model_layers": None})
    check_resumable(found, stages=2, emulate=True, optimizer="sgd", iterations=6, dp=2, microbatches=3)
    assert reshard_stage(found, None, None) == {"steps": 4, "model": {}, "optimizer": None}


def test_a_checkpoint_of_another_model_is_a_diagnostic(tmp_path):
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam")
    layers, _, _ = build_layers("schedc.models.mlp:build", {"hidden": 8}, SPLITS["pp2"], 2)
    with pytest.raises(schedc.RunError) as exc:
        reshard_stage(found, (0, 3), torch.nn.Sequential(*layers[0:3]))
    assert exc.value.codes == ["E570"] and "other shapes" in exc.value.render()


# -- what check_resumable accepts and refuses ------------------------------------------------------


def _check(found, **kw):
    plan = dict(stages=2, emulate=False, optimizer="adam", iterations=6, dp=2, microbatches=3,
                model_layers=lambda: LAYERS)
    check_resumable(found, **{**plan, **kw})


def test_the_same_split_needs_no_resharding_and_builds_no_model(tmp_path):
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam")

    def never():
        raise AssertionError("the model was built to resume onto the same split")

    _check(found, stages=3, model_layers=never)
    _check(found, stages=3, partition=SPLITS["pp3"], model_layers=never)
    assert not split_differs(found.meta, 3, None)
    assert split_differs(found.meta, 2, None) and split_differs(found.meta, 3, ((0, 1), (1, 4), (4, 7)))


@pytest.mark.parametrize("plan, words", [
    ({"dp": 3}, ["has dp 2, the plan dp 3", "resume onto the same data-parallel width"]),
    ({"microbatches": 4}, ["has 3 microbatches per pipeline, the plan 4", "train.microbatches = 3"]),
    ({"model_layers": lambda: 9}, ["holds a model of 7 layers, the plan's model has 9", "same model"]),
    ({"optimizer": "sgd"}, ["optimizer = 'adam', this run has 'sgd'"]),
])
def test_a_resume_that_changes_more_than_the_split_is_refused(tmp_path, plan, words):
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam")
    with pytest.raises(schedc.RunError) as exc:
        _check(found, **plan)
    text = exc.value.render()
    assert exc.value.codes == ["E570"] and all(w in text for w in words), text


@pytest.mark.parametrize("plan, words", [
    ({"dp": 3}, "has dp 2, the plan dp 3"),
    ({"microbatches": 2}, "has 3 microbatches per pipeline, the plan 2"),
])
def test_a_resume_onto_the_same_split_with_another_batch_is_refused(tmp_path, plan, words):
    # The same stages, so nothing to re-shard, but another dp or microbatches: another global
    # batch, not the training the checkpoint continues. It resumed silently, with other losses.
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam")
    with pytest.raises(schedc.RunError) as exc:
        _check(found, stages=3, **plan)
    assert exc.value.codes == ["E570"] and words in exc.value.render()


def test_every_difference_is_said_at_once(tmp_path):
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam")
    with pytest.raises(schedc.RunError) as exc:
        _check(found, dp=4, microbatches=2)
    assert exc.value.codes == ["E570", "E570"]


def test_an_old_checkpoint_resumes_only_onto_its_own_stage_count(tmp_path):
    found = _checkpoint(tmp_path, SPLITS["pp3"], "adam", meta={"optimizer": "adam", "emulate": False})
    _check(found, stages=3)  # today's resume
    with pytest.raises(schedc.RunError) as exc:
        _check(found, stages=2)
    text = exc.value.render()
    assert exc.value.codes == ["E570"] and "does not record how its model was split" in text
    assert "resume it with a plan of 3 stages" in text
    with pytest.raises(schedc.RunError, match="E570"):
        reshard_stage(found, (0, 3), _trained_stages(SPLITS["pp2"], "adam")[0][0])


# -- real runs ------------------------------------------------------------------------------------


def _compiled(folder: Path, **kw) -> Path:
    """`schedc compile` of `spec_text(**kw)` into `folder` (the plans of one test side by side)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    schedc.compile(spec_text(**kw)).write(folder)
    return folder


def _resumed_exactly(plan: Path, checkpoints: Path, iterations: int, **kw):
    result = train(plan, iterations=iterations, resume=True, checkpoint_dir=str(checkpoints), want_weights=True,
                   **kw)
    ref, _ = reference_train(load_manifest(plan), iterations)
    diff = max_weight_diff(result.state_dict, ref)
    assert diff <= TOLERANCE, f"max abs weight difference {diff:.3g}"
    return result


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_checkpoint_of_three_stages_resumes_exactly_onto_two_and_four(tmp_path, optimizer):
    old = _compiled(tmp_path / "pp3", dp=2, pp=3, optimizer=optimizer)
    train(old, iterations=4, checkpoint_every=2)
    checkpoints = old / "checkpoints"
    meta = checkpoint.latest(checkpoints).meta
    assert meta["partition"] == [[0, 2], [2, 4], [4, 7]] and meta["model_layers"] == LAYERS
    assert (meta["dp"], meta["microbatches"], meta["stages"]) == (2, 3, 3)
    for pp in (2, 4):
        new = _compiled(tmp_path / f"pp{pp}", dp=2, pp=pp, optimizer=optimizer)
        result = _resumed_exactly(new, checkpoints, 6)
        assert [r.iteration for r in result.iterations] == [4, 5]
        assert result.generations[0].restore == str(checkpoints / "iter-000004")


@pytest.mark.e2e
def test_a_stage_lost_after_resharding_restores_the_old_split_again(tmp_path):
    """Resumed onto 2 stages from a 3-stage checkpoint, the run loses both GPUs of a stage before
    it wrote a checkpoint of its own: each worker re-shards the 3-stage checkpoint once more."""
    old = _compiled(tmp_path / "pp3", dp=2, pp=3, optimizer="adam")
    train(old, iterations=2, checkpoint_every=2)
    new = _compiled(tmp_path / "pp2", dp=2, pp=2, optimizer="adam")
    result = _resumed_exactly(new, old / "checkpoints", 5,
                              inject=["at iteration 3 during F: fail gpu(dp=0, pp=1)",
                                      "at iteration 3 during B: fail gpu(dp=1, pp=1)"])
    (rec,) = result.recoveries
    assert rec.method == "checkpoint" and rec.resumed_at == 2
    assert result.generations[-1].restore == str(old / "checkpoints" / "iter-000002")


@pytest.mark.e2e
def test_the_cli_resumes_another_runs_checkpoints_and_refuses_another_width(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    old = _compiled(tmp_path / "pp3", dp=2, pp=3)
    train(old, iterations=2, checkpoint_every=2)
    wide = _compiled(tmp_path / "dp3", dp=3, pp=2)
    proc = subprocess.run([sys.executable, "-m", "schedc", "train", str(wide), "--iterations", "3", "--resume",
                           "--checkpoint-dir", str(old / "checkpoints")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "error[E570]" in proc.stderr and "has dp 2, the plan dp 3" in proc.stderr, proc.stderr
    assert not (wide / "live").exists()  # refused before any worker started
    new = _compiled(tmp_path / "pp2", dp=2, pp=2)
    proc = subprocess.run([sys.executable, "-m", "schedc", "train", str(new), "--iterations", "3", "--resume",
                           "--checkpoint-dir", str(old / "checkpoints")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "iteration    2" in proc.stdout and "iteration    1 " not in proc.stdout, proc.stdout


@pytest.mark.e2e
def test_an_emulated_run_resumes_onto_another_stage_count(tmp_path):
    old = _compiled(tmp_path / "pp3", dp=2, pp=3)
    train(old, iterations=2, checkpoint_every=2, emulate=True)
    assert checkpoint.latest(old / "checkpoints").meta["partition"] is None  # no tensors, no layers
    new = _compiled(tmp_path / "pp2", dp=2, pp=2)
    result = train(new, iterations=3, resume=True, checkpoint_dir=str(old / "checkpoints"), emulate=True)
    assert [r.iteration for r in result.iterations] == [2]


@pytest.mark.e2e
def test_resuming_a_checkpoint_of_another_model_says_which_parameter_differs(tmp_path):
    # The same stage count and an even split: nothing to re-shard, so the checkpoint's model is
    # first compared as its stages load. A wider first layer (the model changed between runs)
    # is E570 naming the parameter, not torch's whole list of size mismatches.
    from schedc.diagnostics import SchedcError

    plan = _compiled(tmp_path / "pp2", dp=2, pp=2)
    train(plan, iterations=2, checkpoint_every=2)
    found = checkpoint.latest(plan / "checkpoints")
    state = torch.load(found.stage_file(0), weights_only=True)
    key = next(k for k in state["model"] if k.endswith("weight"))
    state["model"][key] = torch.zeros(state["model"][key].shape[0] + 8, state["model"][key].shape[1])
    torch.save(state, found.stage_file(0))
    with pytest.raises(SchedcError) as exc:
        train(plan, iterations=3, resume=True)
    (diag,) = [d for d in exc.value.diagnostics if d.code == "E570"]
    assert f"`{found.path}` does not fit the plan's model at stage 0: size mismatch for {key}" in diag.message
    assert "resume with the model the run that wrote it trained" in diag.hint
