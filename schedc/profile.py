"""`schedc profile`: measure a model's stage costs as the generated programs will incur them.

For each stage of the spec's partition, `profile` builds the stage from
`model.source` exactly as a rank does (`schedc.runtime.stagework.StageWork`:
same module, same split of linear layers, same autograd calls), feeds it a
microbatch of `model.data` (the previous stages' output for later stages)
and times F, B (input gradient), W (weight gradient), the full backward and
the optimizer step, after `warmup` untimed rounds, `repeats` times: median
and spread. It measures, per microbatch, the bytes the stage holds from F to
B (`activation`: the graph's saved tensors, the input and the output) and
from B to W (`stash`: what W needs), its static bytes (weights, gradients,
optimizer state) and the boundary bytes it sends. On CUDA the bytes are the
caching allocator's (`torch.cuda.memory_allocated`) and times come from CUDA
events; on the CPU bytes are counted from the tensors kept, distinct storages
once, and times from `time.perf_counter`.

The optimizer cost is the measured step plus, with ``dp > 1``, a ring
all-reduce of the stage's gradients estimated from `cluster.link` (nothing
can measure a network here); the profile says so.

`Profile.stage_costs()` are the spec's `stages` in whole microseconds and
bytes; `Profile.stages_block()` is them as spec text; `Profile.analytic`
are the cost model's figures for the same partition where the spec's
`model` block lets schedc derive them (ratios in `Profile.ratios()`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from schedc.diagnostics import RunError, error
from schedc.spec import STAGE_KEYS, Spec, StageCosts

#: Stage cost keys measured by time (the rest are byte counts).
TIMED = ("forward", "backward_input", "backward_weight", "optimizer")


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one op, in microseconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the repeats lie."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0


@dataclass(frozen=True)
class StageProfile:
    """One stage as measured."""

    pp: int
    layers: tuple[int, int]
    forward: Timing
    backward_input: Timing
    backward_weight: Timing
    backward_full: Timing  # B and W in one backward (a schedule without decoupling)
    optimizer_step: Timing
    allreduce_us: int  # the estimated all-reduce added to the optimizer cost (0 with dp = 1)
    activation: int
    stash: int
    static: int
    send: int
    params: int
    split_layers: int  # linear layers whose weight gradients W computes

    def costs(self) -> StageCosts:
        """This stage's `StageCosts`: median times rounded up to whole microseconds (at least 1)."""
        def us(t: float) -> int:
            return max(1, math.ceil(t))

        return StageCosts(pp=self.pp, forward=us(self.forward.median), backward_input=us(self.backward_input.median),
                          backward_weight=us(self.backward_weight.median),
                          optimizer=us(self.optimizer_step.median) + self.allreduce_us,
                          activation=self.activation, stash=self.stash, static=self.static, send=self.send)


@dataclass(frozen=True)
class Profile:
    """What `profile` measured, stage by stage."""

    spec_name: str
    source: str
    device: str
    device_name: str
    repeats: int
    warmup: int
    memory_from: str  # "the CUDA caching allocator" or "the tensors kept"
    stages: tuple[StageProfile, ...]
    analytic: tuple[StageCosts, ...] | None = None

    def stage_costs(self) -> tuple[StageCosts, ...]:
        return tuple(st.costs() for st in self.stages)

    def stages_block(self) -> str:
        """The measured costs as a `stages { ... }` block of spec text."""
        from schedc.printer import stages_block

        return "\n".join(stages_block(self.stage_costs())) + "\n"

    def ratios(self) -> list[dict[str, float]] | None:
        """Per stage, measured / analytic for every cost key (None where the cost model has no figure)."""
        if self.analytic is None:
            return None
        out = []
        for got, model in zip(self.stage_costs(), self.analytic):
            out.append({k: (getattr(got, k) / getattr(model, k) if getattr(model, k) else math.nan)
                        for k in STAGE_KEYS})
        return out

    def to_json(self) -> dict:
        def timing(t: Timing) -> dict:
            return {"median_us": t.median, "min_us": t.low, "max_us": t.high, "spread": t.spread,
                    "samples": len(t.samples)}

        return {
            "format": "schedc.profile/v1",
            "spec": self.spec_name, "source": self.source, "device": self.device,
            "device_name": self.device_name, "repeats": self.repeats, "warmup": self.warmup,
            "memory_from": self.memory_from,
            "stages": [{
                "pp": st.pp, "layers": list(st.layers), "params": st.params, "split_linear_layers": st.split_layers,
                "forward": timing(st.forward), "backward_input": timing(st.backward_input),
                "backward_weight": timing(st.backward_weight), "backward_full": timing(st.backward_full),
                "optimizer_step": timing(st.optimizer_step), "allreduce_estimate_us": st.allreduce_us,
                "activation": st.activation, "stash": st.stash, "static": st.static, "send": st.send,
                "costs": {k: getattr(st.costs(), k) for k in STAGE_KEYS},
            } for st in self.stages],
            "analytic": None if self.analytic is None else [
                {k: getattr(c, k) for k in STAGE_KEYS} for c in self.analytic],
            "ratios": self.ratios(),
        }


