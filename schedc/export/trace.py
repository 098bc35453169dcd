"""Chrome / Perfetto trace of one iteration of a schedule (``trace.json``).

Open it in https://ui.perfetto.dev or chrome://tracing. One process
(``schedc``), one track per GPU named ``rank 5 (d1, s1)``, ordered by stage
then pipeline; one complete event ("X") per op, named in torch notation
(``d1:2F5``), with category ``forward`` / ``backward_input`` /
``backward_weight`` / ``optimizer``. Re-routed ops carry ``rerouted: true``
and their owner pipeline in ``args``. Times are microseconds, as in the
trace format. A symmetric schedule (`schedc.symmetry`) shows the first copy
of each class of alike pipelines, each track noting how many it stands for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from schedc.schedule import Schedule, is_rerouted
from schedc.symmetry import first_copy_view

CATEGORY = {"F": "forward", "B": "backward_input", "W": "backward_weight", "R": "redundant_forward",
            "O": "optimizer"}


def trace_events(schedule: Schedule) -> dict:
    """The trace as a JSON object (``{"traceEvents": [...], ...}``)."""
    inst = schedule.instance
    gpus, ops, notes, heading = first_copy_view(schedule)
    events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name",
                           "args": {"name": f"schedc: {heading}" if heading else "schedc"}}]
    order = sorted(gpus, key=lambda g: (g.pp, g.dp))
    for i, g in enumerate(order):
        state = "" if g.live else " FAILED"
        speed = f" speed {g.speed:g}" if g.live and g.speed < 1.0 else ""
        note = f" {notes[g.rank]}" if notes.get(g.rank) else ""
        events.append({"ph": "M", "pid": 0, "tid": g.rank, "name": "thread_name",
                       "args": {"name": f"rank {g.rank} (d{g.dp}, s{g.pp}){state}{speed}{note}"}})
        events.append({"ph": "M", "pid": 0, "tid": g.rank, "name": "thread_sort_index",
                       "args": {"sort_index": i}})
    category = dict(CATEGORY)
    if not inst.decouple_backward:
        category["B"] = "backward"
    for op in sorted(ops, key=lambda o: (o.start, o.rank, o.id)):
        args: dict = {"kind": op.kind, "dp": op.dp, "pp": op.pp, "mb": op.mb, "rank": op.rank}
        if is_rerouted(inst, op):
            args["rerouted"] = True
            args["owner"] = f"pipeline {op.dp}"
        events.append({"ph": "X", "pid": 0, "tid": op.rank, "name": str(op.id),
                       "cat": category[op.kind], "ts": op.start, "dur": op.end - op.start, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": "schedc.trace/v1", "solver": schedule.solver.name}}


def write_trace(path: str | os.PathLike, schedule: Schedule) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace_events(schedule), separators=(",", ":")) + "\n", encoding="utf-8")
    return path
