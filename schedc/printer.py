"""`print_spec(spec) -> str`: a validated `Spec` back to spec text.

The output is valid, canonical spec text: `load(print_spec(s)) == s` for
every valid spec (tested on every spec in `specs/` and on Hypothesis specs).
Explicit costs are printed stage by stage in full; derived costs print the
`model` block and the partition they were derived with, so that loading the
text derives the same costs. Values are printed in the largest unit that
keeps them exact (`1.2ms`, `40GiB`, `25GB/s`, `312TFLOPS`).
"""

from __future__ import annotations

import re
from fractions import Fraction

from schedc.failures import describe_failure
from schedc.spec import STAGE_KEYS, STAGE_SIZE_KEYS, Failure, Spec, StageCosts

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(-[A-Za-z0-9_]+)*")


def print_spec(spec: Spec, *, header: str | None = None) -> str:
    """Spec text that loads back to an equal `Spec`. `header` becomes a leading `#` comment."""
    out: list[str] = []
    if header is None:
        header = f"{spec.source_name}, printed by schedc"
    out += [f"# {line}".rstrip() for line in header.splitlines()] + [""]
    if spec.model is not None:
        out += _model(spec) + [""]
    out += _cluster(spec) + [""]
    if spec.costs == "explicit":
        out += stages_block(spec.stages) + [""]
    if spec.partition is not None:
        out.append("partition {")
        out += [f"    stage {s} = layers[{a}:{b}]" for s, (a, b) in enumerate(spec.partition)]
        out += ["}", ""]
    t = spec.train
    out += ["train {", f"    microbatches = {t.microbatches}", f"    optimizer = {t.optimizer}",
            f"    lr = {_float(t.lr)}", f"    iterations = {t.iterations}", "}", ""]
    if spec.failures:
        out.append("failures {")
        out += [f"    {_failure(f)}" for f in spec.failures]
        out += ["}", ""]
    o = spec.schedule
    out += ["schedule {", f"    decouple_backward = {_bool(o.decouple_backward)}",
            f"    stagger_optimizer = {_bool(o.stagger_optimizer)}", f"    solver = {_name(o.solver)}",
            f"    time_limit = {_seconds(o.time_limit)}", "}"]
    if spec.recovery is not None:
        r = spec.recovery
        out += ["", "recovery {", f"    policy = {_name(r.policy)}", f"    horizon = {_seconds(r.horizon)}",
                f"    checkpoint_every = {_seconds(r.checkpoint_every)}",
                f"    restart_cost = {_seconds(r.restart_cost)}",
                f"    reconfigure_cost = {_seconds(r.reconfigure_cost)}", "}"]
    return "\n".join(out) + "\n"


def _model(spec: Spec) -> list[str]:
    m = spec.model
    assert m is not None
    head = f"model {_string(m.name)} {{" if m.name is not None else "model {"
    lines = [head]
    for key in ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch_size"):
        value = getattr(m, key)
        if value is not None:
            lines.append(f"    {key} = {value}")
    lines.append(f"    precision = {m.precision}")
    for key in ("source", "data"):
        value = getattr(m, key)
        if value is not None:
            lines.append(f"    {key} = {_string(value)}")
    return lines + ["}"]


def _cluster(spec: Spec) -> list[str]:
    c = spec.cluster
    gpu = [f"memory = {format_size(c.gpu.memory)}"]
    if c.gpu.flops is not None:
        gpu.append(f"flops = {format_flops(c.gpu.flops)}")
    if c.gpu.efficiency is not None:
        gpu.append(f"efficiency = {_float(c.gpu.efficiency)}")
    return ["cluster {", f"    dp = {c.dp}", f"    pp = {c.pp}", *([f"    tp = {c.tp}"] if c.tp != 1 else []),
            f"    gpus_per_node = {c.gpus_per_node}",
            f"    placement = {c.placement}", f"    gpu {{ {'  '.join(gpu)} }}",
            f"    link {{ latency = {format_time(c.link.latency)}  bandwidth = {format_rate(c.link.bandwidth)} }}",
            "}"]


