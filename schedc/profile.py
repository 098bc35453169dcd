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

Two refusals (docs/profile.md): a spec that names no `model.source` has no
model to measure (E584; schedc's stand-in MLP is profiled only when named),
and a figure whose median stays over `NOISE_RATIO` times its fastest repeat
after `MAX_PASSES` passes of timed rounds is not offered as a cost (E585:
`Profile.noisy` says which; `stage_costs()` and `stages_block()` raise).
The clock is a seam (`profile(..., clock=...)`): tests make it noisy.
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
#: A timed figure is noisy when its median is over this many times its fastest repeat: at
#: least half the repeats ran that much slower than the op can run, i.e. another job had the
#: CPU or GPU (a median is what the block offers; one slow repeat alone does not move it).
#: On an idle GPU the repeats lie within 2% of each other (docs/profile.md); under load a
#: 0.13 ms CPU op showed a 79 ms median. 2x catches a median that load has doubled. Re-measure:
#: `python bench/profile_models.py --quick` (and `--device cuda`) prints the worst
#: median/fastest; on an idle machine it must stay well under this.
NOISE_RATIO = 2.0
#: ... and over the fastest by more than this many microseconds: a step that does almost
#: nothing (no optimizer: ~1 us) sits at the timer's grain, where 2x means nothing, and an
#: error this small is below what a plan's link latencies already blur.
NOISE_FLOOR_US = 50.0
#: Passes of `repeats` timed rounds a stage gets at most: the first, then more while a figure
#: is noisy (the samples pool, so a burst of load in one pass is outvoted by the quiet ones).
MAX_PASSES = 3


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

    @property
    def noisy(self) -> bool:
        """The median is over `NOISE_RATIO` x the fastest repeat (and `NOISE_FLOOR_US` above it):
        not a figure to plan with."""
        return self.median > NOISE_RATIO * self.low and self.median - self.low > NOISE_FLOOR_US


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
    passes: int = 1  # passes of timed rounds: more than 1 when a figure was noisy (`MAX_PASSES`)

    def offered(self) -> dict[str, Timing]:
        """The timings that become costs, by cost key (the full backward is for comparison only)."""
        return {"forward": self.forward, "backward_input": self.backward_input,
                "backward_weight": self.backward_weight, "optimizer": self.optimizer_step}

    def noisy(self) -> tuple[str, ...]:
        """The cost keys whose timing is noisy (`Timing.noisy`)."""
        return tuple(k for k, t in self.offered().items() if t.noisy)

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

    @property
    def noisy(self) -> tuple[tuple[int, str], ...]:
        """(stage, cost key) of every figure still noisy after `MAX_PASSES` passes."""
        return tuple((st.pp, k) for st in self.stages for k in st.noisy())

    def noise_error(self) -> RunError | None:
        """E585 naming the noisy figures, or None when every figure can be offered."""
        if not self.noisy:
            return None
        by_stage = {st.pp: st for st in self.stages}
        what = "; ".join(
            f"stage {s} {k}: median {by_stage[s].offered()[k].median / 1e3:.3f} ms, fastest "
            f"{by_stage[s].offered()[k].low / 1e3:.3f} ms" for s, k in self.noisy)
        passes = max(st.passes for st in self.stages)
        return RunError([error(
            "E585", f"measurements too noisy to offer as costs after {passes} pass(es) of {self.repeats} rounds: "
                    f"{what}",
            hint=f"a median over {NOISE_RATIO:g}x the fastest repeat means another job had the "
                 f"{'GPU' if self.device.startswith('cuda') else 'CPU'} most of the time: profile again on an "
                 "idle machine (or pin it to free cores, e.g. `taskset -c 2,3 schedc profile ...`), "
                 "with more --repeats; the table shows what was measured")])

    def stage_costs(self) -> tuple[StageCosts, ...]:
        """The measured costs; E585 (`noise_error`) when a figure is noisy."""
        problem = self.noise_error()
        if problem is not None:
            raise problem
        return tuple(st.costs() for st in self.stages)

    def stages_block(self) -> str:
        """The measured costs as a `stages { ... }` block of spec text (E585 when a figure is noisy)."""
        from schedc.printer import stages_block

        return "\n".join(stages_block(self.stage_costs())) + "\n"

    def ratios(self) -> list[dict[str, float]] | None:
        """Per stage, measured / analytic for every cost key (None where the cost model has no figure)."""
        if self.analytic is None:
            return None
        out = []
        for got, model in zip((st.costs() for st in self.stages), self.analytic):
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
                "passes": st.passes, "noisy": list(st.noisy()),
            } for st in self.stages],
            "analytic": None if self.analytic is None else [
                {k: getattr(c, k) for k in STAGE_KEYS} for c in self.analytic],
            "ratios": self.ratios(),
        }


