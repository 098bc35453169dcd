"""What `schedc check` prints: a short readable summary of a valid `Spec`, or its JSON form."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from schedc.failures import describe_failure
from schedc.printer import format_rate, format_size, format_time, human_bytes
from schedc.spec import Spec


def _gpu_line(g) -> str:
    return f"rank {g.rank} (dp={g.dp}, pp={g.pp}, node {g.node})"


def summarize(spec: Spec) -> str:
    """A few lines saying what the spec means: GPUs, per-stage costs and memory, options."""
    c, t, o = spec.cluster, spec.train, spec.schedule
    failed = [g for g in spec.gpus if not g.live]
    slow = [g for g in spec.gpus if g.live and g.speed < 1.0]
    nodes = c.nodes
    out = [f"{spec.source_name}: valid spec"]
    if spec.costs == "derived":
        model = spec.model.name if spec.model is not None and spec.model.name else "the model block"
        origin = f"costs derived from {model}"
    else:
        origin = "explicit costs"
        m = spec.model
        if m is not None and None not in (m.layers, m.hidden, m.heads, m.seq_len, m.vocab):
            origin += ("; the `stages` block wins over the costs the `model` block would give "
                       "(that block still sizes the model the programs and `schedc profile` build)")
    if c.tp > 1:
        out.append(f"cluster: dp={c.dp} pp={c.pp} tp={c.tp}, {c.devices} GPUs as {c.world_size} tensor-parallel "
                   f"groups of {c.tp} on {nodes} node{'s' * (nodes != 1)} of {c.gpus_per_node}, placement "
                   f"{c.placement}")
    else:
        out.append(f"cluster: dp={c.dp} pp={c.pp}, {c.world_size} GPUs on {nodes} node{'s' * (nodes != 1)} "
                   f"of {c.gpus_per_node}, placement {c.placement}")
    gpu = f"gpu memory {format_size(c.gpu.memory)}"
    if c.gpu.flops is not None:
        gpu += f", {c.gpu.flops / 1e12:g} TFLOPS peak"
    if c.gpu.efficiency is not None:
        gpu += f" at efficiency {c.gpu.efficiency:g}"
    out.append(f"  {gpu}; link latency {format_time(c.link.latency)}, bandwidth {format_rate(c.link.bandwidth)}")
    unit = f"TP groups of {c.tp} GPUs" if c.tp > 1 else "GPUs"
    out.append(f"{unit}: {len(spec.gpus)} total, {len(spec.gpus) - len(failed)} live, {len(failed)} failed, "
               f"{len(slow)} slow")
    for g in failed:
        out.append(f"  failed  {_gpu_line(g)}")
    for g in slow:
        out.append(f"  slow    {_gpu_line(g)} speed {g.speed:g}")
    if spec.failures:
        out.append("failures: " + "; ".join(describe_failure(f) for f in spec.failures))
    out.append(f"stages ({origin}):")
    header = ["stage", "layers", "F", "B", "W", "O", "activation", "stash", "static", "send", "live", "fits"]
    rows = [header]
    for st in spec.stages:
        live = sum(1 for g in spec.gpus if g.pp == st.pp and g.live)
        layers = f"{spec.partition[st.pp][0]}:{spec.partition[st.pp][1]}" if spec.partition else "-"
        room = c.gpu.memory - st.static
        fits = "-" if st.activation == 0 else str(room // st.activation)
        rows.append([str(st.pp), layers, format_time(st.forward), format_time(st.backward_input),
                     format_time(st.backward_weight), format_time(st.optimizer), human_bytes(st.activation),
                     human_bytes(st.stash), human_bytes(st.static), human_bytes(st.send), f"{live}/{c.dp}", fits])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        out.append("  " + "  ".join(cell.rjust(w) if i else cell.ljust(w)
                                    for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    out.append("  (fits: microbatches whose activations fit beside the static memory)")
    out.append(f"train: {t.microbatches} microbatches per pipeline ({t.microbatches * c.dp} per iteration), "
               f"optimizer {t.optimizer}, lr {t.lr:g}, iterations {t.iterations}")
    out.append(f"schedule: solver {o.solver}, time_limit {o.time_limit:g}s, "
               f"decouple_backward {str(o.decouple_backward).lower()}, "
               f"stagger_optimizer {str(o.stagger_optimizer).lower()}")
    if spec.model is not None and (spec.model.source or spec.model.data):
        out.append(f"model code: source {spec.model.source or '-'}, data {spec.model.data or '-'}")
    if spec.recovery is not None:
        r = spec.recovery
        out.append(f"recovery: policy {r.policy}, horizon {r.horizon:g}s, checkpoint_every {r.checkpoint_every:g}s, "
                   f"restart_cost {r.restart_cost:g}s, reconfigure_cost {r.reconfigure_cost:g}s")
    return "\n".join(out) + "\n"


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    """The resolved spec as plain JSON-able data (integers in µs and bytes, as in schedule.json)."""
    failures = []
    for f in spec.failures:
        d = {k: v for k, v in asdict(f).items() if v is not None and k != "span"}
        d["text"] = describe_failure(f)
        if f.span is not None:
            d["line"] = f.span.line
        failures.append(d)
    return {
        "source": spec.source_name,
        "costs": spec.costs,
        "dp": spec.dp,
        "pp": spec.pp,
        "microbatches": spec.microbatches,
        "cluster": asdict(spec.cluster),
        "stages": [asdict(s) for s in spec.stages],
        "gpus": [asdict(g) for g in spec.gpus],
        "failures": failures,
        "train": asdict(spec.train),
        "schedule": asdict(spec.schedule),
        "model": None if spec.model is None else asdict(spec.model),
        "partition": None if spec.partition is None else [list(p) for p in spec.partition],
        "recovery": None if spec.recovery is None else asdict(spec.recovery),
    }
