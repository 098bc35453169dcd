"""Exports of a schedule beside schedule.json (docs/schedule-format.md).

- `trace.write_trace`: Chrome/Perfetto trace events (``trace.json``),
- `svg.write_timeline`: a timeline picture (``timeline.svg``),
- `torch_csv.write_torch_csvs`: per-pipeline CSVs in torch.distributed.pipelining's
  compute-only action format, where a pipeline's schedule can be expressed there.
"""

from schedc.export.svg import render_timeline, write_timeline
from schedc.export.torch_csv import pipeline_actions, torch_csv_pipelines, write_torch_csvs
from schedc.export.trace import trace_events, write_trace

__all__ = [
    "pipeline_actions",
    "render_timeline",
    "torch_csv_pipelines",
    "trace_events",
    "write_timeline",
    "write_torch_csvs",
    "write_trace",
]