def profile(spec: Spec, *, device: str = "cpu", repeats: int = 10, warmup: int = 3, clock=None) -> Profile:
    """Measure every stage of `spec`'s model (see the module doc). Raises `RunError` (E5xx).

    `clock`: what times the ops (default: CUDA events on a GPU, `time.perf_counter` on the
    CPU); an object with `start(op) -> token`, `stop(token) -> raw` and `resolve(raw) -> us`,
    where op is one of F, B, W, BW, O."""
    from schedc.limits import MAX_ROUNDS, count_problem

    problems = [p for p in (count_problem(repeats, "--repeats", 1, MAX_ROUNDS),
                            count_problem(warmup, "--warmup", 0, MAX_ROUNDS)) if p]
    if problems:
        raise RunError([error("E582", p) for p in problems])
    _check_model(spec)
    import torch

    from schedc.runtime.manifest import (build_layers, call_with_model_args, data_ref_of, load_callable,
                                         model_args_of, spec_folder)

    dev = _device(device)
    model = spec.model
    source = model.source
    model_args = model_args_of(model)
    search = (spec_folder(spec.source_name),)
    layers, loss_fn, partition = build_layers(source, model_args, spec.partition, spec.pp, search)
    data = load_callable(data_ref_of(source, model.data if model else None), "model.data", search)
    x, target = call_with_model_args(data, model_args, 0, 0, 0)
    if clock is None:
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


def _check_model(spec: Spec) -> None:
    """E584 when the spec names no model: there is nothing of the user's to measure.

    A run of such a spec trains schedc's stand-in MLP, whose costs say nothing about the
    `stages` the spec declares (specs/example.sched models a large model): offering them as
    the spec's costs would overwrite its figures with a toy's. Naming the stand-in
    (`source = "schedc.models.mlp:build"`) profiles it on purpose."""
    from schedc.runtime.manifest import DEFAULT_SOURCE

    if spec.model is not None and spec.model.source:
        return
    block = spec.span("model")
    where = "its `model` block has no `source`" if block else "it has no `model` block"
    raise RunError([error(
        "E584", f"nothing to profile: `{spec.source_name}` names no model ({where})", block,
        label="no `source` here",
        hint='name your model in the spec: `model { source = "mypkg.model:build"  data = "mypkg.model:batch" }` '
             "(build() returns (layers, loss_fn), batch(iteration, dp, microbatch) returns (input, target); "
             f"docs/profile.md); to time schedc's stand-in MLP, name it: `source = \"{DEFAULT_SOURCE}\"`")])