def profile(spec: Spec, *, device: str = "cpu", repeats: int = 10, warmup: int = 3) -> Profile:
    """Measure every stage of `spec`'s model (see the module doc). Raises `RunError` (E5xx)."""
    if repeats < 1 or warmup < 0:
        raise RunError([error("E582", f"profile needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")])
    import torch

    from schedc.runtime.manifest import (DEFAULT_SOURCE, build_layers, call_with_model_args, data_ref_of,
                                         load_callable, model_args_of, spec_folder)

    dev = _device(device)
    model = spec.model
    source = model.source if model and model.source else DEFAULT_SOURCE
    model_args = model_args_of(model)
    search = (spec_folder(spec.source_name),)
    layers, loss_fn, partition = build_layers(source, model_args, spec.partition, spec.pp, search)
    data = load_callable(data_ref_of(source, model.data if model else None), "model.data", search)
    x, target = call_with_model_args(data, model_args, 0, 0, 0)
    clock = _CudaClock(dev) if dev.type == "cuda" else _CpuClock()
    memory = _CudaMemory(dev) if dev.type == "cuda" else _CpuMemory()
    stages = []
    inp = x.to(dev)
    target = target.to(dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(0)
        for s, (a, b) in enumerate(partition):
            last = s == spec.pp - 1
            st, inp = _profile_stage(spec, s, (a, b), layers[a:b], loss_fn if last else None, inp, target,
                                     dev, clock, memory, repeats=repeats, warmup=warmup)
            stages.append(st)
    return Profile(spec_name=spec.source_name, source=source, device=str(dev),
                   device_name=_device_name(dev), repeats=repeats, warmup=warmup,
                   memory_from=memory.what, stages=tuple(stages), analytic=_analytic(spec, partition))


def _profile_stage(spec: Spec, s: int, layers_range, layers, loss_fn, inp, target, dev, clock, memory, *,
                   repeats: int, warmup: int):
    """(the `StageProfile` of stage `s`, its output for the next stage)."""
    import torch

    from schedc.costmodel import ring_allreduce_time
    from schedc.runtime.primitives import _make_optimizer
    from schedc.runtime.stagework import StageWork, run_layers

    work = StageWork(layers, loss_fn, global_microbatches=spec.dp * spec.train.microbatches, device=dev,
                     first_layer=layers_range[0])
    optimizer = _make_optimizer(spec.train.optimizer, work.params, spec.train.lr)
    for p in work.params:  # as the runtime: gradients exist from the start, W adds into them
        p.grad = torch.zeros_like(p)
    received = s > 0
    with torch.no_grad():
        sample_out = run_layers(work.module, inp, layers_range[0])
    grad_template = None if loss_fn is not None else torch.randn_like(sample_out)
    times: dict[str, list[float]] = {k: [] for k in ("F", "B", "W", "BW", "O")}
    activation = stash = 0
    for round_ in range(warmup + repeats):
        keep = round_ >= warmup
        # F, B, W as a decoupled schedule runs them; bytes held after F and after B.
        x = inp.detach().clone() if received else inp
        base = memory.baseline()
        with memory.watch_saved(work):
            t = clock.start()
            out = work.forward(x, target, received=received)
            f_us = clock.stop(t)
        held_f = memory.held(base, [x, out])
        # A fresh output gradient per microbatch, as a rank receives one: W may keep it.
        grad_out = None if grad_template is None else grad_template.clone()
        t = clock.start()
        grad_in, entries = work.backward(out, x, grad_out, wants_input=received, defer_weights=True)
        b_us = clock.stop(t)
        del out, x, grad_out, grad_in  # grad_in is sent upstream: a message, not the stash
        held_b = memory.held_entries(base, entries)
        t = clock.start()
        work.weight(entries)
        w_us = clock.stop(t)
        del entries
        # The same microbatch with B and W in one backward.
        x = inp.detach().clone() if received else inp
        out = work.forward(x, target, received=received)
        t = clock.start()
        work.backward(out, x, grad_template, wants_input=received, defer_weights=False)
        bw_us = clock.stop(t)
        del out, x
        # The optimizer step as the runtime applies it (gradients in place, then step, then zero).
        t = clock.start()
        if optimizer is not None:
            optimizer.step()
            for p in work.params:
                p.grad.zero_()
        o_us = clock.stop(t)
        if keep:
            for key, v in zip(("F", "B", "W", "BW", "O"), (f_us, b_us, w_us, bw_us, o_us)):
                times[key].append(v)
            activation = max(activation, held_f, held_b)  # a microbatch never holds more; stash <= activation
            stash = max(stash, held_b)
    times = {k: [clock.resolve(v) for v in vs] for k, vs in times.items()}
    with torch.no_grad():
        out = run_layers(work.module, inp, layers_range[0]) if loss_fn is None else None
    params = sum(p.numel() for p in work.params)
    static = _static_bytes(work, optimizer)
    send = 0 if out is None else out.numel() * out.element_size()
    grad_bytes = sum(p.numel() * p.element_size() for p in work.params)
    st = StageProfile(
        pp=s, layers=tuple(layers_range),
        forward=_timing(times["F"]), backward_input=_timing(times["B"]), backward_weight=_timing(times["W"]),
        backward_full=_timing(times["BW"]), optimizer_step=_timing(times["O"]),
        allreduce_us=ring_allreduce_time(grad_bytes, spec.cluster),
        activation=activation, stash=stash, static=static, send=send, params=params,
        split_layers=work.split_layers)
    # Free this stage before the next is built (a large model profiled on one GPU).
    work.module.to("cpu")
    del work, optimizer
    return st, out


def _timing(samples: list[float]) -> Timing:
    return Timing(tuple(samples))


def _static_bytes(work, optimizer) -> int:
    from schedc.runtime.weightgrad import held_bytes

    tensors = list(work.params) + [p.grad for p in work.params]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0]
    return held_bytes(tensors)


