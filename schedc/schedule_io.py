"""schedule.json, formats ``schedc.schedule/v1`` and ``/v2`` (docs/schedule-format.md): write and read.

`write_schedule(path, schedule, metrics)` writes the instance (shape, options,
memory, link, stages, GPUs), every op and the metrics: as v1 for a schedule
op by op, as v2 for a symmetric one (`schedc.symmetry`: the ops of one copy
of every class of alike pipelines, and the copies; GPUs one short row each). `read_schedule(path)`
checks the file with pydantic at this boundary (a hand-edited file is user
input) and returns the `Schedule` and the raw ``metrics`` object; the
schedule's *meaning* is not checked here but by `schedc.verify`.

Problems with the file itself are `ScheduleFileError`s (codes E6xx, see
docs/schedule-format.md), each naming the JSON path of the bad field
(``$.ops[3].start``); never a traceback:

    E601  the file cannot be read or is not JSON
    E602  a field is missing, has the wrong type or an impossible value
    E603  the parts disagree (GPU list vs dp x pp, stage numbering, ...)

Round trip: ``read_schedule(write_schedule(s)) == s``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import replace
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from schedc.diagnostics import Diagnostic, SchedcError, error
from schedc.instance import Instance
from schedc.schedule import Schedule, ScheduledOp, SolverInfo, is_rerouted
from schedc.spec import STAGE_KEYS, Gpu, LinkSpec, StageCosts
from schedc.symmetry import Layout, PipelineClass, SymmetricSchedule, part_instance

FORMAT = "schedc.schedule/v1"
FORMAT_V2 = "schedc.schedule/v2"


class ScheduleFileError(SchedcError):
    """A schedule.json that cannot be read as ``schedc.schedule/v1`` or ``/v2`` (E6xx)."""


# -- writing -------------------------------------------------------------------


def _op_rows(ops, instance: Instance) -> list[dict]:
    rows = []
    for op in ops:
        row = {"rank": op.rank, "kind": op.kind, "dp": op.dp, "pp": op.pp, "mb": op.mb,
               "start": op.start, "end": op.end}
        if is_rerouted(instance, op):
            row["rerouted"] = True
        rows.append(row)
    return rows


def schedule_to_json(schedule: Schedule, metrics: Any = None) -> dict:
    """The schedule.json object. `metrics`: a `Metrics`, a dict, or None (solver info only)."""
    inst = schedule.instance
    symmetric = isinstance(schedule, SymmetricSchedule)
    ops = _op_rows(schedule.first_copy_ops if symmetric else schedule.ops, inst)
    if metrics is None:
        metrics_json: dict = {}
    elif isinstance(metrics, dict):
        metrics_json = dict(metrics)
    else:
        metrics_json = metrics.to_json()
    # The schedule's own solver record is authoritative, so reading back gives the same Schedule.
    metrics_json["solver"] = schedule.solver.to_json()
    metrics_json = metrics_of_first_copies(schedule, metrics_json)
    head = {
        "format": FORMAT_V2 if symmetric else FORMAT,
        "dp": inst.dp,
        "pp": inst.pp,
        "microbatches": inst.microbatches,
        "decouple_backward": inst.decouple_backward,
        "stagger_optimizer": inst.stagger_optimizer,
        "gpu_memory": inst.gpu_memory,
        "link": {"latency": inst.link.latency, "bandwidth": inst.link.bandwidth},
        "stages": [{"pp": c.pp, **{k: getattr(c, k) for k in STAGE_KEYS}} for c in inst.stages],
    }
    if inst.redundant_forward:
        head["redundant_forward"] = True  # only then: other plans' files stay as they were
    if symmetric:
        return {**head, "gpus": [[g.dp, g.pp, g.node, g.state, g.speed] for g in inst.gpus],
                "classes": schedule.layout.to_json(), "ops": ops, "metrics": metrics_json}
    return {**head,
            "gpus": [{"rank": g.rank, "dp": g.dp, "pp": g.pp, "node": g.node, "state": g.state,
                      "speed": g.speed} for g in inst.gpus],
            "ops": ops,
            "metrics": metrics_json}


def dumps_schedule(schedule: Schedule, metrics: Any = None) -> str:
    """schedule.json text: one op per line, so diffs of hand edits stay readable."""
    obj = schedule_to_json(schedule, metrics)
    ops = obj.pop("ops")
    metrics_json = obj.pop("metrics")
    rows = {k: obj.pop(k) for k in ("gpus", "classes") if obj["format"] == FORMAT_V2}
    head = json.dumps(obj, indent=2)[:-2]  # drop the closing "\n}"
    lines = [head + ","]
    for key, items in rows.items():  # v2: one GPU or class per line
        lines.append(f'  "{key}": [')
        lines.extend("    " + json.dumps(o, separators=(",", ":")) + ("," if i < len(items) - 1 else "")
                     for i, o in enumerate(items))
        lines.append("  ],")
    lines.append('  "ops": [')
    lines.extend("    " + _op_json(o) + ("," if i < len(ops) - 1 else "") for i, o in enumerate(ops))
    lines.append("  ],")
    lines.append('  "metrics": ' + json.dumps(metrics_json, indent=2).replace("\n", "\n  "))
    lines.append("}")
    return "\n".join(lines) + "\n"


def metrics_of_first_copies(schedule, metrics_json: dict) -> dict:
    """A symmetric schedule's ``metrics`` object with per-rank maps (bubble, busy time, peak
    memory) of copy 0's ranks only: every copy's are the same, and 65,536 entries each would
    make megabytes. Any other schedule's is returned as it is."""
    if not isinstance(schedule, SymmetricSchedule):
        return metrics_json
    shown = {str(r) for fulls in schedule.full_ranks for r in fulls[:1]}
    out = dict(metrics_json)
    for key in ("bubble_ratio", "busy_time", "peak_memory"):
        if isinstance(out.get(key), dict):
            out[key] = {r: v for r, v in out[key].items() if r in shown}
    return out