def _profile_stage(spec: Spec, s: int, layers_range, layers, loss_fn, inp, target, dev, clock, memory, *,
                   repeats: int, warmup: int):
    """(the `StageProfile` of stage `s`, its output for the next stage)."""
    import torch

    from schedc.costmodel import ring_allreduce_time
    from schedc.runtime.primitives import make_optimizer
    from schedc.runtime.stagework import StageWork, run_layers

    work = StageWork(layers, loss_fn, global_microbatches=spec.dp * spec.train.microbatches, device=dev,
                     first_layer=layers_range[0])
    optimizer = make_optimizer(spec.train.optimizer, work.params, spec.train.lr)
    for p in work.params:  # as the runtime: gradients exist from the start, W adds into them
        p.grad = torch.zeros_like(p)
    received = s > 0
    with torch.no_grad():
        sample_out = run_layers(work.module, inp, layers_range[0])
    grad_template = None if loss_fn is not None else torch.randn_like(sample_out)
    raw: dict[str, list] = {k: [] for k in OPS}
    times: dict[str, list[float]] = {k: [] for k in OPS}
    held = [0, 0]  # the most one microbatch held after F and after B (a microbatch never holds more)

    def one_round(keep: bool) -> None:
        # F, B, W as a decoupled schedule runs them; bytes held after F and after B.
        x = inp.detach().clone() if received else inp
        base = memory.baseline()
        with memory.watch_saved(work):
            t = clock.start("F")
            out = work.forward(x, target, received=received)
            f_us = clock.stop(t)
        held_f = memory.held(base, [x, out])
        # A fresh output gradient per microbatch, as a rank receives one: W may keep it.
        grad_out = None if grad_template is None else grad_template.clone()
        t = clock.start("B")
        grad_in, entries = work.backward(out, x, grad_out, wants_input=received, defer_weights=True)
        b_us = clock.stop(t)
        del out, x, grad_out, grad_in  # grad_in is sent upstream: a message, not the stash
        held_b = memory.held_entries(base, entries)
        t = clock.start("W")
        work.weight(entries)
        w_us = clock.stop(t)
        del entries
        # The same microbatch with B and W in one backward.
        x = inp.detach().clone() if received else inp
        out = work.forward(x, target, received=received)
        t = clock.start("BW")
        work.backward(out, x, grad_template, wants_input=received, defer_weights=False)
        bw_us = clock.stop(t)
        del out, x
        # The optimizer step as the runtime applies it (gradients in place, then step, then zero).
        t = clock.start("O")
        if optimizer is not None:
            optimizer.step()
            for p in work.params:
                p.grad.zero_()
        o_us = clock.stop(t)
        if keep:
            for key, v in zip(OPS, (f_us, b_us, w_us, bw_us, o_us)):
                raw[key].append(v)
            held[0] = max(held[0], held_f, held_b)  # stash <= activation
            held[1] = max(held[1], held_b)

    for _ in range(warmup):
        one_round(keep=False)
    passes = 0
    while True:
        passes += 1
        for _ in range(repeats):
            one_round(keep=True)
        for key in OPS:  # (on CUDA, resolving waits for the device)
            times[key] += [clock.resolve(v) for v in raw[key][len(times[key]):]]
        offered = [_timing(times[k]) for k in ("F", "B", "W", "O")]
        if passes >= MAX_PASSES or not any(t.noisy for t in offered):
            break
    activation, stash = held
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
        split_layers=work.split_layers, passes=passes)
    # Free this stage before the next is built (a large model profiled on one GPU); the rest
    # goes with this call's frame (and `one_round`, which holds it).
    work.module.to("cpu")
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


#: The ops a round times, in order: F, B and W decoupled, B+W in one backward, the optimizer step.
OPS = ("F", "B", "W", "BW", "O")


class _CpuClock:
    @staticmethod
    def start(op: str = ""):
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

    def start(self, op: str = ""):
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
        noisy = st.noisy()
        lines.append(
            f"{st.pp:>5} {f'{st.layers[0]}:{st.layers[1]}':>9} {st.params:>11,} {st.forward.median / 1e3:>9.3f} "
            f"{st.backward_input.median / 1e3:>9.3f} {st.backward_weight.median / 1e3:>9.3f} "
            f"{(st.backward_input.median + st.backward_weight.median) / 1e3:>9.3f} "
            f"{st.backward_full.median / 1e3:>9.3f} {st.optimizer_step.median / 1e3:>9.3f} {spread:>6.0%} "
            f"{human_bytes(st.activation):>11} {human_bytes(st.stash):>11} {human_bytes(st.static):>11} "
            f"{human_bytes(st.send):>11}" + (f"  NOISY: {', '.join(noisy)}" if noisy else ""))
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
    remeasured = [st.pp for st in p.stages if st.passes > 1]
    if remeasured:
        lines.append(f"re-measured (a median over {NOISE_RATIO:g}x its fastest repeat): stage(s) "
                     f"{', '.join(map(str, remeasured))}, up to {MAX_PASSES} passes of {p.repeats} rounds.")
    if p.noisy:  # no block to paste: `schedc profile` then fails with E585 (`Profile.noise_error`)
        lines += ["", "no stages block: the figures marked NOISY are not fit to plan with", ""]
        return "\n".join(lines)
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
