"""`programs.json`: what every generated program of one schedule shares.

Written by `schedc.codegen.write_programs` beside the ``rank_NN.py`` files;
read by the worker of each rank and by `schedc run`. It holds the shape
(dp, pp, microbatches), the live schedule ranks (torch's RANK r is the r-th
of them), the live ranks of each stage (one process group per stage), the
partition, the model and data binding, the optimizer, and the schedule's
metrics for display. This module never imports torch at import time.
"""

from __future__ import annotations

import importlib
import json
import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from schedc.diagnostics import RunError, error

FORMAT = "schedc.programs/v1"
MANIFEST_NAME = "programs.json"

#: `model.source` when a spec names none: the tiny MLP shipped with schedc.
DEFAULT_SOURCE = "schedc.models.mlp:build"


@dataclass(frozen=True)
class Manifest:
    spec: str
    schedc_version: str
    dp: int
    pp: int
    microbatches: int
    live_ranks: tuple[int, ...]  # schedule ranks, ascending; torch RANK r -> live_ranks[r]
    coords: dict[int, tuple[int, int]]  # live schedule rank -> (dp, pp)
    stage_groups: tuple[tuple[int, ...], ...]  # per stage: its live schedule ranks
    programs: dict[int, str]  # live schedule rank -> file name of its program
    source: str
    data: str | None
    partition: tuple[tuple[int, int], ...] | None
    optimizer: str
    lr: float
    iterations: int
    decouple_backward: bool
    stagger_optimizer: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    # The architecture a spec's `model` block gives (layers, hidden, heads, seq_len, vocab,
    # microbatch_size): passed to `source` and `data` as the keyword arguments they declare.
    model_args: dict[str, Any] = field(default_factory=dict)
    # The folder of the spec file compiled (absolute; None for spec text): `model.source` and
    # `model.data` modules are looked for there, and in the current folder, after sys.path.
    spec_dir: str | None = None
    tp: int = 1  # real GPUs per schedc GPU (tensor parallelism): planned, not run (see refuse_tensor_parallel)
    # The microbatches per pipeline of the job whose data this plan trains, when they differ from
    # this plan's (None: the same): a live run re-partitioned onto another number of pipelines
    # trains the same global batch, its microbatch (d, m) being the job's global microbatch
    # d * microbatches + m (`data_index`).
    data_microbatches: int | None = None
    # A symmetric plan's programs are shared by the copies of a class of alike pipelines: rank ->
    # index into `copy_tables`, whose entries give the copy's `ranks` (R) and `pipelines` (D).
    copy_of: dict[int, int] = field(default_factory=dict)
    copy_tables: tuple[dict, ...] = ()

    @property
    def world(self) -> int:
        """GPUs in the cluster, failed ones included."""
        return self.dp * self.pp

    @property
    def global_microbatches(self) -> int:
        """D*M: every microbatch's loss is divided by this (exactness under any failure set)."""
        return self.dp * self.microbatches

    def data_index(self, d: int, mb: int) -> tuple[int, int]:
        """The (pipeline, microbatch) of the job's data that this plan's microbatch `mb` of
        pipeline `d` trains (itself unless `data_microbatches` says otherwise)."""
        if self.data_microbatches is None or self.data_microbatches == self.microbatches:
            return d, mb
        return divmod(d * self.microbatches + mb, self.data_microbatches)

    def dist_rank(self, schedule_rank: int) -> int:
        """torch.distributed rank of a live schedule rank."""
        return self.live_ranks.index(schedule_rank)

    def to_json(self) -> dict:
        # Field by field, not `asdict`: its deep copy of copy_tables took 1.4 s at 16,384 GPUs.
        out = {f.name: copy.deepcopy(getattr(self, f.name)) if f.name in ("metrics", "model_args")
               else getattr(self, f.name) for f in fields(self)}
        out["coords"] = {str(r): list(c) for r, c in self.coords.items()}
        out["programs"] = {str(r): p for r, p in self.programs.items()}
        out["live_ranks"] = list(self.live_ranks)
        out["stage_groups"] = [list(g) for g in self.stage_groups]
        out["partition"] = None if self.partition is None else [list(p) for p in self.partition]
        out["copy_of"] = {str(r): i for r, i in self.copy_of.items()}
        out["copy_tables"] = list(self.copy_tables)
        if not self.copy_of:  # a plan op by op: the manifest reads as it always did
            del out["copy_of"], out["copy_tables"]
        if self.data_microbatches is None:  # (set only in a live run laid out anew)
            del out["data_microbatches"]
        return {"format": FORMAT, **out}

    @classmethod
    def from_json(cls, obj: dict) -> "Manifest":
        obj = dict(obj)
        if obj.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        obj["live_ranks"] = tuple(obj["live_ranks"])
        obj["coords"] = {int(r): tuple(c) for r, c in obj["coords"].items()}
        obj["programs"] = {int(r): p for r, p in obj["programs"].items()}
        obj["stage_groups"] = tuple(tuple(g) for g in obj["stage_groups"])
        if obj.get("partition") is not None:
            obj["partition"] = tuple(tuple(p) for p in obj["partition"])
        obj["copy_of"] = {int(r): i for r, i in obj.get("copy_of", {}).items()}
        obj["copy_tables"] = tuple(obj.get("copy_tables", ()))
        return cls(**obj)