def _op_json(row: dict) -> str:
    """`json.dumps(row)` of an op row, written directly (6x faster: 130,000 rows at 16,384 GPUs)."""
    mb = "null" if row["mb"] is None else row["mb"]
    text = (f'{{"rank": {row["rank"]}, "kind": "{row["kind"]}", "dp": {row["dp"]}, "pp": {row["pp"]}, '
            f'"mb": {mb}, "start": {row["start"]}, "end": {row["end"]}')
    return text + (', "rerouted": true}' if row.get("rerouted") else "}")


def write_schedule(path: str | os.PathLike, schedule: Schedule, metrics: Any = None) -> Path:
    """Write `schedule` (and its metrics) to `path` as schedc.schedule/v1 (v2 if symmetric)."""
    path = Path(path)
    path.write_text(dumps_schedule(schedule, metrics), encoding="utf-8")
    return path


# -- reading: pydantic models of the file, used only at this boundary ---------------

NonNeg = Field(ge=0)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # extra keys are allowed


class _Link(_Model):
    latency: StrictInt = Field(ge=0)
    bandwidth: StrictInt = Field(gt=0)


class _Stage(_Model):
    pp: StrictInt = NonNeg
    forward: StrictInt = NonNeg
    backward_input: StrictInt = NonNeg
    backward_weight: StrictInt = NonNeg
    optimizer: StrictInt = NonNeg
    activation: StrictInt = NonNeg
    stash: StrictInt = NonNeg
    static: StrictInt = NonNeg
    send: StrictInt = NonNeg


class _Gpu(_Model):
    rank: StrictInt = NonNeg
    dp: StrictInt = NonNeg
    pp: StrictInt = NonNeg
    node: StrictInt = NonNeg
    state: Literal["live", "failed"]
    speed: float = Field(default=1.0, gt=0, le=1)