def stages_block(stages: tuple[StageCosts, ...]) -> list[str]:
    """A `stages` block for `stages`, as lines: an `all { ... }` of each key's most common
    value, then `stage N { ... }` with only the keys where stage N differs. Equal stages take
    one line each way, so 8,192 of them print in a few hundred bytes, not megabytes."""
    def fmt(k: str, v: int) -> str:
        return f"{k} = {format_size(v) if k in STAGE_SIZE_KEYS else format_time(v)}"

    common = {}
    for k in STAGE_KEYS:
        values = [getattr(st, k) for st in stages]
        common[k] = max(sorted(set(values)), key=values.count)  # ties: the smallest, deterministic
    times = "  ".join(fmt(k, common[k]) for k in STAGE_KEYS if k not in STAGE_SIZE_KEYS)
    sizes = "  ".join(fmt(k, common[k]) for k in STAGE_SIZE_KEYS)
    lines = ["stages {", "    all {", f"        {times}", f"        {sizes}", "    }"]
    for st in stages:
        differ = [fmt(k, getattr(st, k)) for k in STAGE_KEYS if getattr(st, k) != common[k]]
        if differ:
            lines.append(f"    stage {st.pp} {{ {'  '.join(differ)} }}")
    return lines + ["}"]


def _failure(f: Failure) -> str:
    return describe_failure(f)


# -- values ------------------------------------------------------------------------


def _decimal(x: Fraction) -> str | None:
    """Exact short decimal text of `x` (at most 6 decimals), or None."""
    for digits in range(7):
        scaled = x * 10**digits
        if scaled.denominator == 1:
            n = scaled.numerator
            if digits == 0:
                return str(n)
            sign = "-" if n < 0 else ""
            s = str(abs(n)).rjust(digits + 1, "0")
            return f"{sign}{s[:-digits]}.{s[-digits:]}".rstrip("0").rstrip(".")
    return None


def format_time(us: int) -> str:
    """Integer microseconds as `20us`, `1.2ms` or `5s` (exact)."""
    if us >= 1_000_000 and us % 100_000 == 0:
        return f"{_decimal(Fraction(us, 1_000_000))}s"
    if us >= 1000:
        return f"{_decimal(Fraction(us, 1000))}ms"
    return f"{us}us"


def format_size(n: int) -> str:
    """Integer bytes in the largest binary unit that keeps them whole (`40GiB`, `16MiB`, `123B`)."""
    for unit, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def human_bytes(n: int) -> str:
    """Approximate size for messages and tables (`1.5GiB`); `format_size` is the exact one."""
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.2f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"


def format_rate(n: int) -> str:
    """Integer bytes/s as `25GB/s`, `10GiB/s` or `123B/s` (exact)."""
    for unit, f in (("TB", 10**12), ("GB", 10**9), ("TiB", 2**40), ("GiB", 2**30), ("MB", 10**6),
                    ("MiB", 2**20), ("KB", 10**3), ("KiB", 2**10)):
        if n % f == 0:
            return f"{n // f}{unit}/s"
    return f"{n}B/s"


def format_flops(x: float) -> str:
    """FLOP/s as `312TFLOPS` when exact, else the float's shortest repr in FLOPS."""
    for unit, f in (("PFLOPS", 10**15), ("TFLOPS", 10**12), ("GFLOPS", 10**9)):
        text = _decimal(Fraction(x) / f)
        if x >= f and text is not None and float(Fraction(text) * f) == x:
            return f"{text}{unit}"
    return f"{_float(x)}FLOPS"


def _float(x: float) -> str:
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def _seconds(x: float) -> str:
    return f"{_float(x)}s"


def _bool(b: bool) -> str:
    return "true" if b else "false"


def _string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def _name(s: str) -> str:
    return s if _NAME_RE.fullmatch(s) and s not in ("true", "false") else _string(s)
