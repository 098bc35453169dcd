"""Re-sharding a checkpoint: one stage's state for a split of the model other than the one that
wrote it (fewer stages once a stage's GPUs are gone for good, or more).

A checkpoint holds one file per stage, its tensors under the stage module's
local keys (``"2.0.weight"`` is the third layer of that stage) and its
optimizer state indexed by each parameter's position in the stage's list of
trainable parameters. `meta.json` says which layers [a, b) each stage held
(`schedc.live.checkpoint`), and each stage file names its parameters in the
optimizer's order (`Runtime.stage_state`'s ``params``). A stage of the new
split is gathered from the old stage files holding its layers::

    model:      old local key "i.rest" of the stage starting at a  ->  layer a + i  ->  new "a + i - first.rest"
    optimizer:  old index j  ->  (layer, parameter name)  ->  its index in the new stage's parameter order

Per-parameter state (Adam's moments and step, SGD's momentum buffer) moves
with its parameter unchanged; the group's hyperparameters (lr, betas, ...)
and the step count are kept, so training goes on exactly as it would have.
The data-parallel width and microbatches must not change (checked before the
run by `checkpoint.check_resumable`): they decide the data of each step.
"""

from __future__ import annotations

import json
from typing import Callable

from schedc.diagnostics import RunError, error
from schedc.live.checkpoint import Checkpoint, load_stage


def reshard_stage(found: Checkpoint, layers: tuple[int, int] | None, module) -> dict:
    """The state of the stage holding the model's layers [a, b) = `layers`, as
    `Runtime.load_stage_state` takes it, gathered from the stage files of `found` that hold
    them. `module` is the new stage's module (an ``nn.Sequential`` of those layers): its
    state_dict keys and its trainable parameters' order are the target's. An emulated run
    (`module` None) has no tensors: only the step count carries over.

    E570 when the checkpoint does not record its split, or lacks a tensor the stage needs.
    """
    if module is None:
        return {"steps": found.iteration, "model": {}, "optimizer": None}
    partition = found.meta.get("partition")
    if not partition:
        raise RunError([error("E570", f"checkpoint `{found.path}` does not record how its model was split "
                                      "into stages: it can be resumed only by a plan of the same split",
                              hint="resume with a plan of the same split, or from a newer checkpoint")])

    def load(stage: int) -> dict:
        old = load_stage(found, stage)
        if int(old.get("steps", -1)) != found.iteration:
            raise RunError([error("E570", f"stage {stage} of checkpoint `{found.path}` holds {old.get('steps')} "
                                          f"steps, its meta.json {found.iteration}",
                                  hint="resume from another checkpoint")])
        return old

    return assemble(partition, load, found.iteration, layers, module, f"checkpoint `{found.path}`")


def needed_stages(partition, layers: tuple[int, int]) -> list[int]:
    """The stages of the split `partition` that hold some of the layers [a, b) = `layers`."""
    first, end = layers
    return [stage for stage, (a, b) in enumerate(partition) if b > first and a < end]


def assemble(partition, load: Callable[[int], dict], steps: int, layers: tuple[int, int], module,
             source: str) -> dict:
    """The state of the stage holding layers [a, b) = `layers` (`module` its module), gathered
    from the states of the stages of the split `partition` that hold them: `load(stage)` gives
    one (as `Runtime.stage_state` makes it: its tensors under the stage's local keys, its
    optimizer state, `params`), after `steps` steps. `source` names where they come from in an
    E570 (a checkpoint, or the survivors of a live run)."""
    from schedc.runtime.primitives import optimized_names

    first, end = layers
    names = optimized_names(module)
    index = {_layer_key(name, first): i for i, name in enumerate(names)}
    model, state, groups = {}, {}, []
    for stage in needed_stages(partition, layers):
        a = partition[stage][0]
        old = load(stage)
        for key, tensor in old["model"].items():
            layer, rest = _layer_key(key, a)
            if first <= layer < end:
                model[f"{layer - first}.{rest}"] = tensor
        if old.get("optimizer") is not None:
            groups += _move_optimizer_state(source, stage, old, a, (first, end), index, state)
    wanted = module.state_dict()
    missing, extra = sorted(set(wanted) - set(model)), sorted(set(model) - set(wanted))
    resized = sorted(k for k in set(wanted) & set(model) if tuple(wanted[k].shape) != tuple(model[k].shape))
    if missing or extra or resized:
        what = "; ".join(f"{label} {_some(keys)}" for label, keys in
                         (("lacks", missing), ("has unknown", extra), ("has other shapes of", resized)) if keys)
        raise RunError([error("E570", f"{source} does not fit layers [{first}, {end}) of the "
                                      f"plan's model: it {what} (keys of the plan's stage module)",
                              hint="resume with the model that wrote it, or from another checkpoint")])
    return {"steps": steps, "model": model, "optimizer": _optimizer(source, names, state, groups)}


