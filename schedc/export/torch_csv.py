"""Per-pipeline CSVs in torch.distributed.pipelining's compute-only format.

torch's `_PipelineScheduleRuntime._load_csv(path, format="compute_only")`
reads one row per pipeline rank, each cell an action ``{stage}{type}{mb}``
parsed by `_Action.from_str`: ``F`` forward, ``B`` full backward, ``I``
backward-input and ``W`` backward-weight (so schedc's decoupled B is
written ``I``). Communication and the optimizer are not part of this
format. A pipeline can be expressed when every GPU of it is live and it
neither lends nor borrows work (no re-routed op runs on, or belongs to,
it); its file is ``pipeline_{d}.csv`` and row s is the program of GPU
(d, s), which holds stage s.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from schedc.schedule import Schedule
from schedc.symmetry import SymmetricSchedule, first_copy_view


def torch_csv_pipelines(schedule: Schedule) -> list[int]:
    """Pipelines whose schedule torch.distributed.pipelining's CSV format can express (of a
    symmetric schedule: of each class's first copy; the other copies' files would be the same).
    None with redundant computation: torch has no action for a redundant forward."""
    inst = schedule.instance
    if inst.redundant_forward:
        return []
    gpus, ops, _, _ = first_copy_view(schedule)
    shown = {g.dp for g in gpus}
    bad = {g.dp for g in inst.gpus if not g.live} | (set(range(inst.dp)) - shown)
    for op in ops:
        g = inst.gpus[op.rank] if 0 <= op.rank < len(inst.gpus) else None
        if g is None or g.dp != op.dp or g.pp != op.pp:
            bad.add(op.dp)
            if g is not None:
                bad.add(g.dp)
    return [d for d in range(inst.dp) if d not in bad]


def pipeline_actions(schedule: Schedule, dp: int) -> list[list[str]]:
    """Row s: the compute actions of GPU (dp, s) in program order, as torch prints them."""
    inst = schedule.instance
    backward = "I" if inst.decouple_backward else "B"
    letter = {"F": "F", "B": backward, "W": "W"}
    rows = []
    if isinstance(schedule, SymmetricSchedule):  # the pipeline's own copy, not the whole expansion
        schedule = schedule.copy_holding(inst.gpu(dp, 0).rank)
    for s in range(inst.pp):
        prog = schedule.program(inst.gpu(dp, s).rank)
        rows.append([f"{op.pp}{letter[op.kind]}{op.mb}" for op in prog if op.kind != "O"])
    return rows


def dumps_pipeline_csv(schedule: Schedule, dp: int) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in pipeline_actions(schedule, dp):
        writer.writerow(row)
    return buf.getvalue()


def write_torch_csvs(out_dir: str | os.PathLike, schedule: Schedule) -> list[Path]:
    """Write ``pipeline_{d}.csv`` for every expressible pipeline; returns the paths written."""
    out = Path(out_dir)
    paths = []
    for d in torch_csv_pipelines(schedule):
        p = out / f"pipeline_{d}.csv"
        p.write_text(dumps_pipeline_csv(schedule, d), encoding="utf-8")
        paths.append(p)
    return paths
