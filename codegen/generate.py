"""Per-rank PyTorch programs from a verified schedule.

The logic lives here; the templates (`templates/*.py.j2`) only loop over
lines computed below. For each live rank the program is its ops in schedule
order (`Schedule.programs`), each one call into `schedc.runtime`, with the
peers it receives from and sends to resolved from the schedule's executors
(re-routed microbatches included: F(d,m,s) receives from whoever ran
F(d,m,s-1), which need not be GPU (d, s-1)).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import jinja2

from schedc.diagnostics import RunError, error
from schedc.runtime.manifest import DEFAULT_SOURCE, MANIFEST_NAME, Manifest, model_args_of, spec_folder
from schedc.schedule import Schedule, ScheduledOp
from schedc.spec import Spec
from schedc.symmetry import SymmetricSchedule
from schedc.version import __version__

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("schedc.codegen", "templates"),
    keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
    undefined=jinja2.StrictUndefined, autoescape=False,
)


def program_name(rank: int, world: int) -> str:
    """``rank_05.py``: zero-padded to the width of the largest rank (at least two digits)."""
    return f"rank_{rank:0{max(2, len(str(world - 1)))}d}.py"


def render_programs(spec: Spec, schedule: Schedule, *, metrics: Mapping | None = None,
                    out_name: str = "OUT") -> dict[str, str]:
    """File name -> text of every file `write_programs` writes (nothing touches the disk).

    `metrics` is the ``metrics`` object of schedule.json (or a `Metrics`); its
    scalar entries go into each program's header, all of it into programs.json.
    """
    if metrics is not None and hasattr(metrics, "to_json"):  # a `schedc.simulate.Metrics`
        metrics = metrics.to_json()
    inst = schedule.instance
    if (inst.dp, inst.pp) != (spec.dp, spec.pp):
        raise RunError([error("E501", f"the schedule is for {inst.dp}x{inst.pp} GPUs but the spec "
                                      f"describes {spec.dp}x{spec.pp}")])
    if isinstance(schedule, SymmetricSchedule):
        return _render_class_programs(spec, schedule, metrics, out_name)
    executor = _executors(schedule)
    programs = {r: ops for r, ops in sorted(schedule.programs.items()) if ops or inst.gpus[r].live}
    live = sorted(g.rank for g in inst.gpus if g.live)
    world = inst.dp * inst.pp
    for r in programs:
        if r not in live:
            raise RunError([error("E502", f"the schedule gives ops to failed rank {r}",
                                  hint="verify the schedule before generating programs")])
    header = _header(spec, schedule, metrics)
    files: dict[str, str] = {}
    template = _ENV.get_template("rank.py.j2")
    for rank in live:
        g = inst.gpus[rank]
        lines = [_call(op, executor, inst.pp, inst.decouple_backward) for op in programs.get(rank, ())]
        files[program_name(rank, world)] = template.render(
            header=header, rank=rank, dp=g.dp, stage=g.pp, n_ops=len(lines), lines=lines,
            out_name=out_name, live=len(live))
    files["main.py"] = _ENV.get_template("main.py.j2").render(
        header=header, live=len(live), iterations=spec.train.iterations,
        mapping=[(i, r, program_name(r, world)) for i, r in enumerate(live)], more=0)
    files[MANIFEST_NAME] = json.dumps(_manifest(spec, schedule, live, metrics).to_json(),
                                      indent=2, sort_keys=False) + "\n"
    for name, text in files.items():
        if name.endswith(".py"):
            compile(text, name, "exec")  # a template bug must never reach the disk
    return files


def class_program_name(cls: int, local_rank: int) -> str:
    """``program_c2_017.py``: the program of local rank 17 of class 2, shared by its copies."""
    return f"program_c{cls}_{local_rank:03d}.py"


def _render_class_programs(spec: Spec, schedule: SymmetricSchedule, metrics: Mapping | None,
                           out_name: str) -> dict[str, str]:
    """A symmetric schedule: one program per rank of each class, shared by every copy of the
    class. Its calls name pipelines and peers through the copy's tables (`D[i]`: the copy's
    i-th pipeline, `R[k]`: the GPU running its k-th local rank), which programs.json gives each
    rank (`copy_of`, `copy_tables`); `schedc run` and torchrun bind them when loading."""
    inst, lay, red = schedule.instance, schedule.layout, schedule.reduced
    pp = inst.pp
    executor = _executors(red)
    header = _header(spec, schedule, metrics)
    template = _ENV.get_template("class.py.j2")
    files: dict[str, str] = {}
    program_of: dict[int, str] = {}
    copy_of: dict[int, int] = {}
    tables: list[dict] = []
    for c, cls in enumerate(lay.classes):
        off = lay.offsets[c]
        for j in range(cls.count):
            ranks = [schedule.full_ranks[off * pp + k][j] for k in range(cls.size * pp)]
            tables.append({"class": c, "copy": j, "ranks": ranks, "pipelines": list(cls.copies[j])})
            for k, full in enumerate(ranks):
                if inst.gpus[full].live:
                    program_of[full] = class_program_name(c, k)
                    copy_of[full] = len(tables) - 1
        for k in range(cls.size * pp):
            reduced_rank = off * pp + k
            g = red.instance.gpus[reduced_rank]
            if not g.live:
                continue
            lines = [_local_call(op, executor, off, pp, inst.decouple_backward)
                     for op in red.program(reduced_rank)]
            files[class_program_name(c, k)] = template.render(
                header=header, cls=c, local=k, local_dp=k // pp, stage=g.pp, n_ops=len(lines),
                lines=lines, copies=cls.count, out_name=out_name)
    live = sorted(program_of)
    files["main.py"] = _ENV.get_template("main.py.j2").render(
        header=header, live=len(live), iterations=spec.train.iterations,
        mapping=[(i, r, program_of[r]) for i, r in enumerate(live)][:_MAIN_MAPPING_SHOWN],
        more=max(0, len(live) - _MAIN_MAPPING_SHOWN))
    manifest = replace(_manifest(spec, schedule, live, metrics), programs=program_of, copy_of=copy_of,
                       copy_tables=tuple(tables))
    files[MANIFEST_NAME] = json.dumps(manifest.to_json(), separators=(",", ":")) + "\n"
    # A template bug must never reach the disk: main.py and the first program of every class
    # (whose lines the same code writes as every other's) are compiled. Compiling all of them
    # would cost time per GPU (2.5 s of a 16,384-GPU write when measured; `python
    # bench/scale.py` reports the write's time).
    firsts = {name.rsplit("_", 1)[0]: name for name in reversed(list(files)) if name.startswith("program_c")}
    for name in ["main.py", *firsts.values()]:
        compile(files[name], name, "exec")
    return files


#: Ranks listed in main.py's docstring of a symmetric plan (all of them are in programs.json).
_MAIN_MAPPING_SHOWN = 16


def _local_call(op: ScheduledOp, executor: Mapping, off: int, pp: int, decouple: bool) -> tuple[str, str]:
    """One line of a class program: pipelines as `D[i]` and peers as `R[k]` (local indices)."""
    return _call(op, executor, pp, decouple, peer=lambda r: f"R[{r - off * pp}]",
                 pipeline=lambda d: f"D[{d - off}]", comment_prefix="reduced ")


def write_programs(spec: Spec, schedule: Schedule, out_dir: Path, *,
                   metrics: Mapping | None = None) -> list[Path]:
    """Write ``OUT/rank_NN.py`` per live rank, ``OUT/main.py`` and ``OUT/programs.json``.

    >>> plan = schedc.compile("specs/mlp-2x2.sched")                            # doctest: +SKIP
    >>> write_programs(plan.spec, plan.schedule, Path("out"), metrics=plan.metrics)  # doctest: +SKIP

    Every text is rendered and compiled before anything is written; each file
    goes to a temporary name and is renamed into place, so a failure leaves
    no half-written program. Programs of ranks no longer live (from an older
    compile into the same folder) are removed. Returns the written paths.
    """
    out_dir = Path(out_dir)
    files = render_programs(spec, schedule, metrics=metrics, out_name=out_dir.name or str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    temps = []
    try:
        for name, text in files.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_text(text)
            temps.append((tmp, out_dir / name))
        for tmp, final in temps:
            os.replace(tmp, final)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
    for stale in out_dir.iterdir():  # (the programs of an earlier plan; a user's rank_notes.py is theirs)
        if re.match(r"^(?:rank_\d+|program_c\d+_\d+)\.py$", stale.name) and stale.name not in files:
            stale.unlink()
    return [out_dir / name for name in files]


def _executors(schedule: Schedule) -> dict[tuple[int, int, int], int]:
    """(d, m, s) -> the rank that runs F, B and W of that microbatch at that stage."""
    out: dict[tuple[int, int, int], int] = {}
    for op in schedule.ops:
        if op.kind == "F":
            out[(op.dp, op.mb, op.pp)] = op.rank
    inst = schedule.instance
    missing = [f"d{d}:{s}F{m}" for d in range(inst.dp) for m in range(inst.microbatches)
               for s in range(inst.pp) if (d, m, s) not in out]
    if missing:
        raise RunError([error("E502", f"the schedule has no forward for {', '.join(missing[:5])}"
                                      + (" ..." if len(missing) > 5 else ""),
                              hint="verify the schedule before generating programs")])
    return out


def _call(op: ScheduledOp, executor: Mapping, pp: int, decouple: bool, *, peer=str, pipeline=str,
          comment_prefix: str = "") -> tuple[str, str]:
    """One line of a program: the runtime call of `op` and a comment naming it. `peer` and
    `pipeline` write a rank and a pipeline index as code (a number, or a copy's table entry)."""
    comment = f"{comment_prefix}{op.id} t={op.start}"
    us = op.end - op.start
    if op.kind == "O":
        return f"rt.optimizer_step(us={us})", comment
    d, m, s = op.dp, op.mb, op.pp
    where = f"d={pipeline(d)}, stage={s}, mb={m}"

    def rank(key):
        return None if key is None else peer(executor[key])
    if op.kind == "F":
        recv = rank((d, m, s - 1) if s > 0 else None)
        send = rank((d, m, s + 1) if s < pp - 1 else None)
        return f"rt.forward({where}, recv_from={recv}, send_to={send}, us={us})", comment
    if op.kind == "B":
        recv = rank((d, m, s + 1) if s < pp - 1 else None)
        send = rank((d, m, s - 1) if s > 0 else None)
        name = "backward_input" if decouple else "backward"
        return f"rt.{name}({where}, recv_from={recv}, send_to={send}, us={us})", comment
    if op.kind == "W":
        return f"rt.backward_weight({where}, us={us})", comment
    raise RunError([error("E503", f"unknown op kind `{op.kind}` in the schedule")])


def _header(spec: Spec, schedule: Schedule, metrics: Mapping | None) -> list[str]:
    inst = schedule.instance
    failed = [g.rank for g in inst.gpus if not g.live]
    slow = [f"{g.rank}@{g.speed:g}" for g in inst.gpus if g.live and g.speed < 1.0]
    lines = [
        f"Generated by schedc {__version__} from spec `{spec.source_name}`; do not edit, recompile.",
        f"Cluster: dp={inst.dp} x pp={inst.pp}, {inst.microbatches} microbatches per pipeline; "
        f"failed ranks: {' '.join(map(str, failed)) or 'none'}; slow: {' '.join(slow) or 'none'}.",
        f"Schedule: solver {schedule.solver.name} ({schedule.solver.status}), "
        f"decouple_backward={inst.decouple_backward}, stagger_optimizer={inst.stagger_optimizer}.",
    ]
    for key, value in sorted((metrics or {}).items()):
        if isinstance(value, (int, float, str, bool)) or value is None:
            lines.append(f"Metric {key}: {value}")
    return lines


def _manifest(spec: Spec, schedule: Schedule, live: list[int], metrics: Mapping | None) -> Manifest:
    inst = schedule.instance
    world = inst.dp * inst.pp
    model = spec.model
    return Manifest(
        spec=spec.source_name,
        schedc_version=__version__,
        dp=inst.dp, pp=inst.pp, microbatches=inst.microbatches,
        live_ranks=tuple(live),
        coords={r: (inst.gpus[r].dp, inst.gpus[r].pp) for r in live},
        stage_groups=tuple(tuple(g.rank for g in inst.live_gpus(s)) for s in range(inst.pp)),
        programs={r: program_name(r, world) for r in live},
        source=(model.source if model and model.source else DEFAULT_SOURCE),
        data=(model.data if model else None),
        partition=spec.partition,
        optimizer=spec.train.optimizer, lr=spec.train.lr, iterations=spec.train.iterations,
        decouple_backward=inst.decouple_backward, stagger_optimizer=inst.stagger_optimizer,
        metrics=_jsonable(metrics or {}),
        model_args=model_args_of(model),
        spec_dir=spec_folder(spec.source_name),
        tp=spec.cluster.tp,
    )


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str, sort_keys=True))
