"""Parsed spec tree -> validated `Spec` (E2xx meaning errors, E3xx lost stages).

The second pass of docs/architecture.md's data flow. Every mistake found is collected and raised
once, as one `SpecError` carrying all diagnostics with their spans. Each block's values are
read by `schedc.values` (converted by unit, then checked for ranges and required keys by the
pydantic models here); the `failures` block means what `schedc.failures` says.

Codes are listed in docs/errors.md.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from schedc.diagnostics import Label, Span, error, spec_error
from schedc.diagnostics import LostStageError  # noqa: F401  (documented as importable from here: docs/errors.md)
from schedc.failures import failures_from_block, resolve_gpus
from schedc.limits import MAX_COST_SECONDS, MAX_ITERATIONS, MAX_SECONDS
from schedc.parse import Assign, Block, Document, Statement, Value, display_text
from schedc.printer import human_bytes
from schedc.spec import (
    STAGE_KEYS,
    STAGE_SIZE_KEYS,
    STAGE_TIME_KEYS,
    ClusterSpec,
    Failure,
    Gpu,
    GpuSpec,
    LinkSpec,
    ModelSpec,
    RecoveryOptions,
    ScheduleOptions,
    Spec,
    StageCosts,
    TrainSpec,
)
from schedc.values import (EXAMPLES, Collector, Kind, check_model, convert, converted, duplicate, read_block,
                           type_error, unknown_name)


# -- what each block may hold ----------------------------------------------------

CLUSTER_KEYS: dict[str, Kind] = {"dp": "int", "pp": "int", "tp": "int", "gpus_per_node": "int", "placement": "word"}
GPU_KEYS: dict[str, Kind] = {"memory": "size", "flops": "flops", "efficiency": "float"}
LINK_KEYS: dict[str, Kind] = {"latency": "time", "bandwidth": "rate"}
STAGE_KINDS: dict[str, Kind] = {**{k: "time" for k in STAGE_TIME_KEYS}, **{k: "size" for k in STAGE_SIZE_KEYS}}
TRAIN_KEYS: dict[str, Kind] = {"microbatches": "int", "optimizer": "word", "lr": "float", "iterations": "int"}
SCHEDULE_KEYS: dict[str, Kind] = {"decouple_backward": "bool", "stagger_optimizer": "bool", "solver": "name",
                                  "time_limit": "seconds"}
MODEL_KEYS: dict[str, Kind] = {"layers": "int", "hidden": "int", "heads": "int", "seq_len": "int",
                               "vocab": "int", "microbatch_size": "int", "precision": "word",
                               "source": "string", "data": "string"}
RECOVERY_KEYS: dict[str, Kind] = {"policy": "name", "horizon": "seconds", "checkpoint_every": "seconds",
                                  "restart_cost": "seconds", "reconfigure_cost": "seconds"}
TOP_BLOCKS = ("cluster", "stages", "model", "partition", "train", "failures", "schedule", "recovery")
MODEL_REQUIRED = ("layers", "hidden", "heads", "seq_len", "vocab")

#: Defaults that are not in the dataclasses (documented in docs/spec-language.md).
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_LINK_LATENCY = 0  # µs
DEFAULT_LINK_BANDWIDTH = 25 * 10**9  # bytes/s (25 GB/s)


_SOURCE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")

# -- pydantic boundary models (ranges and required keys) -------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# Upper limits: what a real job could need, with room, and what the planner's integer
# arithmetic (CP-SAT's 64-bit domains: sums of durations over every op) can hold.
MAX_TIME_US = 10**10  # one op or one transfer's latency: about 2.8 hours
MAX_BYTES = 2**60  # one EiB
MAX_GPUS = 131_072  # dp * pp: schedc checks a cluster this large in seconds


class _Cluster(_Strict):
    dp: int = Field(ge=1, le=100_000)
    pp: int = Field(ge=1, le=10_000)
    gpus_per_node: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS)
    tp: int = Field(1, ge=1, le=1024)
    placement: Literal["pipeline_major", "stage_major"] = "pipeline_major"


class _Gpu(_Strict):
    memory: int = Field(ge=1, le=MAX_BYTES)
    flops: float | None = Field(None, gt=0, le=1e24)
    efficiency: float | None = Field(None, gt=0, le=1)


class _Link(_Strict):
    latency: int = Field(DEFAULT_LINK_LATENCY, ge=0, le=MAX_TIME_US)
    bandwidth: int = Field(DEFAULT_LINK_BANDWIDTH, ge=1, le=MAX_BYTES)


class _Stage(_Strict):
    forward: int = Field(ge=1, le=MAX_TIME_US)
    backward_input: int = Field(ge=1, le=MAX_TIME_US)
    backward_weight: int = Field(ge=1, le=MAX_TIME_US)
    optimizer: int = Field(ge=0, le=MAX_TIME_US)
    activation: int = Field(ge=0, le=MAX_BYTES)
    stash: int = Field(ge=0, le=MAX_BYTES)
    static: int = Field(ge=0, le=MAX_BYTES)
    send: int = Field(ge=0, le=MAX_BYTES)


class _Train(_Strict):
    microbatches: int = Field(ge=1, le=1_000_000)
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0, le=1e6)
    iterations: int = Field(1, ge=1, le=MAX_ITERATIONS)


class _Schedule(_Strict):
    decouple_backward: bool = True
    stagger_optimizer: bool = True
    solver: str = "cpsat"
    time_limit: float = Field(5.0, gt=0, le=MAX_SECONDS)


class _Recovery(_Strict):
    policy: str = "auto"
    horizon: float = Field(900.0, gt=0, le=MAX_COST_SECONDS)
    checkpoint_every: float = Field(1800.0, gt=0, le=MAX_COST_SECONDS)
    restart_cost: float = Field(30.0, ge=0, le=MAX_COST_SECONDS)
    reconfigure_cost: float = Field(1.0, ge=0, le=MAX_COST_SECONDS)


class _Model(_Strict):
    layers: int | None = Field(None, ge=1, le=100_000)
    hidden: int | None = Field(None, ge=1, le=10**6)
    heads: int | None = Field(None, ge=1, le=10**5)
    seq_len: int | None = Field(None, ge=1, le=10**8)
    vocab: int | None = Field(None, ge=1, le=10**8)
    microbatch_size: int = Field(1, ge=1, le=10**6)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    source: str | None = None
    data: str | None = None



# -- the passes ------------------------------------------------------------------------


def validate(doc: Document, *, name: str | None = None) -> Spec:
    """Turn a parsed document into a validated `Spec`; raise `SpecError` with every problem found."""
    ctx = Collector(doc.file)
    blocks = _top_blocks(ctx, doc)

    cluster = _cluster(ctx, blocks.get("cluster"), doc)
    train = _train(ctx, blocks.get("train"), doc)
    schedule = _schedule(ctx, blocks.get("schedule"))
    recovery = _recovery(ctx, blocks.get("recovery"))
    model = _model(ctx, blocks.get("model"))
    partition = _partition(ctx, blocks.get("partition"), cluster, model)
    failures = _failures(ctx, blocks.get("failures"))

    stages: tuple[StageCosts, ...] | None = None
    costs: Literal["explicit", "derived"] = "explicit"
    if "stages" in blocks:
        stages = _explicit_stages(ctx, blocks["stages"], cluster)
    elif model is not None and all(getattr(model, k) is not None for k in MODEL_REQUIRED):
        costs = "derived"
        stages, partition = _derived_stages(ctx, blocks, cluster, model, train, partition)
    elif "model" not in ctx.bad:
        missing = [k for k in MODEL_REQUIRED if model is None or getattr(model, k) is None]
        span = blocks["model"].name_span if "model" in blocks else None
        if model is not None or "model" in blocks:
            msg = "the model block is incomplete: missing " + ", ".join(f"`{k}`" for k in missing)
        else:
            msg = "the spec has neither a `stages` block nor a `model` block"
        ctx.add(error("E213", msg, span or _doc_span(doc), label="no stage costs",
                      hint="give the costs in `stages { all { forward = 1ms ... } }`, or describe the model: "
                           "`model { layers = 24  hidden = 2048  heads = 16  seq_len = 2048  vocab = 50304 }`"))

    gpus: tuple[Gpu, ...] = ()
    if cluster is not None and failures is not None:
        gpus, diags = resolve_gpus(cluster, failures, block_span=ctx.spans.get("failures"))
        ctx.diags.extend(diags)
    if cluster is not None and stages is not None:
        _check_memory(ctx, cluster, stages, costs)

    if ctx.diags:
        raise spec_error(ctx.diags, {doc.file: display_text(doc.text)})
    assert cluster is not None and train is not None and schedule is not None and stages is not None
    return Spec(cluster=cluster, stages=stages, train=train, schedule=schedule, failures=failures or (),
                gpus=gpus, model=model, partition=partition, costs=costs, recovery=recovery,
                source_name=name or doc.file,
                source_text=display_text(doc.text), spans=MappingProxyType(dict(ctx.spans)))


def _doc_span(doc: Document) -> Span:
    return Span(doc.file, 1, 1, 1, 2)


def _top_blocks(ctx: Collector, doc: Document) -> dict[str, Block]:
    blocks: dict[str, Block] = {}
    for item in doc.items:
        if isinstance(item, Block):
            if item.name not in TOP_BLOCKS:
                ctx.add(unknown_name(item.name, item.name_span, "", (), TOP_BLOCKS, True))
                continue
            if item.name in blocks:
                ctx.add(duplicate(item.name, item.name_span, blocks[item.name].name_span))
                continue
            if item.label is not None and item.name != "model":
                ctx.add(error("E201", f"`{item.name}` takes no label", item.label.span, label="remove this",
                              hint="only `model` has a name: `model \"gpt\" { ... }`"))
                continue
            blocks[item.name] = item
            ctx.spans[item.name] = item.name_span
        else:
            what = f"`{item.key} = ...`" if isinstance(item, Assign) else f"`{item.verb}` statement"
            ctx.add(error("E201", f"{what} must be inside a block", item.span, label="outside any block",
                          hint="the top level holds blocks: " + ", ".join(TOP_BLOCKS)))
    return blocks


def _cluster(ctx: Collector, block: Block | None, doc: Document) -> ClusterSpec | None:
    if block is None:
        ctx.add(error("E203", "missing `cluster` block", _doc_span(doc), label="required",
                      hint="add `cluster { dp = 2  pp = 2  gpu { memory = 80GiB } }`"))
        return None
    read = read_block(ctx, block, "cluster", CLUSTER_KEYS, ("gpu", "link"))
    data = converted(ctx, read, CLUSTER_KEYS, "cluster")
    top = check_model(ctx, _Cluster, data, "cluster", block.name_span)

    gpu_block = read.blocks.get("gpu")
    gpu_data = {}
    if gpu_block is not None:
        gpu_data = converted(ctx, read_block(ctx, gpu_block, "cluster.gpu", GPU_KEYS), GPU_KEYS, "cluster.gpu")
    gpu = check_model(ctx, _Gpu, gpu_data, "cluster.gpu", gpu_block.name_span if gpu_block else block.name_span,
                       missing_hint=lambda k: f"add `{EXAMPLES.get('cluster.gpu.' + k, k)}` to `cluster`")
    link_block = read.blocks.get("link")
    link_data = {}
    if link_block is not None:
        link_data = converted(ctx, read_block(ctx, link_block, "cluster.link", LINK_KEYS), LINK_KEYS,
                               "cluster.link")
    link = check_model(ctx, _Link, link_data, "cluster.link", block.name_span)
    if top is not None and top.gpus_per_node % top.tp:
        ctx.add(error("E206", f"`cluster.tp` ({top.tp}) must divide `cluster.gpus_per_node` ({top.gpus_per_node}): "
                              "a tensor-parallel group sits inside one node", ctx.spans.get("cluster.tp", block.name_span),
                      label="tp does not divide the node",
                      hint="tensor parallelism needs the node's fast links; use tp = 2, 4 or 8 with 8 GPUs per node"))
        top = None
    if top is not None and top.dp * top.pp > MAX_GPUS:
        ctx.add(error("E206", f"the cluster has {top.dp:,} x {top.pp:,} = {top.dp * top.pp:,} GPUs; schedc plans "
                              f"at most {MAX_GPUS:,}", ctx.spans.get("cluster.dp", block.name_span),
                      label="too many GPUs",
                      hint="fold tensor-parallel groups into one GPU of the spec, or plan a part of the job"))
        top = None
    if top is None or gpu is None or link is None:
        return None
    return ClusterSpec(dp=top.dp, pp=top.pp, tp=top.tp, gpus_per_node=top.gpus_per_node, placement=top.placement,
                       gpu=GpuSpec(memory=gpu.memory, flops=gpu.flops, efficiency=gpu.efficiency),
                       link=LinkSpec(latency=link.latency, bandwidth=link.bandwidth))


def _train(ctx: Collector, block: Block | None, doc: Document) -> TrainSpec | None:
    if block is None:
        ctx.add(error("E203", "missing `train` block", _doc_span(doc), label="required",
                      hint="add `train { microbatches = 8 }`"))
        return None
    data = converted(ctx, read_block(ctx, block, "train", TRAIN_KEYS), TRAIN_KEYS, "train")
    t = check_model(ctx, _Train, data, "train", block.name_span)
    return None if t is None else TrainSpec(microbatches=t.microbatches, optimizer=t.optimizer, lr=t.lr,
                                            iterations=t.iterations)


def _schedule(ctx: Collector, block: Block | None) -> ScheduleOptions | None:
    if block is None:
        return ScheduleOptions()
    data = converted(ctx, read_block(ctx, block, "schedule", SCHEDULE_KEYS), SCHEDULE_KEYS, "schedule")
    s = check_model(ctx, _Schedule, data, "schedule", block.name_span)
    return None if s is None else ScheduleOptions(decouple_backward=s.decouple_backward,
                                                  stagger_optimizer=s.stagger_optimizer, solver=s.solver,
                                                  time_limit=s.time_limit)


def _recovery(ctx: Collector, block: Block | None) -> RecoveryOptions | None:
    if block is None:
        return None
    data = converted(ctx, read_block(ctx, block, "recovery", RECOVERY_KEYS), RECOVERY_KEYS, "recovery")
    r = check_model(ctx, _Recovery, data, "recovery", block.name_span)
    return None if r is None else RecoveryOptions(policy=r.policy, horizon=r.horizon,
                                                  checkpoint_every=r.checkpoint_every,
                                                  restart_cost=r.restart_cost, reconfigure_cost=r.reconfigure_cost)


def _model(ctx: Collector, block: Block | None) -> ModelSpec | None:
    if block is None:
        return None
    name = None
    if block.label is not None:
        if block.label.kind != "string":
            ctx.add(error("E205", "a model's name must be a string", block.label.span, label="expected \"...\"",
                          hint=f'write `model "{block.label.text}" {{ ... }}`'))
        else:
            name = block.label.string
            ctx.spans["model.name"] = block.label.span
    read = read_block(ctx, block, "model", MODEL_KEYS)
    data = converted(ctx, read, MODEL_KEYS, "model")
    for key in ("source", "data"):
        if key in data and not _SOURCE_RE.fullmatch(data[key]):
            ctx.add(error("E212", f"`model.{key}` must be `module:callable`, got \"{data[key]}\"",
                          read.values[key].span, label="not module:callable",
                          hint=f'for example `{key} = "schedc.models.mlp:{"build" if key == "source" else "batch"}"`'))
            ctx.bad.add(f"model.{key}")
            del data[key]
    m = check_model(ctx, _Model, data, "model", block.name_span)
    if m is None:
        ctx.bad.add("model")
        return None
    if m.hidden is not None and m.heads is not None and m.hidden % m.heads:
        ctx.add(error("E206", f"`model.hidden` ({m.hidden}) must be a multiple of `model.heads` ({m.heads})",
                      ctx.spans.get("model.heads"), label="does not divide hidden"))
        ctx.bad.add("model")
        return None
    return ModelSpec(name=name, layers=m.layers, hidden=m.hidden, heads=m.heads, seq_len=m.seq_len,
                     vocab=m.vocab, microbatch_size=m.microbatch_size, precision=m.precision,
                     source=m.source, data=m.data)


def _stage_index(ctx: Collector, value: Value | None, span: Span, cluster: ClusterSpec | None, where: str) -> int | None:
    if value is None or value.kind != "number" or value.unit or value.number.denominator != 1:  # type: ignore[union-attr]
        ctx.add(error("E205", f"`stage` in `{where}` needs a whole stage number", value.span if value else span,
                      label="expected a stage number", hint="write `stage 0 { ... }`"))
        return None
    n = int(value.number)  # type: ignore[arg-type]
    if n < 0 or (cluster is not None and n >= cluster.pp):
        bound = f"the cluster has stages 0..{cluster.pp - 1} (pp = {cluster.pp})" if cluster else "stages count from 0"
        ctx.add(error("E214", f"stage {n} does not exist", value.span, label="no such stage", hint=bound))
        return None
    return n


def _explicit_stages(ctx: Collector, block: Block, cluster: ClusterSpec | None) -> tuple[StageCosts, ...] | None:
    base: dict[str, Value] = {}
    overrides: dict[int, tuple[Block, dict[str, Value]]] = {}
    seen_all: Span | None = None
    for item in block.items:
        if isinstance(item, Block) and item.name == "all" and item.label is None:
            if seen_all is not None:
                ctx.add(duplicate("stages.all", item.name_span, seen_all))
                continue
            seen_all = item.name_span
            ctx.spans["stages.all"] = item.name_span
            base = read_block(ctx, item, "stages.all", STAGE_KEYS).values
        elif isinstance(item, Block) and item.name == "stage":
            n = _stage_index(ctx, item.label, item.name_span, cluster, "stages")
            if n is None:
                continue
            if n in overrides:
                ctx.add(duplicate(f"stages.{n}", item.name_span, overrides[n][0].name_span))
                continue
            ctx.spans[f"stages.{n}"] = item.name_span
            overrides[n] = (item, read_block(ctx, item, f"stages.{n}", STAGE_KEYS).values)
        elif isinstance(item, Statement):
            ctx.add(error("E201", f"`{item.verb}` statements belong in the `failures` block", item.span,
                          label="not allowed here"))
        else:
            name = item.key if isinstance(item, Assign) else item.name
            span = item.key_span if isinstance(item, Assign) else item.name_span
            if isinstance(item, Assign) and name in STAGE_KEYS:
                ctx.add(error("E201", f"`{name}` must be inside `all {{ }}` or `stage N {{ }}`", span,
                              label="directly in `stages`", hint=f"write `all {{ {name} = ... }}`"))
            else:
                ctx.add(unknown_name(name, span, "stages", (), ("all", "stage N"), True))
    all_values = {k: convert(ctx, v, STAGE_KINDS[k], f"stages.all.{k}") for k, v in base.items()}
    over_values = {n: {k: convert(ctx, v, STAGE_KINDS[k], f"stages.{n}.{k}") for k, v in vals.items()}
                   for n, (_, vals) in overrides.items()}
    if cluster is None:
        return None
    stages: list[StageCosts] = []
    ok = True
    # (code, span) of what is reported, so a problem of `all` is said once, not per stage, in
    # constant time per stage (a scan of the diagnostics per stage was quadratic in pp).
    reported = {(d.code, d.span) for d in ctx.diags if d.span is not None}
    for s in range(cluster.pp):
        data: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key in STAGE_KEYS:
            if f"stages.all.{key}" in ctx.bad or f"stages.{s}.{key}" in ctx.bad:
                ctx.bad.add(f"stages.{s}.{key}")
            own = over_values.get(s, {})
            if key in own:
                src, val = f"stages.{s}.{key}", own[key]
            elif key in all_values:
                src, val = f"stages.all.{key}", all_values[key]
            else:
                continue
            sources[f"stages.{s}.{key}"] = src
            if src in ctx.spans:
                ctx.spans[f"stages.{s}.{key}"] = ctx.spans[src]
            if val is None:
                ctx.bad.add(f"stages.{s}.{key}")
            else:
                data[key] = val
        # A range error in `all` is reported once, not once per stage.
        before = len(ctx.diags)
        checked = check_model(
            ctx, _Stage, data, f"stages.{s}", ctx.spans.get(f"stages.{s}", block.name_span),
            missing_message=lambda k, s=s: f"stage {s} has no `{k}`",
            missing_hint=lambda k, s=s: f"set `{k}` in `stages {{ all {{ ... }} }}` or in `stage {s} {{ ... }}`",
            sources=sources)
        _dedupe_from_all(ctx, before, reported)
        if checked is None:
            ok = False
            continue
        stage = StageCosts(pp=s, **checked.model_dump())
        if stage.stash > stage.activation:
            span = ctx.spans.get(f"stages.{s}.stash")
            if ("E209", span) not in reported:
                reported.add(("E209", span))
                ctx.add(error("E209", f"stage {s}: `stash` ({human_bytes(stage.stash)}) is larger than `activation` "
                                      f"({human_bytes(stage.activation)})", span, label="stash > activation",
                              hint="stash is the part of a microbatch's activation kept from B to W; "
                                   "it cannot exceed the activation"))
            ok = False
            continue
        stages.append(stage)
    return tuple(stages) if ok else None


def _dedupe_from_all(ctx: Collector, start: int, reported: set) -> None:
    """Drop diagnostics added since `start` that repeat one already reported for the same span (from
    `all`); `reported` holds the (code, span) of those reported, and gains the new ones."""
    fresh = ctx.diags[start:]
    del ctx.diags[start:]
    for d in fresh:
        if d.span is not None:
            if (d.code, d.span) in reported:
                continue
            reported.add((d.code, d.span))
        ctx.diags.append(d)


def _derived_stages(ctx: Collector, blocks: dict[str, Block], cluster: ClusterSpec | None, model: ModelSpec,
                    train: TrainSpec | None, partition):
    from schedc import costmodel

    if cluster is None or train is None or "partition" in ctx.bad:
        return None, partition
    if cluster.tp > 1:
        ctx.add(error("E214", f"the cost model does not model tensor parallelism (tp = {cluster.tp})",
                      ctx.spans.get("cluster.tp", ctx.spans.get("cluster")), label="costs of a TP group unknown",
                      hint="give the stages block: measure a TP group's stage costs (`schedc profile` measures "
                           "what one process runs), or use tp = 1"))
        return None, partition
    if cluster.gpu.flops is None:
        ctx.add(error("E203", "costs derived from `model` need `cluster.gpu.flops`",
                      ctx.spans.get("cluster.gpu", ctx.spans.get("cluster")), label="no flops",
                      hint="add `flops = 312TFLOPS` (peak) and `efficiency = 0.45` to `cluster.gpu`"))
        return None, partition
    assert model.layers is not None
    if partition is None and model.layers < cluster.pp:
        ctx.add(error("E210", f"cannot split {model.layers} layers into {cluster.pp} stages",
                      ctx.spans.get("model.layers"), label="fewer layers than stages",
                      hint="use fewer stages (`cluster.pp`) or a model with more layers"))
        return None, partition
    stages, partition = costmodel.derive_stages(model, cluster, train.optimizer, partition)
    for st in stages:  # the same limits as explicit costs: the planner's arithmetic must hold them
        worst = max(st.forward, st.backward_input, st.backward_weight, st.optimizer)
        if worst > MAX_TIME_US or max(st.activation, st.stash, st.static, st.send) > MAX_BYTES:
            ctx.add(error("E206", f"the model's stage {st.pp} costs {worst / 1e6:.3g} s per op or more than "
                                  "an EiB: beyond what schedc plans", ctx.spans.get("model.layers"),
                          label="derived costs out of range",
                          hint="check the model's sizes and `cluster.gpu.flops`"))
            return None, partition
    return stages, partition


def _partition(ctx: Collector, block: Block | None, cluster: ClusterSpec | None, model: ModelSpec | None):
    if block is None:
        return None
    slices: dict[int, tuple[Value, Assign]] = {}
    for item in block.items:
        if not (isinstance(item, Assign) and item.key == "stage" and item.index is not None):
            span = item.span if isinstance(item, Statement) else (
                item.key_span if isinstance(item, Assign) else item.name_span)
            ctx.add(error("E201", "`partition` holds only `stage N = layers[a:b]`", span,
                          label="not a stage slice", hint="write `stage 0 = layers[0:12]`"))
            ctx.bad.add("partition")
            continue
        n = _stage_index(ctx, item.index, item.key_span, cluster, "partition")
        if n is None:
            ctx.bad.add("partition")
            continue
        if n in slices:
            ctx.add(duplicate(f"partition.{n}", item.key_span, slices[n][1].key_span))
            ctx.bad.add("partition")
            continue
        v = item.value
        if v.kind != "slice" or v.slice_of != "layers":
            ctx.add(type_error(v, f"partition.{n}", "a layer slice `layers[a:b]`"))
            ctx.bad.add("partition")
            continue
        if (v.start is not None and v.start < 0) or (v.stop is not None and v.stop < 0):
            ctx.add(error("E206", "layer slice bounds must be whole numbers >= 0", v.span, label="bad bound"))
            ctx.bad.add("partition")
            continue
        slices[n] = (v, item)
        ctx.spans[f"partition.{n}"] = v.span
    if "partition" in ctx.bad or cluster is None:
        return None
    missing = [s for s in range(cluster.pp) if s not in slices]
    if missing:
        ctx.add(error("E210", "partition has no slice for stage " + ", ".join(map(str, missing)),
                      block.name_span, label="incomplete partition",
                      hint=f"give every stage 0..{cluster.pp - 1} a `stage N = layers[a:b]`"))
        ctx.bad.add("partition")
        return None
    layers = model.layers if model is not None else None
    out: list[tuple[int, int]] = []
    expected = 0
    bad = False
    for s in range(cluster.pp):
        v, _ = slices[s]
        a = v.start if v.start is not None else 0
        b = v.stop if v.stop is not None else layers
        if b is None:
            ctx.add(error("E210", f"stage {s}: `layers[{a}:]` needs `model.layers` to know where it ends",
                          v.span, label="open slice", hint="write both bounds, e.g. `layers[19:24]`"))
            bad = True
            break
        if a >= b:
            ctx.add(error("E210", f"stage {s}: `{v.text}` holds no layer", v.span, label="empty slice",
                          hint="each stage needs at least one layer: layers[a:b] with a < b"))
            bad = True
        elif a > expected:
            ctx.add(error("E210", f"partition leaves layers[{expected}:{a}] in no stage", v.span,
                          label=f"stage {s} starts at layer {a}",
                          hint=f"stage {s} should start where stage {s - 1} ends" if s else
                          "stage 0 should start at layer 0"))
            bad = True
        elif a < expected:
            ctx.add(error("E210", f"layers[{a}:{expected}] are in more than one stage", v.span,
                          label=f"overlaps stage {s - 1}",
                          hint=f"stage {s} should start at layer {expected}, where stage {s - 1} ends"))
            bad = True
        out.append((a, b))
        expected = max(expected, b)
    if not bad and layers is not None and expected != layers:
        v, _ = slices[cluster.pp - 1]
        msg = (f"partition leaves layers[{expected}:{layers}] in no stage" if expected < layers else
               f"partition goes past the model's {layers} layers (to layer {expected})")
        ctx.add(error("E210", msg, v.span, label="the last stage must end at the last layer",
                      hint=f"the model has `layers = {layers}`; the last stage should end with `:{layers}]`"))
        bad = True
    if bad:
        ctx.bad.add("partition")
        return None
    return tuple(out)


# -- failures ------------------------------------------------------------------------


def _failures(ctx: Collector, block: Block | None) -> tuple[Failure, ...] | None:
    if block is None:
        return ()
    failures, diags = failures_from_block(block)
    ctx.diags.extend(diags)
    for i, f in enumerate(failures or ()):
        ctx.spans[f"failures.{i}"] = f.span  # type: ignore[assignment]  # parsed: always has one
    return failures


# -- memory ------------------------------------------------------------------------


def _check_memory(ctx: Collector, cluster: ClusterSpec, stages: Sequence[StageCosts], costs: str) -> None:
    mem = cluster.gpu.memory
    mem_span = ctx.spans.get("cluster.gpu.memory")
    for st in stages:
        where = ctx.spans.get(f"stages.{st.pp}.static") if costs == "explicit" else (
            ctx.spans.get(f"partition.{st.pp}") or ctx.spans.get("model"))
        notes = [Label(mem_span, f"gpu.memory = {human_bytes(mem)}")] if mem_span else []
        if st.static > mem:
            ctx.add(error("E211", f"stage {st.pp}: static memory {human_bytes(st.static)} alone exceeds gpu.memory "
                                  f"{human_bytes(mem)} by {human_bytes(st.static - mem)}", where, label="too large",
                          notes=notes,
                          hint="use more pipeline stages (pp), GPUs with more memory, or a smaller model"))
        elif st.static + st.activation > mem:
            ctx.add(error("E302", f"stage {st.pp}: static {human_bytes(st.static)} + one microbatch's activation "
                                  f"{human_bytes(st.activation)} exceed gpu.memory {human_bytes(mem)} by "
                                  f"{human_bytes(st.static + st.activation - mem)}: no microbatch can run",
                          where, label="no room for a microbatch", notes=notes,
                          hint="use more pipeline stages, smaller microbatches, or GPUs with more memory"))
