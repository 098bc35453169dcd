"""Availability traces: how many GPUs a job had over time, and which ones, for `schedc replay`.

A trace is CSV text, one row per change: ``seconds,available`` (seconds from
the start, instances up), an optional header line (any row whose first field
is not a number, on the first line only), ``#`` comments and blank lines
allowed. Times must not decrease. One instance holds `per_instance` GPUs (1
unless told otherwise).

A trace says how many instances are up, not which. `availability` picks them,
seeded so that a replay is repeatable and figures compare across tools: when
the count drops, the lost instances are drawn uniformly at random among the
live ones; when it rises, the returning ones uniformly at random among the
lost ones. Instance `i` holds GPUs (ranks of the job's own layout)
``i * per_instance`` to ``i * per_instance + per_instance - 1``.

Problems are diagnostics with the trace's file:line:col: E640 (cannot read),
E641 (a row that is not two numbers), E642 (time going back, a negative
count), E643 (more GPUs than the job has), E644 (no rows, or none after the first
row's time).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from schedc.diagnostics import SpecError, Span, error

#: Largest trace file read (a trace of a year with a change a second is ~ 400 MB; 64 MiB holds years of
#: real spot traces, whose changes come minutes apart).
#: The latest time a trace row may have (seconds): a replay's totals stay finite numbers.
MAX_TRACE_SECONDS = 1e12
MAX_TRACE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Trace:
    """`rows`: (seconds from the start, instances available), times non-decreasing. `lines`: the
    line of each row in `text` (kept so that a later check, E643, can point at the row)."""

    name: str
    rows: tuple[tuple[float, int], ...]
    lines: tuple[int, ...] = field(default=(), compare=False, repr=False)
    text: str = field(default="", compare=False, repr=False)

    @property
    def duration_s(self) -> float:
        return self.rows[-1][0] - self.rows[0][0]

    @property
    def most(self) -> int:
        return max(n for _, n in self.rows)


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace file (see the module docstring); `SpecError` on a bad one."""
    name = str(path)
    try:
        p = Path(path)
        if p.is_dir():
            raise IsADirectoryError(0, "it is a directory")
        if p.stat().st_size > MAX_TRACE_BYTES:
            raise SpecError([error("E640", f"trace `{name}` is over {MAX_TRACE_BYTES // 2**20} MiB",
                                   hint="resample it to the changes only: one row per change of the count")])
        data = p.read_bytes()
    except SpecError:
        raise
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise SpecError([error("E640", f"cannot read trace `{name}`: {why}",
                               hint="give the path of a CSV file of `seconds,available` rows")]) from None
    try:
        text = data.decode("utf-8-sig")  # a spreadsheet's CSV may start with a BOM
    except UnicodeDecodeError as exc:
        raise SpecError([error("E641", f"trace `{name}` is not UTF-8 text (byte {exc.start})",
                               hint="a trace is CSV text: `seconds,available` rows")]) from None
    return parse_trace(text, name)


