"""A timeline picture of one iteration (``timeline.svg``), hand-written SVG.

One row per GPU, grouped by stage; one box per op coloured by kind (F, B, W,
O) and labelled with its microbatch. Re-routed ops are hatched, outlined and
labelled with their owner pipeline (``d1:5``). Failed GPUs are a grey,
crossed-out row; slow GPUs carry their speed. A time axis in milliseconds,
a legend, and the key metrics in the title.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from schedc.schedule import Schedule, is_rerouted, status_text
from schedc.symmetry import first_copy_view
from schedc.ticks import nice_step

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "R": "#9ecae9", "O": "#8e6c8a"}
TEXT_ON = {"F": "#ffffff", "B": "#000000", "W": "#ffffff", "R": "#000000", "O": "#ffffff"}

LABEL_W = 190  # left column with the GPU names
PLOT_W = 1200  # width of the time axis
ROW_H = 22
ROW_GAP = 3
STAGE_GAP = 14
#: Of a symmetric schedule, the timeline draws this many helper pipelines per component (the
#: others are alike) and this many classes (the untouched one and the most repeated), so that
#: it stays a page or two tall at any scale; trace.json has every class.
TIMELINE_HELPERS = 1
TIMELINE_CLASSES = 4
TIME_TICKS = 10  # the time axis is cut into at most this many steps (it is PLOT_W wide)
FONT = "font-family='DejaVu Sans, Arial, Helvetica, sans-serif'"


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}".rstrip("0").rstrip(".")


def _metric_line(schedule: Schedule, metrics: Any) -> str:
    parts = [f"solver {schedule.solver.name} ({status_text(schedule.solver.status)})"]
    if metrics is None:
        parts.append(f"makespan {_ms(schedule.makespan)} ms")
        return "   |   ".join(parts)
    m = metrics.to_json() if hasattr(metrics, "to_json") else dict(metrics)
    if m.get("iteration_time") is not None:
        # The picture is one iteration from its first op to its last (the makespan); the
        # iteration time is the period of iterations run back to back, which overlap.
        parts.append(f"iteration {_ms(m['iteration_time'])} ms back to back (this one drawn alone: "
                     f"{_ms(schedule.makespan)} ms)")
    if m.get("fault_free_iteration_time"):
        parts.append(f"fault-free {_ms(m['fault_free_iteration_time'])} ms")
    if m.get("slowdown"):
        parts.append(f"slowdown {m['slowdown']:.2f}x")
    if m.get("ratio_to_lower_bound"):
        parts.append(f"{m['ratio_to_lower_bound']:.2f}x lower bound")
    bubbles = list((m.get("bubble_ratio") or {}).values())
    if bubbles:
        parts.append(f"bubble mean {100 * sum(bubbles) / len(bubbles):.0f}% max {100 * max(bubbles):.0f}%")
    peaks = list((m.get("peak_memory") or {}).values())
    if peaks and m.get("memory_limit"):
        parts.append(f"peak memory {max(peaks) / 2**30:.1f} / {m['memory_limit'] / 2**30:.1f} GiB")
    return "   |   ".join(parts)


def render_timeline(schedule: Schedule, metrics: Any = None, *, title: str = "") -> str:
    """The timeline as SVG text. `metrics`: a `Metrics`, its JSON dict, or None."""
    inst = schedule.instance
    gpus, ops, notes, view_note = first_copy_view(schedule, helpers_shown=TIMELINE_HELPERS,
                                                  classes_shown=TIMELINE_CLASSES)
    rerouted = {op.id for op in ops if is_rerouted(inst, op)}
    horizon = max(schedule.makespan, 1)
    scale = PLOT_W / horizon

    head_h = 58 if not view_note else 76
    y = head_h + 28  # below the title and the axis labels
    rows: dict[int, float] = {}
    stage_top: dict[int, float] = {}
    for s in range(inst.pp):
        stage_top[s] = y
        for g in sorted((g for g in gpus if g.pp == s), key=lambda g: g.dp):
            rows[g.rank] = y
            y += ROW_H + ROW_GAP
        y += STAGE_GAP
    plot_bottom = y - STAGE_GAP
    legend_y = plot_bottom + 36
    height = legend_y + 30
    width = LABEL_W + PLOT_W + 30
    x0 = LABEL_W

    out: list[str] = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height:.0f}' "
        f"viewBox='0 0 {width} {height:.0f}' {FONT} font-size='11'>",
        "<defs><pattern id='hatch' patternUnits='userSpaceOnUse' width='6' height='6' "
        "patternTransform='rotate(45)'><rect width='2.5' height='6' fill='#000' fill-opacity='0.45'/>"
        "</pattern></defs>",
        f"<rect width='{width}' height='{height:.0f}' fill='#ffffff'/>",
    ]
    heading = title or (f"schedc timeline: dp={inst.dp} pp={inst.pp} microbatches={inst.microbatches}"
                        f"{'' if inst.decouple_backward else ', B = full backward'}"
                        f"{', staggered optimizer' if inst.stagger_optimizer else ''}")
    out.append(f"<text x='10' y='22' font-size='15' font-weight='bold'>{escape(heading)}</text>")
    out.append(f"<text x='10' y='42' font-size='12'>{escape(_metric_line(schedule, metrics))}</text>")
    if view_note:
        out.append(f"<text x='10' y='60' font-size='11' fill='#444'>Drawn: {escape(view_note)}"
                   "</text>")

    # time axis with a grid line per tick
    step = max(1, round(nice_step(horizon, TIME_TICKS)))  # 1, 2 or 5 x 10^k microseconds
    t = 0
    while t <= horizon:
        x = x0 + t * scale
        out.append(f"<line x1='{x:.1f}' y1='{head_h + 16}' x2='{x:.1f}' y2='{plot_bottom:.0f}' "
                   f"stroke='#dddddd' stroke-width='1'/>")
        out.append(f"<text x='{x:.1f}' y='{head_h + 12}' text-anchor='middle' fill='#444'>{_ms(t)}</text>")
        t += step
    out.append(f"<text x='{x0 - 8}' y='{head_h + 12}' text-anchor='end' fill='#444'>time (ms)</text>")

    # stage bands and GPU rows; a GPU that runs re-routed work names its guests
    guests_of: dict[int, set[int]] = {}
    for op in ops:
        if op.id in rerouted:
            guests_of.setdefault(op.rank, set()).add(op.dp)
    for s in range(inst.pp):
        out.append(f"<text x='6' y='{stage_top[s] - 3:.0f}' font-weight='bold' fill='#333'>stage {s}</text>")
    for g in gpus:
        ry = rows[g.rank]
        label = f"rank {g.rank} (d{g.dp}, s{g.pp})"
        if notes.get(g.rank):
            label += f" {notes[g.rank]}"
        if not g.live:
            out.append(f"<rect x='{x0}' y='{ry:.0f}' width='{PLOT_W}' height='{ROW_H}' fill='#d9d9d9'/>")
            out.append(f"<line x1='{x0}' y1='{ry:.0f}' x2='{x0 + PLOT_W}' y2='{ry + ROW_H:.0f}' "
                       f"stroke='#888' stroke-width='1.2'/>")
            out.append(f"<line x1='{x0}' y1='{ry + ROW_H:.0f}' x2='{x0 + PLOT_W}' y2='{ry:.0f}' "
                       f"stroke='#888' stroke-width='1.2'/>")
            out.append(f"<text x='{x0 + PLOT_W / 2:.0f}' y='{ry + 15:.0f}' text-anchor='middle' "
                       f"font-weight='bold' fill='#555'>FAILED</text>")
            label += "  failed"
            fill = "#888888"
        else:
            out.append(f"<rect x='{x0}' y='{ry:.0f}' width='{PLOT_W}' height='{ROW_H}' fill='#f7f7f7'/>")
            fill = "#000000"
            if g.speed < 1.0:
                label += f"  speed {g.speed:g}"
                fill = "#b00000"
            guests = sorted(guests_of.get(g.rank, ()))
            if guests:
                label += "  +" + ",".join(f"d{d}" for d in guests)
        out.append(f"<text x='{x0 - 8}' y='{ry + 15:.0f}' text-anchor='end' fill='{fill}'>"
                   f"{escape(label)}</text>")

    # ops
    for op in sorted(ops, key=lambda o: (o.rank, o.start, o.id)):
        if op.rank not in rows:
            continue
        ry = rows[op.rank]
        x = x0 + op.start * scale
        w = max((op.end - op.start) * scale, 0.8)
        colour = COLOURS.get(op.kind, "#999999")
        moved = op.id in rerouted
        name = escape(str(op.id))
        out.append(f"<g><title>{name} rank {op.rank} {op.start}..{op.end} us"
                   f"{' (re-routed)' if moved else ''}</title>")
        out.append(f"<rect x='{x:.2f}' y='{ry + 1:.0f}' width='{w:.2f}' height='{ROW_H - 2}' "
                   f"fill='{colour}' stroke='#ffffff' stroke-width='0.6'/>")
        if moved:
            out.append(f"<rect x='{x:.2f}' y='{ry + 1:.0f}' width='{w:.2f}' height='{ROW_H - 2}' "
                       f"fill='url(#hatch)' stroke='#d40000' stroke-width='1.6'/>")
        text = "O" if op.kind == "O" else str(op.mb)
        if moved:  # the owner matters more than the microbatch; use the longer form only where it fits
            text = f"d{op.dp}:{op.mb}" if w >= 7 * 4 + 2 else f"d{op.dp}"
        if w >= 7 * len(text) + 2:
            out.append(f"<text x='{x + w / 2:.2f}' y='{ry + 15:.0f}' text-anchor='middle' "
                       f"fill='{TEXT_ON.get(op.kind, '#000')}' font-weight='{'bold' if moved else 'normal'}'>"
                       f"{escape(text)}</text>")
        elif w >= 7 * len(text) * 0.6 + 1:  # narrow: a condensed label rather than none
            out.append(f"<text x='{x + w / 2:.2f}' y='{ry + 15:.0f}' text-anchor='middle' font-size='8' "
                       f"fill='{TEXT_ON.get(op.kind, '#000')}'>{escape(text)}</text>")
        out.append("</g>")

    # legend
    lx = x0
    names = {"F": "F forward", "B": "B backward-input" if inst.decouple_backward else "B backward (full)",
             "W": "W backward-weight", "R": "R redundant forward (the next stage's copy)",
             "O": "O all-reduce + optimizer"}
    kinds = ("F", "B", "W", "O") if inst.decouple_backward else ("F", "B", "O")
    if inst.redundant_forward:
        kinds = kinds[:-1] + ("R", "O")
    for k in kinds:
        out.append(f"<rect x='{lx}' y='{legend_y - 11:.0f}' width='16' height='14' fill='{COLOURS[k]}'/>")
        out.append(f"<text x='{lx + 22}' y='{legend_y:.0f}'>{escape(names[k])}</text>")
        lx += 30 + 7 * len(names[k])
    out.append(f"<rect x='{lx}' y='{legend_y - 11:.0f}' width='16' height='14' fill='{COLOURS['F']}'/>")
    out.append(f"<rect x='{lx}' y='{legend_y - 11:.0f}' width='16' height='14' fill='url(#hatch)' "
               f"stroke='#d40000' stroke-width='1.6'/>")
    out.append(f"<text x='{lx + 22}' y='{legend_y:.0f}'>re-routed (label d&lt;owner&gt;:mb)</text>")
    lx += 30 + 7 * 30
    out.append(f"<rect x='{lx}' y='{legend_y - 11:.0f}' width='16' height='14' fill='#d9d9d9'/>")
    out.append(f"<line x1='{lx}' y1='{legend_y - 11:.0f}' x2='{lx + 16}' y2='{legend_y + 3:.0f}' stroke='#888'/>")
    out.append(f"<text x='{lx + 22}' y='{legend_y:.0f}'>failed GPU</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_timeline(path: str | os.PathLike, schedule: Schedule, metrics: Any = None) -> Path:
    path = Path(path)
    path.write_text(render_timeline(schedule, metrics), encoding="utf-8")
    return path