def _analytic(spec: Spec, partition) -> tuple[StageCosts, ...] | None:
    """The cost model's stages for `partition`, where the spec's model block and GPU allow it."""
    from schedc import costmodel

    m = spec.model
    if m is None or None in (m.layers, m.hidden, m.heads, m.seq_len, m.vocab) or spec.cluster.gpu.flops is None:
        return None
    if partition[-1][1] != m.layers:
        return None  # the partition slices another list than the model block's layers
    stages, _ = costmodel.derive_stages(m, spec.cluster, spec.train.optimizer, tuple(partition))
    return stages


def _device(name: str):
    """The torch device of `--device` (checked as `schedc run` checks it: E580)."""
    import torch

    from schedc.runtime.placement import place

    return torch.device(place(name, "gloo", 1).devices[0])


def _device_name(dev) -> str:
    import platform

    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


class _CpuClock:
    @staticmethod
    def start():
        return time.perf_counter()

    @staticmethod
    def stop(t0) -> float:
        return (time.perf_counter() - t0) * 1e6

    @staticmethod
    def resolve(v) -> float:
        return v


class _CudaClock:
    """CUDA events around each op; read after the device caught up (one sync per read)."""

    def __init__(self, dev):
        import torch

        self.torch = torch
        self.dev = dev

    def start(self):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start):
        end = self.torch.cuda.Event(enable_timing=True)
        end.record()
        return (start, end)

    def resolve(self, pair) -> float:
        start, end = pair
        end.synchronize()
        return start.elapsed_time(end) * 1e3


class _CpuMemory:
    """Bytes held, counted from the tensors kept (distinct storages once, parameters left out)."""

    what = "the tensors kept"

    def __init__(self):
        self._saved: list = []
        self._exclude: set[int] = set()

    def baseline(self) -> int:
        return 0

    def watch_saved(self, work):
        import contextlib

        import torch

        self._exclude = {p.untyped_storage().data_ptr() for p in work.params}
        self._saved = []

        def pack(t):
            self._saved.append(t)
            return t

        @contextlib.contextmanager
        def hooks():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield

        return hooks()

    def held(self, base: int, tensors) -> int:
        from schedc.runtime.weightgrad import held_bytes

        out = held_bytes(list(tensors) + self._saved, self._exclude)
        self._saved = []
        return out

    def held_entries(self, base: int, entries) -> int:
        from schedc.runtime.weightgrad import held_bytes

        return held_bytes([t for _, x, g in entries for t in (x, g)], self._exclude)


