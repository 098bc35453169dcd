"""Line charts as SVG text, for every benchmark figure (no plotting library is a dependency).

`Chart` is the one drawing helper: axes (linear or log10) with round ticks
(`schedc.ticks`), lines with optional markers and dash patterns, whiskers for a
point's spread, a legend, shaded bands, labelled vertical markers, ticks on the
x axis for many events, and footnotes under the plot, wrapped to its width
(text is escaped for XML). `line_chart` fits a
`Chart` to a few series (what `schedc bench` draws); the hand-run scripts in
bench/ build a `Chart` themselves.
"""

from __future__ import annotations

import math
from typing import Sequence

from schedc.ticks import nice_ticks, text_width, tick_label, wrap

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
DASHES = ["", "7,4", "2,3", "9,3,2,3", "4,4"]
FOOT_X, FOOT_SIZE, FOOT_LINE = 10, 11, 16  # footnotes: left edge, font size, line height (pixels)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Chart:
    """A plot area spanning `x` and `y` (each a (low, high) pair of data values, > 0 on a log
    axis) widened to round ticks (`schedc.ticks.nice_ticks`: 3-7 per axis, whole numbers on the
    x axis with `integer_x`), with a title, axis labels, grid lines, a legend on the right and
    `footnotes` under the plot, wrapped to the canvas's width (the canvas grows by their lines).
    Draw with `line`, `whisker`, `band`, `marker`, `rug` and `note`; `svg()` gives the text."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], *, title: str, xlabel: str,
                 ylabel: str, width: int = 720, height: int = 360, margins: tuple[int, int, int, int] = (60, 150, 40, 45),
                 log_x: bool = False, log_y: bool = False, integer_x: bool = False, footnotes: Sequence[str] = ()):
        self.log_x, self.log_y = log_x, log_y
        self.x_ticks = nice_ticks(*x, log=log_x, integer=integer_x)
        self.y_ticks = nice_ticks(*y, log=log_y)
        self.x0, self.x1 = (self.fx(self.x_ticks[0]), self.fx(self.x_ticks[-1]))
        self.y0, self.y1 = (self.fy(self.y_ticks[0]), self.fy(self.y_ticks[-1]))
        lines = [ln for n in footnotes for ln in wrap(n, width - 2 * FOOT_X, FOOT_SIZE)]
        self.w, self.h = width, height + FOOT_LINE * len(lines)
        self.ml, self.mr, self.mt, self.mb = margins
        self.mb += FOOT_LINE * len(lines)
        self.legend = 0
        w, h, ml, mr, mt, mb = self.w, self.h, self.ml, self.mr, self.mt, self.mb
        self.background = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
                           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
                           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{_xml(title)}</text>',
                           *(f'<text x="{FOOT_X}" y="{h - FOOT_LINE * (len(lines) - k) + 4}" font-size="{FOOT_SIZE}" '
                             f'fill="#444">{_xml(n)}</text>' for k, n in enumerate(lines))]
        self.body = [f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
                     f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
                     f'<text x="{(ml + w - mr) / 2}" y="{h - mb + 36}" text-anchor="middle">{_xml(xlabel)}</text>',
                     f'<text x="16" y="{(mt + h - mb) / 2}" text-anchor="middle" '
                     f'transform="rotate(-90 16 {(mt + h - mb) / 2})">{_xml(ylabel)}</text>']
        for v in self.y_ticks:
            y = self.py(v)
            self.body.append(f'<line x1="{ml - 4}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
            self.body.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">'
                             f'{tick_label(v, self.y_ticks, log_y)}</text>')
        for v in self.x_ticks:
            self.body.append(f'<line x1="{self.px(v):.1f}" y1="{h - mb}" x2="{self.px(v):.1f}" y2="{h - mb + 4}" '
                             'stroke="black"/>')
            self.body.append(f'<text x="{self.px(v):.1f}" y="{h - mb + 16}" text-anchor="middle">'
                             f'{tick_label(v, self.x_ticks, log_x)}</text>')

    def fx(self, x: float) -> float:
        """`x` in axis units (log10 of it on a log axis)."""
        return math.log10(max(x, 1e-12)) if self.log_x else x

    def fy(self, y: float) -> float:
        return math.log10(max(y, 1e-12)) if self.log_y else y

    def px(self, x: float) -> float:
        return self.ml + (self.fx(x) - self.x0) / (self.x1 - self.x0) * (self.w - self.ml - self.mr)

    def py(self, y: float) -> float:
        return self.h - self.mb - (self.fy(y) - self.y0) / (self.y1 - self.y0) * (self.h - self.mt - self.mb)

    def band(self, xa: float, xb: float, label: str, fill: str, ink: str) -> None:
        """A shaded span of x behind everything, labelled at its top left."""
        self.background.append(f'<rect x="{self.px(xa):.1f}" y="{self.mt}" width="{self.px(xb) - self.px(xa):.1f}" '
                               f'height="{self.h - self.mt - self.mb}" fill="{fill}"/>')
        self.background.append(f'<text x="{self.px(xa) + 4:.1f}" y="{self.mt + 12}" fill="{ink}">{label}</text>')

    def marker(self, x: float, label: str, colour: str, row: int = 0) -> None:
        """A dashed vertical line at x, labelled (row: which of a few label heights)."""
        if not self.x0 <= self.fx(x) <= self.x1:
            return
        self.body.append(f'<line x1="{self.px(x):.1f}" y1="{self.mt}" x2="{self.px(x):.1f}" y2="{self.h - self.mb}" '
                         f'stroke="{colour}" stroke-dasharray="4 3"/>')
        at, anchor = self.px(x) + 4, ""
        if at + text_width(label, 11) > self.w - self.mr:  # near the right edge: the label to the left
            at, anchor = self.px(x) - 4, ' text-anchor="end"'
        self.body.append(f'<text x="{at:.1f}" y="{self.mt + 12 + 13 * row}" fill="{colour}" '
                         f'font-size="11"{anchor}>{_xml(label)}</text>')

    def line(self, points: Sequence[tuple[float, float]], label: str, colour: str, *, width: float = 2,
             dash: str = "", opacity: float | None = None, dot: float | None = None) -> None:
        """A polyline through `points` (as given), a dot of radius `dot` on each point if set, and
        its legend entry."""
        style = f' stroke-dasharray="{dash}"' if dash else ""
        if len(points) > 1:
            path = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in points)
            fade = "" if opacity is None else f' stroke-opacity="{opacity:g}"'
            self.body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="{width:g}"'
                             f'{style}{fade}/>')
        if dot is not None:
            for x, y in points:
                self.body.append(f'<circle cx="{self.px(x):.1f}" cy="{self.py(y):.1f}" r="{dot:.1f}" fill="{colour}"/>')
        x, y = self.w - self.mr + 10, self.mt + 18 * self.legend
        self.body.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{colour}" '
                         f'stroke-width="{min(width, 4):g}"{style}/>')
        self.body.append(f'<text x="{x + 25}" y="{y + 4}">{_xml(label)}</text>')
        self.legend += 1

    def whisker(self, x: float, low: float, high: float, colour: str, cap: float = 4, dx: float = 0) -> None:
        """A vertical line from `low` to `high` at `x` (moved `dx` pixels, so that whiskers of
        several series at one x stay apart), capped at both ends: a point's spread."""
        px, a, b = self.px(x) + dx, self.py(low), self.py(high)
        self.body.append(f'<path d="M{px:.1f},{a:.1f}V{b:.1f}M{px - cap:.1f},{a:.1f}h{2 * cap:g}'
                         f'M{px - cap:.1f},{b:.1f}h{2 * cap:g}" stroke="{colour}" stroke-width="1.2" fill="none"/>')

    def rug(self, xs: Sequence[float], label: str, colour: str, length: int = 6) -> None:
        """A short tick under the x axis at each of `xs` (events too many to label one by one, as
        `marker` does; under the axis, where no line hides them), one per pixel column, and its
        legend entry."""
        columns = sorted({round(self.px(x)) for x in xs if self.x0 <= self.fx(x) <= self.x1})
        y = self.h - self.mb + 1
        path = " ".join(f"M{c},{y}v{length}" for c in columns)
        if path:
            self.body.append(f'<path d="{path}" stroke="{colour}" stroke-width="1"/>')
        x, ly = self.w - self.mr + 10, self.mt + 18 * self.legend
        self.body.append(f'<line x1="{x + 10}" y1="{ly + 4}" x2="{x + 10}" y2="{ly - 4}" stroke="{colour}"/>')
        self.body.append(f'<text x="{x + 25}" y="{ly + 4}">{_xml(label)}</text>')
        self.legend += 1

    def note(self, text: str) -> None:
        """A legend entry without a line (a remark on the lines above it)."""
        x, y = self.w - self.mr + 10, self.mt + 18 * self.legend
        self.body.append(f'<text x="{x}" y="{y + 4}" font-size="10">{text}</text>')
        self.legend += 1

    def svg(self) -> str:
        return "\n".join(self.background + self.body + ["</svg>"]) + "\n"


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
               *, log_x: bool = False, log_y: bool = False, integer_x: bool = False,
               spread: dict[str, list[tuple[float, float, float]]] | None = None,
               footnotes: Sequence[str] = ()) -> str:
    """A `Chart` fitted to `series`: one line with dots per series (y from 0 on a linear axis,
    5% headroom), and for a series in `spread` a whisker from `low` to `high` at each of its
    `(x, low, high)` (the points are then typically medians, the whiskers their range).

    Series are drawn first to last with shrinking widths and their own dash patterns, so one
    that lies on another stays visible; `footnotes` are printed under the chart (what a point
    averages, why a line stops), wrapped to its width."""
    spread = spread or {}
    w, h = 640, 400
    pts = [p for s in series.values() for p in s] + [(x, v) for s in spread.values() for x, lo, hi in s
                                                     for v in (lo, hi)]
    if log_y:
        pts = [(x, y) for x, y in pts if y > 0]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"></svg>\n'
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    y0, y1 = min(ys), max(ys)
    if not log_y:
        y0 = min(y0, 0.0)
        y1 += (y1 - y0) * 0.05
    chart = Chart((min(xs), max(xs)), (y0, y1), title=title, xlabel=xlabel, ylabel=ylabel, width=w, height=h,
                  margins=(70, 150, 40, 50), log_x=log_x, log_y=log_y, integer_x=integer_x, footnotes=footnotes)
    n = len(series)
    for i, (name, s) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        for x, lo, hi in spread.get(name, ()):
            chart.whisker(x, lo, hi, colour, dx=5 * (i - (n - 1) / 2))
        # The first series widest, drawn first: later ones lie on top.
        chart.line(sorted(s), name, colour, width=2 + 1.5 * (n - 1 - i),
                   dash=DASHES[i % len(DASHES)], opacity=0.85, dot=2 + (n - 1 - i) * 0.7)
    return chart.svg()