class _Op(_Model):
    rank: StrictInt
    kind: Literal["F", "B", "W", "R", "O"]
    dp: StrictInt
    pp: StrictInt
    mb: Optional[StrictInt]
    start: StrictInt = NonNeg
    end: StrictInt = NonNeg


class _Solver(_Model):
    name: str = "unknown"
    status: Literal["optimal", "feasible", "fallback"] = "feasible"
    objective: Optional[float] = None
    bound: Optional[float] = None
    wall_s: float = 0.0
    detail: str = ""
    stopped_by: Literal["work", "deadline"] = "work"  # absent in files written before it existed


class _Metrics(_Model):
    solver: _Solver = Field(default_factory=_Solver)


class _File(_Model):
    format: Literal["schedc.schedule/v1"]
    dp: StrictInt = Field(ge=1)
    pp: StrictInt = Field(ge=1)
    microbatches: StrictInt = Field(ge=1)
    decouple_backward: StrictBool
    stagger_optimizer: StrictBool
    redundant_forward: StrictBool = False  # the `redundant` baseline's plans (Bamboo)
    gpu_memory: StrictInt = Field(gt=0)
    link: _Link
    stages: list[_Stage]
    gpus: list[_Gpu]
    ops: list[_Op]
    metrics: _Metrics = Field(default_factory=_Metrics)