def trim(state: dict, first: int, wanted) -> dict:
    """`state` of a stage starting at layer `first` (as `Runtime.stage_state` makes it), cut to the
    layers in any of the ranges [a, b) of `wanted`: what `assemble` takes from it for those
    layers, and nothing else (an in-place move sends only what its receiver needs)."""
    def keep(layer: int) -> bool:
        return any(a <= layer < b for a, b in wanted)

    model = {k: v for k, v in state["model"].items() if keep(_layer_key(k, first)[0])}
    optimizer = state.get("optimizer")
    if optimizer is not None:
        names = state["params"]
        optimizer = {**optimizer, "state": {j: s for j, s in optimizer["state"].items()
                                            if keep(_layer_key(names[int(j)], first)[0])}}
    return {**state, "model": model, "optimizer": optimizer}


def _move_optimizer_state(source: str, stage: int, old: dict, a: int, layers: tuple[int, int],
                          index: dict, state: dict) -> list[dict]:
    """Copy the per-parameter state of old stage `stage` (first layer `a`) that belongs to
    `layers` into `state` under the new indices (`index`: (layer, name) -> new index); the
    hyperparameters of each of its parameter groups that hold such a parameter."""
    names = old.get("params")
    if names is None:
        raise RunError([error("E570", f"stage {stage} of {source} does not name its parameters",
                              hint="resume with a plan of the same split (written by an older schedc)")])
    first, end = layers
    groups = []
    for group in old["optimizer"]["param_groups"]:
        ours = [j for j in group["params"] if first <= _layer_key(names[j], a)[0] < end]
        if ours:
            groups.append({k: v for k, v in group.items() if k != "params"})
        for j in ours:
            new = index.get(_layer_key(names[j], a))
            if new is None:
                layer, rest = _layer_key(names[j], a)
                raise RunError([error("E570", f"parameter `{rest}` of layer {layer} in {source} "
                                              "is not a trainable parameter of the plan's model",
                                      hint="resume with the model that wrote it")])
            if j in old["optimizer"]["state"]:
                state[new] = old["optimizer"]["state"][j]
    return groups


def _optimizer(source: str, names: list[str], state: dict, groups: list[dict]) -> dict | None:
    """The new stage's optimizer state_dict: one group (as `primitives.make_optimizer` makes)
    over all its parameters, with the hyperparameters every old group agreed on."""
    if not names:
        return None
    settings = {json.dumps(g, sort_keys=True, default=str) for g in groups}
    if len(settings) != 1:
        why = f"disagree on the optimizer's settings ({len(settings)} kinds of parameter group)" if settings \
            else "hold no optimizer for the layers of this stage"
        raise RunError([error("E570", f"the stages of {source} {why}",
                              hint="resume with a plan of the same split")])
    return {"state": {i: state[i] for i in sorted(state)},
            "param_groups": [{**groups[0], "params": list(range(len(names)))}]}


def _some(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _layer_key(key: str, first: int) -> tuple[int, str]:
    """(the model's layer index, the key inside that layer) of a stage module's key, the stage
    starting at layer `first` (as `schedc.runtime.manifest.stage_layer_keys` maps them)."""
    local, _, rest = key.partition(".")
    return int(local) + first, rest


def plan_model_layers(plan, out: str) -> int | None:
    """How many layers the model of `plan` (compiled into `out`) has, as its workers will build
    it. It builds the model: called only when a resume must re-shard."""
    from schedc.runtime.manifest import MANIFEST_NAME, Manifest, build_model

    files = plan.programs(str(out))
    if MANIFEST_NAME not in files:
        return None
    return len(build_model(Manifest.from_json(json.loads(files[MANIFEST_NAME])))[0])