def refuse_tensor_parallel(tp: int) -> None:
    """E526 for programs of a plan with tp > 1: each program is one process for a whole
    tensor-parallel group, which schedc does not shard."""
    if tp > 1:
        raise RunError([error("E526", f"the plan has tensor-parallel groups of {tp} GPUs, and schedc's programs "
                                      "run one process per group",
                              hint="schedc plans TP groups (schedule.json, the timeline, replan); to run it, "
                                   "compile the spec with tp = 1, or drive your own TP training from the plan")])


def refuse_unrunnable(plan) -> None:
    """E526 / E520 for a compiled plan no live run can train: tensor-parallel groups
    (`refuse_tensor_parallel`), or the `redundant` baseline, for which no programs are written."""
    refuse_tensor_parallel(plan.spec.cluster.tp)
    if plan.schedule.instance.redundant_forward:
        raise RunError([error("E520", "this plan is the `redundant` baseline, a model of Bamboo to compare against: "
                                      "schedc writes no programs for it (a holder would run another stage's layers)",
                              hint="compile with `--solver cpsat` or `greedy` to train it")])


def _text_or_empty(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def load_manifest(out_dir: Path | str) -> Manifest:
    """Read ``OUT/programs.json``; E520 when it is missing or unreadable."""
    path = Path(out_dir) / MANIFEST_NAME
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise RunError([error("E520", f"`{out_dir}` is a file, not a folder of compiled programs",
                              hint="give the folder `schedc compile SPEC -o OUT` wrote (OUT), not a file in it")])
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        hint = "compile first: `schedc compile SPEC -o OUT`, then `schedc run OUT`"
        if '"redundant_forward": true' in _text_or_empty(Path(out_dir) / "schedule.json"):
            hint = ("this plan is the `redundant` baseline, a model of Bamboo to compare against: "
                    "schedc writes no programs for it (a holder would run another stage's layers); "
                    "compile with `--solver cpsat` or `greedy` to run it")
        raise RunError([error("E520", f"no {MANIFEST_NAME} in `{out_dir}`", hint=hint)])
    except (ValueError, KeyError, TypeError) as exc:
        raise RunError([error("E521", f"`{path}` is not a valid {FORMAT} manifest: {exc}",
                              hint="recompile the spec with this version of schedc")])


def load_callable(ref: str, what: str, search: tuple[str | None, ...] = ()) -> Callable:
    """The callable named by ``"module:callable"`` (E510 when it cannot be found). A module not
    on sys.path is looked for in the folders of `search` (the spec's folder) and the current one."""
    import os
    import sys

    module, _, name = ref.partition(":")
    if not module or not name:
        raise RunError([error("E510", f"{what} `{ref}` is not of the form \"module:callable\"",
                              hint='e.g. source = "schedc.models.gpt:build"')])
    folders = [str(Path(f).resolve()) for f in (*search, os.getcwd()) if f]
    try:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            extra = [f for f in dict.fromkeys(folders) if f not in sys.path]
            if exc.name != module.split(".")[0] or not extra:
                raise
            sys.path.extend(extra)  # after everything else: never shadows an installed module
            mod = importlib.import_module(module)
        obj = getattr(mod, name)
    except (ImportError, AttributeError) as exc:
        looked = " and ".join(f"`{f}`" for f in dict.fromkeys(folders))
        raise RunError([error("E510", f"cannot load {what} `{ref}`: {exc}",
                              hint=f"the module must be importable where the programs run: on PYTHONPATH, "
                                   f"or in {looked} (where schedc also looked)")])
    if not callable(obj):
        raise RunError([error("E510", f"{what} `{ref}` is not callable")])
    return obj


def spec_folder(source_name: str) -> str | None:
    """The absolute folder of a spec file, where model code is also looked for (None for text)."""
    path = Path(source_name)
    return str(path.resolve().parent) if source_name and path.is_file() else None


def call_with_model_args(fn: Callable, model_args: dict[str, Any], *args):
    """``fn(*args, **kw)`` where `kw` holds the entries of `model_args` that `fn` names as a
    parameter (all of them if it takes ``**kwargs``): a `model.source` or `model.data` that
    declares ``hidden`` gets the spec's ``model.hidden``; one that declares nothing gets nothing."""
    return fn(*args, **{k: v for k, v in model_args.items() if _accepts(fn, k)})


def model_args_of(model) -> dict[str, Any]:
    """The architecture fields a `ModelSpec` sets, as `Manifest.model_args`."""
    if model is None:
        return {}
    names = ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch_size")
    return {k: getattr(model, k) for k in names if getattr(model, k, None) is not None}


_ACCEPTED: dict[int, tuple[Callable, frozenset[str] | None]] = {}


def _accepts(fn: Callable, name: str) -> bool:
    cached = _ACCEPTED.get(id(fn))
    if cached is None or cached[0] is not fn:
        import inspect

        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: pass nothing
            params = ()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            names = None
        else:
            names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        cached = _ACCEPTED[id(fn)] = (fn, names)
    return cached[1] is None or name in cached[1]


def data_ref(manifest: Manifest) -> str:
    """`model.data`, or the `batch` function beside `model.source` when data is absent."""
    return data_ref_of(manifest.source, manifest.data)


def data_ref_of(source: str, data: str | None) -> str:
    """`data`, or the `batch` function beside `source` when `data` is None."""
    if data:
        return data
    module = source.partition(":")[0]
    return f"{module}:batch"


def even_partition(n_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Split `n_layers` layers over `pp` stages by count: stage s gets [s*n//pp, (s+1)*n//pp)."""
    if n_layers < pp:
        raise RunError([error("E511", f"model.source returns {n_layers} layers, fewer than the {pp} stages",
                              hint="use a model with at least one layer per stage")])
    return tuple((s * n_layers // pp, (s + 1) * n_layers // pp) for s in range(pp))


def build_model(manifest: Manifest):
    """Call `model.source`: (list of layers, loss_fn, partition), with the partition checked."""
    return build_layers(manifest.source, manifest.model_args, manifest.partition, manifest.pp,
                        (manifest.spec_dir,))


def build_layers(source: str, model_args: dict[str, Any], partition, pp: int, search: tuple = ()):
    """Call `source` (with the model arguments it declares): (list of layers, loss_fn,
    partition), the partition the given one or the even split by layer count, checked."""
    from torch import nn

    result = call_with_model_args(load_callable(source, "model.source", search), model_args)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RunError([error("E512", f"model.source `{source}` must return (layers, loss_fn)")])
    layers, loss_fn = result
    if not callable(loss_fn):
        raise RunError([error("E512", f"model.source `{source}` returned a loss_fn that cannot be called: "
                                      f"{type(loss_fn).__name__}",
                              hint="return (layers, loss_fn) with loss_fn an nn.Module or a function of "
                                   "(output, target), e.g. torch.nn.functional.cross_entropy")])
    layers = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise RunError([error("E512", f"model.source `{source}` returned layers that are not nn.Modules")])
    partition = partition or even_partition(len(layers), pp)
    if partition[-1][1] > len(layers) or len(partition) != pp:
        raise RunError([error("E513", f"the partition {list(map(list, partition))} does not fit the "
                                      f"{len(layers)} layers of `{source}` over {pp} stages",
                              hint="the partition slices the list `model.source` returns; make them agree "
                                   "(schedc.models.* are tiny CPU models unless a model block sizes them: "
                                   "mlp has 7 layers, gpt 6)")])
    return layers, loss_fn, partition


def stage_layer_keys(layers: list, partition, stage: int) -> list[tuple[str, str]]:
    """(key in the stage module, key in the full nn.Sequential) for every state entry of a stage."""
    a, b = partition[stage]
    from torch import nn

    module = nn.Sequential(*layers[a:b])
    out = []
    for key in module.state_dict():
        local, _, rest = key.partition(".")
        out.append((key, f"{int(local) + a}.{rest}"))
    return out