def parse_trace(text: str, name: str = "<trace>") -> Trace:
    rows: list[tuple[float, int]] = []
    lines: list[int] = []
    diags = []
    seen_data = False
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        col = raw.index(line[0]) + 1
        span = Span(name, n, col, n, col + len(line))
        if not seen_data and len(fields) == 2 and not _is_number(fields[0]) and not _is_number(fields[1]):
            seen_data = True  # the header line
            continue
        seen_data = True
        if len(fields) != 2:
            diags.append(error("E641", f"a trace row has {len(fields)} field(s), not 2", span,
                               label="expected `seconds,available`", hint="write one change per row, e.g. `3600,12`"))
        else:
            t, c = _number(fields[0]), _count(fields[1])
            if t is None or c is None:
                bad = 0 if t is None else 1
                fcol = _field_column(raw, col, bad)
                what = "time" if bad == 0 else "count"
                kind = "a time in seconds" if bad == 0 else "a whole count of instances"
                diags.append(error(
                    "E641", f"`{fields[bad]}` is not {kind}" if fields[bad] else f"a trace row has no {what}",
                    Span(name, n, fcol, n, fcol + max(1, len(fields[bad]))),
                    label=("not a number" if bad == 0 else "not a whole number") if fields[bad] else f"{what} missing",
                    hint="rows are `seconds,available`: a time (e.g. 3600 or 3600.5) and a count (e.g. 12)"))
            elif t < 0 or c < 0:
                diags.append(error("E642", f"a trace row has a negative {'time' if t < 0 else 'count'}", span,
                                   label="negative", hint="times count seconds from the start; counts are >= 0"))
            elif t > MAX_TRACE_SECONDS:
                diags.append(error("E642", f"time {fields[0]} s is past {MAX_TRACE_SECONDS:g} s (over 30,000 years)",
                                   span, label="too late", hint="times count seconds from the trace's start"))
            elif rows and t < rows[-1][0]:
                diags.append(error("E642", f"time {fields[0]} s comes before the previous row's {rows[-1][0]:g} s",
                                   span, label="time goes back", hint="sort the rows by time"))
            else:
                rows.append((t, c))
                lines.append(n)
        if len(diags) >= 20:
            break
    if diags:
        raise SpecError(diags, {name: text})
    if not rows:
        raise SpecError([error("E644", f"trace `{name}` has no rows",
                               hint="a trace needs at least one `seconds,available` row")])
    if rows[-1][0] == rows[0][0]:  # a replay of no time would report 0 of 0 samples
        n = lines[-1]
        raw = text.splitlines()[n - 1]
        line = raw.split("#", 1)[0].strip()
        col = raw.index(line[0]) + 1
        raise SpecError([error("E644", f"trace `{name}` spans no time: every row is at {rows[0][0]:g} s",
                               Span(name, n, col, n, col + len(line)), label="the last row",
                               hint="a replay runs from the first row's time to the last row's: end the trace "
                                    f"with a later row, e.g. `{rows[0][0] + 3600:g},{rows[-1][1]}`")], {name: text})
    return Trace(name, tuple(rows), tuple(lines), text)


def _field_column(raw: str, col: int, k: int) -> int:
    """1-based column of field `k` (0 or 1) of a row that starts at column `col` of `raw` (an empty
    field: where it would be). Searched after the comma, so that `1.5,1.5` points at the second."""
    start = col - 1 if k == 0 else raw.index(",", col - 1) + 1
    rest = raw[start:]
    return start + (len(rest) - len(rest.lstrip())) + 1


def _is_number(s: str) -> bool:
    return _number(s) is not None


def _number(s: str) -> float | None:
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _count(s: str) -> int | None:
    v = _number(s)
    return int(v) if v is not None and v == int(v) else None


def check_fits(trace: Trace, gpus: int, per_instance: int, spec_name: str) -> None:
    """E643 when the trace has more GPUs up at once than the job has (pointing at the first row
    with too many, when the trace was parsed from text)."""
    if trace.most * per_instance > gpus:
        span, sources = None, {}
        if trace.lines and trace.text:
            i = next(k for k, (_, c) in enumerate(trace.rows) if c * per_instance > gpus)
            n = trace.lines[i]
            raw = trace.text.splitlines()[n - 1]
            line = raw.split("#", 1)[0].strip()
            col = _field_column(raw, raw.index(line[0]) + 1, 1)
            width = len(line.split(",", 1)[1].strip())
            span, sources = Span(trace.name, n, col, n, col + max(1, width)), {trace.name: trace.text}
        raise SpecError([error(
            "E643", f"trace `{trace.name}` has {trace.most} instance(s) x {per_instance} GPU(s) up at once, "
                    f"more than the {gpus} GPUs of `{spec_name}`", span,
            label=f"more than {gpus // per_instance} instance(s)" if span else "",
            hint="replay it on a job with as many GPUs as the trace's instances (cluster dp x pp), "
                 "or say how many GPUs an instance holds (--gpus-per-instance)")], sources)


def availability(trace: Trace, gpus: int, *, seed: int = 0, per_instance: int = 1) -> list[tuple[float, frozenset[int]]]:
    """(time, live GPU ranks) at each row of the trace, instances picked as the module docstring
    says. Instances past the trace's count are never up. Deterministic for a seed."""
    rng = random.Random(seed)
    instances = gpus // per_instance
    up: list[int] = []
    down: list[int] = list(range(instances))
    out = []
    for t, count in trace.rows:
        count = min(count, instances)
        while len(up) > count:
            down.append(up.pop(rng.randrange(len(up))))
        while len(up) < count:
            up.append(down.pop(rng.randrange(len(down))))
        live = frozenset(i * per_instance + k for i in up for k in range(per_instance))
        out.append((t, live))
    return out