def _json_path(loc: tuple) -> str:
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _pydantic_diagnostics(exc: ValidationError, where: str) -> list[Diagnostic]:
    diags = []
    for e in exc.errors()[:20]:
        path = _json_path(tuple(e["loc"]))
        got = e.get("input")
        shown = json.dumps(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
        if e["type"] == "missing":
            msg = f"{where}: `{path}` is missing"
        else:
            msg = f"{where}: `{path}` = {shown}: {e['msg']}"
        diags.append(error("E602", msg, hint="see docs/schedule-format.md for the fields of schedc.schedule/v1"))
    return diags


def _check_consistent(f: _File, where: str) -> list[Diagnostic]:
    diags = []
    if len(f.stages) != f.pp:
        diags.append(error("E603", f"{where}: `$.stages` has {len(f.stages)} entries but pp = {f.pp}"))
    for i, st in enumerate(f.stages):
        if st.pp != i:
            diags.append(error("E603", f"{where}: `$.stages[{i}].pp` = {st.pp}, expected {i}",
                               hint="stages are listed in order, stage 0 first"))
        if st.stash > st.activation:
            diags.append(error("E603", f"{where}: `$.stages[{i}].stash` = {st.stash} exceeds "
                                       f"`activation` = {st.activation}"))
    if f.redundant_forward and f.decouple_backward:
        diags.append(error("E603", f"{where}: `$.redundant_forward` with `decouple_backward`: "
                                   "redundant computation runs the full backward (no W)"))
    if len(f.gpus) != f.dp * f.pp:
        diags.append(error("E603", f"{where}: `$.gpus` has {len(f.gpus)} entries but dp x pp = {f.dp * f.pp}"))
    seen: dict[tuple[int, int], int] = {}
    for i, g in enumerate(f.gpus):
        if g.rank != i:
            diags.append(error("E603", f"{where}: `$.gpus[{i}].rank` = {g.rank}, expected {i}",
                               hint="GPUs are listed in rank order"))
        if not (g.dp < f.dp and g.pp < f.pp):
            diags.append(error("E603", f"{where}: `$.gpus[{i}]` is GPU (dp={g.dp}, pp={g.pp}), "
                                       f"outside dp < {f.dp}, pp < {f.pp}"))
        elif (g.dp, g.pp) in seen:
            diags.append(error("E603", f"{where}: `$.gpus[{i}]` and `$.gpus[{seen[(g.dp, g.pp)]}]` "
                                       f"are both GPU (dp={g.dp}, pp={g.pp})"))
        else:
            seen[(g.dp, g.pp)] = i
    return diags[:20]


class _Class(_Model):
    pipelines: StrictInt = Field(ge=1)
    copies: list[list[StrictInt]] = Field(min_length=1)


_GpuRow = tuple[StrictInt, StrictInt, StrictInt, Literal["live", "failed"], float]


class _V2Parts(_Model):
    format: Literal["schedc.schedule/v2"]
    gpus: list[_GpuRow]
    classes: list[_Class] = Field(min_length=1)


def parse_schedule(obj: Any, where: str = "schedule.json") -> tuple[Schedule, dict]:
    """A `Schedule` (v1) or `SymmetricSchedule` (v2) and the raw ``metrics`` dict from a parsed
    schedule.json object."""
    if isinstance(obj, dict) and obj.get("format") == FORMAT_V2:
        return _parse_v2(obj, where)
    try:
        f = _File.model_validate(obj)
    except ValidationError as exc:
        raise ScheduleFileError(_pydantic_diagnostics(exc, where)) from None
    diags = _check_consistent(f, where)
    if diags:
        raise ScheduleFileError(diags)
    inst = Instance(
        dp=f.dp, pp=f.pp, microbatches=f.microbatches,
        decouple_backward=f.decouple_backward, stagger_optimizer=f.stagger_optimizer,
        gpu_memory=f.gpu_memory,
        link=LinkSpec(latency=f.link.latency, bandwidth=f.link.bandwidth),
        stages=tuple(StageCosts(**{k: getattr(s, k) for k in ("pp",) + STAGE_KEYS}) for s in f.stages),
        gpus=tuple(Gpu(rank=g.rank, dp=g.dp, pp=g.pp, node=g.node, state=g.state, speed=float(g.speed))
                   for g in f.gpus),
        redundant_forward=f.redundant_forward,
    )
    ops = tuple(ScheduledOp(rank=o.rank, kind=o.kind, dp=o.dp, pp=o.pp, mb=o.mb, start=o.start, end=o.end)
                for o in f.ops)
    s = f.metrics.solver
    solver = SolverInfo(name=s.name, status=s.status, objective=s.objective, bound=s.bound,
                        wall_s=s.wall_s, detail=s.detail, stopped_by=s.stopped_by)
    metrics = obj.get("metrics", {}) if isinstance(obj, dict) else {}
    return Schedule(instance=inst, ops=ops, solver=solver), dict(metrics)


def read_schedule(path: str | os.PathLike) -> tuple[Schedule, dict]:
    """Read a schedule.json: the `Schedule` and its raw ``metrics`` object.

    Raises `ScheduleFileError` (E601-E603) with the JSON path of every bad
    field. The schedule's meaning is not checked here: call
    `schedc.verify.verify_schedule` on the result.
    """
    path = Path(path)
    where = str(path)
    if path.is_dir():
        inside = path / "schedule.json"
        raise ScheduleFileError([error(
            "E601", f"{where} is a folder, not a schedule file",
            hint=f"give the schedule file inside it: `{inside}`" if inside.exists()
            else "give a schedule.json that `schedc compile SPEC -o OUT` wrote")])
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleFileError([error("E601", f"cannot read {where}: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError:
        raise ScheduleFileError([error("E601", f"{where} is not UTF-8 text")]) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleFileError([error(
            "E601", f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            hint="a schedule file is the schedule.json that `schedc compile` writes")]) from None
    except (RecursionError, ValueError) as exc:  # arrays nested thousands deep; a 5,000-digit number
        what = "is nested too deep" if isinstance(exc, RecursionError) else "holds a number too long to read"
        raise ScheduleFileError([error(
            "E601", f"{where} {what} for a schedule file",
            hint="a schedule file is the schedule.json that `schedc compile` writes")]) from None
    if not isinstance(obj, dict):
        raise ScheduleFileError([error("E602", f"{where}: `$` is a {type(obj).__name__}, expected an object")])
    return parse_schedule(obj, where)


def _parse_v2(obj: dict, where: str) -> tuple[SymmetricSchedule, dict]:
    """v2: the GPU rows and classes checked here, the rest as in v1; the ops (copy 0's of each
    class, in the cluster's numbering) are renumbered into the reduced instance."""
    try:
        parts = _V2Parts.model_validate({k: obj.get(k) for k in ("format", "gpus", "classes") if k in obj})
    except ValidationError as exc:
        raise ScheduleFileError(_pydantic_diagnostics(exc, where)) from None
    bad_speed = [i for i, row in enumerate(parts.gpus) if not (0 < row[4] <= 1)]
    if bad_speed:
        raise ScheduleFileError([error("E602", f"{where}: `$.gpus[{i}][4]` (speed) = {parts.gpus[i][4]}: "
                                               "must be above 0 and at most 1") for i in bad_speed[:10]])
    gpus = [{"rank": i, "dp": d, "pp": p, "node": n, "state": st, "speed": sp}
            for i, (d, p, n, st, sp) in enumerate(parts.gpus)]
    rest = {k: v for k, v in obj.items() if k != "classes"}
    full, raw = parse_schedule({**rest, "format": FORMAT, "gpus": gpus}, where)
    inst = full.instance
    layout = Layout(classes=tuple(PipelineClass(copies=tuple(tuple(c) for c in cls.copies))
                                  for cls in parts.classes))
    diags = []
    seen: set[int] = set()
    for c, cls in enumerate(parts.classes):
        for j, copy in enumerate(cls.copies):
            if len(copy) != cls.pipelines:
                diags.append(error("E603", f"{where}: `$.classes[{c}].copies[{j}]` has {len(copy)} pipelines "
                                           f"but the class has {cls.pipelines}"))
            for d in copy:
                if not 0 <= d < inst.dp:
                    diags.append(error("E603", f"{where}: `$.classes[{c}].copies[{j}]` names pipeline {d}, "
                                               f"outside 0..{inst.dp - 1}"))
                elif d in seen:
                    diags.append(error("E603", f"{where}: pipeline {d} is in two copies (`$.classes[{c}]`)"))
                seen.add(d)
    if not diags and len(seen) != inst.dp:
        missing = sorted(set(range(inst.dp)) - seen)[:5]
        diags.append(error("E603", f"{where}: pipelines {', '.join(map(str, missing))} are in no class",
                           hint="every pipeline is in exactly one copy of one class"))
    if diags:
        raise ScheduleFileError(diags[:20])
    of_full = layout.of_full
    pp = inst.pp
    parts_ops: list[list[ScheduledOp]] = [[] for _ in layout.classes]
    for i, op in enumerate(full.ops):
        runner = inst.gpu_of_rank(op.rank) if 0 <= op.rank < len(inst.gpus) else None
        bad = next((name for name, d in (("dp", op.dp), ("rank", None if runner is None else runner.dp))
                    if d is None or d not in of_full or of_full[d][1] != 0), None)
        if bad is not None:
            diags.append(error("E603", f"{where}: `$.ops[{i}].{bad}` = {getattr(op, bad)} is not in "
                                       "the first copy of a class",
                               hint="a v2 file lists the ops of each class's first copy only"))
            continue
        r = of_full[op.dp][0]
        c = layout.class_of_reduced[r]
        if layout.class_of_reduced[of_full[runner.dp][0]] != c:
            diags.append(error("E603", f"{where}: `$.ops[{i}]` ({op}) runs on rank {op.rank}, a GPU of "
                                       "another class",
                               hint="an op of a class runs on the GPUs of its own copy"))
            continue
        off = layout.offsets[c]
        parts_ops[c].append(replace(op, rank=(of_full[runner.dp][0] - off) * pp + runner.pp, dp=r - off))
    if diags:
        raise ScheduleFileError(diags[:20])
    parts = tuple(Schedule(instance=part_instance(inst, cls.copies[0]), ops=tuple(ops), solver=full.solver)
                  for cls, ops in zip(layout.classes, parts_ops))
    return SymmetricSchedule(instance=inst, layout=layout, parts=parts, solver=full.solver), raw
