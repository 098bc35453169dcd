"""schedule.json, format ``schedc.schedule/v1`` (docs/schedule-format.md): write and read.

`write_schedule(path, schedule, metrics)` writes the instance (shape, options,
memory, link, stages, GPUs), every op and the metrics. `read_schedule(path)`
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
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from schedc.diagnostics import Diagnostic, SchedcError, error
from schedc.instance import Instance
from schedc.schedule import Schedule, ScheduledOp, SolverInfo
from schedc.spec import STAGE_KEYS, Gpu, LinkSpec, StageCosts

FORMAT = "schedc.schedule/v1"


class ScheduleFileError(SchedcError):
    """A schedule.json that cannot be read as ``schedc.schedule/v1`` (E6xx)."""


# -- writing -------------------------------------------------------------------


def schedule_to_json(schedule: Schedule, metrics: Any = None) -> dict:
    """The schedule.json object. `metrics`: a `Metrics`, a dict, or None (solver info only)."""
    inst = schedule.instance
    rerouted = schedule.rerouted
    ops = []
    for op in schedule.ops:
        row = {"rank": op.rank, "kind": op.kind, "dp": op.dp, "pp": op.pp, "mb": op.mb,
               "start": op.start, "end": op.end}
        if op.id in rerouted:
            row["rerouted"] = True
        ops.append(row)
    if metrics is None:
        metrics_json: dict = {}
    elif isinstance(metrics, dict):
        metrics_json = dict(metrics)
    else:
        metrics_json = metrics.to_json()
    # The schedule's own solver record is authoritative, so reading back gives the same Schedule.
    metrics_json["solver"] = schedule.solver.to_json()
    return {
        "format": FORMAT,
        "dp": inst.dp,
        "pp": inst.pp,
        "microbatches": inst.microbatches,
        "decouple_backward": inst.decouple_backward,
        "stagger_optimizer": inst.stagger_optimizer,
        "gpu_memory": inst.gpu_memory,
        "link": {"latency": inst.link.latency, "bandwidth": inst.link.bandwidth},
        "stages": [{"pp": c.pp, **{k: getattr(c, k) for k in STAGE_KEYS}} for c in inst.stages],
        "gpus": [{"rank": g.rank, "dp": g.dp, "pp": g.pp, "node": g.node, "state": g.state,
                  "speed": g.speed} for g in inst.gpus],
        "ops": ops,
        "metrics": metrics_json,
    }


def dumps_schedule(schedule: Schedule, metrics: Any = None) -> str:
    """schedule.json text: one op per line, so diffs of hand edits stay readable."""
    obj = schedule_to_json(schedule, metrics)
    ops = obj.pop("ops")
    metrics_json = obj.pop("metrics")
    head = json.dumps(obj, indent=2)[:-2]  # drop the closing "\n}"
    lines = [head + ","]
    lines.append('  "ops": [')
    lines.extend("    " + json.dumps(o) + ("," if i < len(ops) - 1 else "") for i, o in enumerate(ops))
    lines.append("  ],")
    lines.append('  "metrics": ' + json.dumps(metrics_json, indent=2).replace("\n", "\n  "))
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_schedule(path: str | os.PathLike, schedule: Schedule, metrics: Any = None) -> Path:
    """Write `schedule` (and its metrics) to `path` as schedc.schedule/v1."""
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
    kind: Literal["F", "B", "W", "O"]
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


def parse_schedule(obj: Any, where: str = "schedule.json") -> tuple[Schedule, dict]:
    """A `Schedule` and the raw ``metrics`` dict from a parsed schedule.json object."""
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