class _CudaMemory:
    """Bytes held, from the caching allocator: allocated now minus before the microbatch."""

    what = "the CUDA caching allocator"

    def __init__(self, dev):
        import torch

        self.torch = torch
        self.dev = dev

    def baseline(self) -> int:
        return self.torch.cuda.memory_allocated(self.dev)

    def watch_saved(self, work):
        import contextlib

        return contextlib.nullcontext()

    def held(self, base: int, tensors) -> int:
        return self.torch.cuda.memory_allocated(self.dev) - base

    def held_entries(self, base: int, entries) -> int:
        return self.torch.cuda.memory_allocated(self.dev) - base


def render(p: Profile) -> str:
    """The human report: a table per stage, the comparison with the cost model, the block to paste."""
    lines = [f"profiled {p.spec_name}: model.source {p.source} on {p.device} ({p.device_name}); "
             f"{p.warmup} warm-up + {p.repeats} timed rounds per stage; bytes from {p.memory_from}", ""]
    head = f"{'stage':>5} {'layers':>9} {'params':>11} {'F ms':>9} {'B ms':>9} {'W ms':>9} {'B+W ms':>9} " \
           f"{'full bwd':>9} {'step ms':>9} {'spread':>7} {'activation':>11} {'stash':>11} {'static':>11} {'send':>11}"
    lines.append(head)
    from schedc.printer import human_bytes

    for st in p.stages:
        spread = max(st.forward.spread, st.backward_input.spread, st.backward_weight.spread)
        lines.append(
            f"{st.pp:>5} {f'{st.layers[0]}:{st.layers[1]}':>9} {st.params:>11,} {st.forward.median / 1e3:>9.3f} "
            f"{st.backward_input.median / 1e3:>9.3f} {st.backward_weight.median / 1e3:>9.3f} "
            f"{(st.backward_input.median + st.backward_weight.median) / 1e3:>9.3f} "
            f"{st.backward_full.median / 1e3:>9.3f} {st.optimizer_step.median / 1e3:>9.3f} {spread:>6.0%} "
            f"{human_bytes(st.activation):>11} {human_bytes(st.stash):>11} {human_bytes(st.static):>11} "
            f"{human_bytes(st.send):>11}")
    lines.append("")
    lines.append("spread: (max - min) / median of the timed rounds, the worst of F, B and W. "
                 "stash: bytes held from B to W (what W needs).")
    if any(st.allreduce_us for st in p.stages):
        lines.append("optimizer = the measured step + a ring all-reduce over dp estimated from cluster.link "
                     f"({', '.join(f'{st.allreduce_us} us' for st in p.stages)}).")
    ratios = p.ratios()
    if ratios is not None:
        lines += ["", "measured / cost model (the spec's model block):",
                  f"{'stage':>5} " + " ".join(f"{k:>15}" for k in STAGE_KEYS)]
        for s, r in enumerate(ratios):
            lines.append(f"{s:>5} " + " ".join(f"{r[k]:>15.2f}" for k in STAGE_KEYS))
    lines += ["", "# measured by `schedc profile`; paste into the spec (or run with --write)", p.stages_block()]
    return "\n".join(lines)


def write_stages_block(path, text: str, block: str) -> str:
    """The spec text with its `stages` block replaced by `block` (or `block` appended)."""
    from schedc.parse import normalize_newlines, parse_text

    text = normalize_newlines(text)
    doc = parse_text(text, str(path))
    comment = "# stage costs measured by `schedc profile`\n"
    for item in doc.items:
        if getattr(item, "name", None) == "stages" and hasattr(item, "items"):
            start = _offset(text, item.span.line, item.span.column)
            end = _offset(text, item.span.end_line, item.span.end_column)
            return text[:start] + block.rstrip("\n") + text[end:]
    return text.rstrip("\n") + "\n\n" + comment + block


def _offset(text: str, line: int, col: int) -> int:
    """Index in `text` of 1-based (line, col)."""
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[:line - 1]) + col - 1
