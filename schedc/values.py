"""A block's values, read and checked: what `schedc.validate`'s passes stand on.

`read_block` takes a block's assignments and sub-blocks by name (unknown, misplaced or
repeated ones are E201/E202, with "did you mean"); `convert` turns a value into the kind a
key expects, by unit (times to µs, sizes to bytes, rates to bytes/s: E204, E205, E215); and
`check_model` runs a pydantic model for ranges and required keys, turning its errors into
diagnostics at the value's span (E203, E205, E206): a pydantic message is never shown.
Every problem goes to the `Collector`, so that a spec's mistakes are reported together.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

from pydantic import BaseModel, ValidationError

from schedc.diagnostics import Diagnostic, Label, Span, did_you_mean, error
from schedc.parse import FLOPS_UNITS, RATE_UNITS, SIZE_UNITS, TIME_UNITS, Assign, Block, Statement, Value
from schedc.spec import RECOVERY_POLICIES

#: What a key's value must be.
Kind = Literal["int", "float", "time", "seconds", "size", "rate", "flops", "bool", "word", "name", "string"]


# -- units (the tables are the language's, in schedc.parse) -------------------------


_UNIT_TABLES = {"time": TIME_UNITS, "seconds": TIME_UNITS, "size": SIZE_UNITS, "rate": RATE_UNITS,
                "flops": FLOPS_UNITS}
_UNIT_WORDS = {"time": "a time", "seconds": "a time", "size": "a size", "rate": "a bandwidth",
               "flops": "a compute rate"}
_UNIT_EXAMPLES = {"time": "1.2ms", "seconds": "5s", "size": "16MiB", "rate": "25GB/s", "flops": "312TFLOPS"}


def _solver_names() -> list[str]:
    from schedc.solvers import solver_names  # the registry only: no solver module is imported

    return solver_names()


#: Keys whose value is one of a few names (E215 otherwise, with "did you mean").
_CHOICES: dict[str, Callable[[], Sequence[str]]] = {
    "cluster.placement": lambda: ("pipeline_major", "stage_major"),
    "train.optimizer": lambda: ("sgd", "adam", "adamw"),
    "model.precision": lambda: ("bf16", "fp16", "fp32"),
    "schedule.solver": _solver_names,
    "recovery.policy": lambda: RECOVERY_POLICIES,
}

#: What a missing required key could look like (E203's hint).
EXAMPLES = {
    "cluster.dp": "dp = 4", "cluster.pp": "pp = 4", "cluster.gpu.memory": "gpu { memory = 80GiB }",
    "cluster.gpu.flops": "gpu { flops = 312TFLOPS }", "train.microbatches": "train { microbatches = 8 }",
}


# -- the collector -------------------------------------------------------------------


@dataclass
class Collector:
    file: str
    diags: list[Diagnostic] = field(default_factory=list)
    spans: dict[str, Span] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)  # paths whose value was rejected (no "missing" for them)
    texts: dict[str, str] = field(default_factory=dict)  # path -> the value as written

    def add(self, diag: Diagnostic) -> None:
        self.diags.append(diag)


@dataclass
class BlockValues:
    """The assignments and sub-blocks of one block, by name."""

    values: dict[str, Value] = field(default_factory=dict)
    blocks: dict[str, Block] = field(default_factory=dict)


def read_block(ctx: Collector, block: Block, path: str, keys: Iterable[str],
               subblocks: Iterable[str] = ()) -> BlockValues:
    keys, subblocks = tuple(keys), tuple(subblocks)
    out = BlockValues()
    seen: dict[str, Span] = {}
    for item in block.items:
        if isinstance(item, Statement):
            ctx.add(error("E201", f"`{item.verb}` statements belong in the `failures` block, not in `{path}`",
                          item.span, label="not allowed here", hint="move it into `failures { ... }`"))
            continue
        name = item.key if isinstance(item, Assign) else item.name
        name_span = item.key_span if isinstance(item, Assign) else item.name_span
        is_block = isinstance(item, Block)
        if name not in (subblocks if is_block else keys):
            ctx.add(unknown_name(name, name_span, path, keys, subblocks, is_block))
            # A misspelt key is not also reported as missing.
            ctx.bad.update(f"{path}.{m}" for m in difflib.get_close_matches(name, keys, n=1, cutoff=0.6))
            continue
        if isinstance(item, Assign) and item.index is not None:
            ctx.add(error("E201", f"`{name} {item.index.text} = ...` is not allowed in `{path}`", item.span,
                          hint=f"write `{name} = value`"))
            continue
        if is_block and item.label is not None:
            ctx.add(error("E201", f"`{name}` takes no label", item.label.span, label="remove this",
                          hint=f"write `{name} {{ ... }}`"))
            continue
        if name in seen:
            ctx.add(duplicate(f"{path}.{name}", name_span, seen[name]))
            continue
        seen[name] = name_span
        if is_block:
            out.blocks[name] = item
            ctx.spans[f"{path}.{name}"] = item.name_span
        else:
            out.values[name] = item.value
            ctx.spans[f"{path}.{name}"] = item.value.span
            ctx.texts[f"{path}.{name}"] = item.value.text
    return out


def unknown_name(name: str, span: Span, path: str, keys: Sequence[str], subblocks: Sequence[str],
                 is_block: bool) -> Diagnostic:
    what = "block" if is_block else "key"
    suggestion = did_you_mean(name, tuple(keys) + tuple(subblocks))
    known = ", ".join(tuple(keys) + tuple(f"{b} {{ }}" for b in subblocks)) or "nothing"
    where = f" in `{path}`" if path else ""
    if name in subblocks and not is_block:
        return error("E201", f"`{name}` is a block{where}, not a key", span, label="expected `{`",
                     hint=f"write `{name} {{ ... }}`")
    if name in keys and is_block:
        return error("E201", f"`{name}` is a key{where}, not a block", span, label="expected `=`",
                     hint=f"write `{name} = value`")
    return error("E201", f"unknown {what} `{name}`{where}", span, label=suggestion or f"unknown {what}",
                 hint=f"{path or 'a spec'} may contain: {known}")


def duplicate(path: str, span: Span, first: Span) -> Diagnostic:
    return error("E202", f"`{path}` is given twice", span, label="second definition",
                 notes=[Label(first, "first defined here")], hint="remove one of them")


# -- value conversion by kind ----------------------------------------------------------


def convert(ctx: Collector, value: Value, kind: Kind, path: str) -> Any:
    """The Python value of `value` as a `kind`, or None (with a diagnostic) if it is not one."""
    bad = object()
    result: Any = bad
    if kind in _UNIT_TABLES:
        result = _convert_unit(ctx, value, kind, path)
        if result is None:
            result = bad
    elif kind in ("int", "float"):
        if value.kind != "number":
            ctx.add(type_error(value, path, "a number"))
        elif value.unit:
            ctx.add(error("E204", f"`{path}` takes no unit, got `{value.unit}`", value.span,
                          label="remove the unit", hint=f"write `{path.rsplit('.', 1)[-1]} = {value.text[:-len(value.unit)]}`"))
        elif kind == "int" and value.number.denominator != 1:  # type: ignore[union-attr]
            ctx.add(error("E205", f"`{path}` must be a whole number, got `{value.text}`", value.span,
                          label="not a whole number"))
        else:
            result = int(value.number) if kind == "int" else float(value.number)  # type: ignore[arg-type]
    elif kind == "bool":
        if value.kind != "bool":
            ctx.add(type_error(value, path, "`true` or `false`"))
        else:
            result = value.boolean
    elif kind == "word":
        if value.kind not in ("word", "bool"):
            ctx.add(type_error(value, path, "a name"))
        else:
            result = value.text
    elif kind == "name":
        if value.kind in ("word", "bool"):
            result = value.text
        elif value.kind == "string":
            result = value.string
        else:
            ctx.add(type_error(value, path, "a name"))
    elif kind == "string":
        if value.kind != "string":
            ctx.add(type_error(value, path, 'a string in double quotes ("...")'))
        else:
            result = value.string
    if result is bad:
        ctx.bad.add(path)
        return None
    choices = _CHOICES.get(path)
    if choices is not None and result not in choices():
        options = list(choices())
        ctx.add(error("E215", f"unknown {path.rsplit('.', 1)[-1]} `{result}`", value.span,
                      label=did_you_mean(str(result), options) or "not a known choice",
                      hint="choose one of: " + ", ".join(options)))
        ctx.bad.add(path)
        return None
    return result


def type_error(value: Value, path: str, expected: str) -> Diagnostic:
    return error("E205", f"`{path}` expects {expected}, got {value.describe()} `{value.text}`", value.span,
                 label=f"expected {expected}")


def _convert_unit(ctx: Collector, value: Value, kind: str, path: str) -> Any:
    table = _UNIT_TABLES[kind]
    key = path.rsplit(".", 1)[-1]
    if value.kind != "number":
        ctx.add(type_error(value, path, f"{_UNIT_WORDS[kind]} such as `{_UNIT_EXAMPLES[kind]}`"))
        return None
    if not value.unit:
        ctx.add(error("E204", f"missing unit: `{path}` is {_UNIT_WORDS[kind]}", value.span,
                      label="add a unit", hint=f"for example `{key} = {value.text}{_unit_sample(kind)}`; "
                                               f"units: {', '.join(table)}"))
        return None
    if value.unit not in table:
        known = {u.lower(): u for u in table}
        close = known.get(value.unit.lower())
        other = next((w for k, t in _UNIT_TABLES.items() if value.unit in t for w in [_UNIT_WORDS[k]]), None)
        why = f"`{value.unit}` is a unit of {other[2:] if other and other.startswith('a ') else other}" if other \
            else f"unknown unit `{value.unit}`"
        ctx.add(error("E204", f"wrong unit for `{path}`: {why}, but `{key}` is {_UNIT_WORDS[kind]}", value.span,
                      label=f"did you mean `{close}`?" if close else "wrong unit",
                      hint=f"units of {_UNIT_WORDS[kind][2:]}: {', '.join(table)}"))
        return None
    exact = value.number * table[value.unit]  # type: ignore[operator]
    if kind == "seconds":
        return float(exact / 1_000_000)
    if kind == "flops":
        return float(exact)
    # Times in whole µs and sizes in whole bytes; a fraction is rounded up.
    return math.ceil(exact)


def _unit_sample(kind: str) -> str:
    return {"time": "ms", "seconds": "s", "size": "MiB", "rate": "GB/s", "flops": "TFLOPS"}[kind]


def converted(ctx: Collector, read: BlockValues, kinds: dict[str, Kind], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in read.values.items():
        v = convert(ctx, value, kinds[key], f"{path}.{key}")
        if v is not None:
            out[key] = v
    return out


def check_model(ctx: Collector, model_cls: type[BaseModel], data: dict[str, Any], path: str, where: Span | None,
                 *, missing_hint: Callable[[str], str] | None = None,
                 missing_message: Callable[[str], str] | None = None,
                 sources: dict[str, str] | None = None) -> BaseModel | None:
    """Run a pydantic model; turn its errors into diagnostics at the value's span."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            key = ".".join(str(p) for p in err["loc"])
            full = f"{path}.{key}" if path else key
            if full in ctx.bad:
                continue
            shown = (sources or {}).get(full, full)  # e.g. stages.2.send was set in stages.all.send
            ctx.add(_pydantic_diagnostic(err, shown, ctx.spans.get(full) or where, missing_hint, missing_message,
                                         ctx.texts.get(shown)))
        return None


def _pydantic_diagnostic(err: dict, path: str, span: Span | None, missing_hint, missing_message,
                         written: str | None = None) -> Diagnostic:
    kind = err["type"]
    c = err.get("ctx") or {}
    got = err.get("input")
    key = path.rsplit(".", 1)[-1]
    if kind == "missing":
        msg = missing_message(key) if missing_message else f"missing `{path}`"
        hint = missing_hint(key) if missing_hint else f"add `{EXAMPLES.get(path, key + ' = ...')}`"
        return error("E203", msg, span, label="required", hint=hint)
    bounds = {
        "greater_than_equal": ("at least", "ge"), "greater_than": ("greater than", "gt"),
        "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt"),
    }
    if kind in bounds:
        words, name = bounds[kind]
        limit = c.get(name)
        shown = written if written is not None else _show(got)
        if kind == "greater_than_equal" and limit == 0:
            return error("E206", f"`{path}` must not be negative, got {shown}", span, label="negative")
        return error("E206", f"`{path}` must be {words} {limit}, got {shown}", span, label="out of range")
    return error("E205", f"`{path}` has the wrong type of value", span, label="invalid value")


def _show(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)
