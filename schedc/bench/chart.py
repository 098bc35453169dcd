"""Line charts as SVG text, for every benchmark figure (no plotting library is a dependency).

`Chart` is the one drawing helper: axes (linear or log10) with five ticks each,
lines with optional markers and dash patterns, a legend, shaded bands,
labelled vertical markers, ticks on the x axis for many events, and footnotes
under the plot (text is escaped for XML). `line_chart` fits a
`Chart` to a few series (what `schedc bench` draws); the hand-run scripts in
bench/ build a `Chart` themselves.
"""

from __future__ import annotations

import math
from typing import Sequence

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
DASHES = ["", "7,4", "2,3", "9,3,2,3", "4,4"]


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Chart:
    """A plot area from `x` to `y` (each a (low, high) pair, in axis units: log10 of the value on
    a log axis) with a title, axis labels, grid lines, a legend on the right and `footnotes` under
    the plot. Five ticks per axis, evenly spaced in axis units, unless `x_ticks` lists the values
    to label. Draw with `line`, `band`, `marker`, `rug` and `note`; `svg()` gives the text."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], *, title: str, xlabel: str,
                 ylabel: str, width: int = 720, height: int = 360, margins: tuple[int, int, int, int] = (60, 150, 40, 45),
                 log_x: bool = False, log_y: bool = False, x_ticks: Sequence[float] | None = None,
                 x_format: str = ".1f", y_format: str = ".2f", footnotes: Sequence[str] = ()):
        self.x0, self.x1 = x
        self.y0, self.y1 = y
        self.log_x, self.log_y = log_x, log_y
        self.w, self.h = width, height
        self.ml, self.mr, self.mt, self.mb = margins
        self.legend = 0
        w, h, ml, mr, mt, mb = self.w, self.h, self.ml, self.mr, self.mt, self.mb
        self.background = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
                           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
                           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{_xml(title)}</text>',
                           *(f'<text x="{ml}" y="{h - 16 * (len(footnotes) - k) + 4}" font-size="11" '
                             f'fill="#444">{_xml(n)}</text>' for k, n in enumerate(footnotes))]
        self.body = [f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
                     f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
                     f'<text x="{(ml + w - mr) / 2}" y="{h - mb + 36}" text-anchor="middle">{_xml(xlabel)}</text>',
                     f'<text x="16" y="{(mt + h - mb) / 2}" text-anchor="middle" '
                     f'transform="rotate(-90 16 {(mt + h - mb) / 2})">{_xml(ylabel)}</text>']
        for i in range(5):
            tv = self.y0 + (self.y1 - self.y0) * i / 4
            v = 10 ** tv if log_y else tv
            y = h - mb - (tv - self.y0) / (self.y1 - self.y0) * (h - mt - mb)
            self.body.append(f'<line x1="{ml - 4}" y1="{y:.1f}" x2="{w - mr}" y2="{y:.1f}" stroke="#ddd"/>')
            self.body.append(f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{v:{y_format}}</text>')
        if x_ticks is None:
            tvs = [self.x0 + (self.x1 - self.x0) * i / 4 for i in range(5)]
            x_ticks = [10 ** tv for tv in tvs] if log_x else tvs
        for xv in x_ticks:
            self.body.append(f'<text x="{self.px(xv):.1f}" y="{h - mb + 16}" text-anchor="middle">'
                             f'{xv:{x_format}}</text>')

    def fx(self, x: float) -> float:
        """`x` in axis units."""
        return math.log10(x) if self.log_x else x

    def fy(self, y: float) -> float:
        return math.log10(max(y, 1e-6)) if self.log_y else y

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
        self.body.append(f'<text x="{self.px(x) + 4:.1f}" y="{self.mt + 12 + 13 * row}" fill="{colour}" '
                         f'font-size="11">{label}</text>')

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
               *, log_x: bool = False, log_y: bool = False, footnotes: Sequence[str] = ()) -> str:
    """A `Chart` fitted to `series`: one line with dots per series, an x tick at every x value
    (y from 0 on a linear axis, 5% headroom).

    Series are drawn first to last with shrinking widths and their own dash patterns, so one
    that lies on another stays visible; `footnotes` are printed under the chart (what a point
    averages, why a line stops)."""
    w, h = 640, 400 + 16 * len(footnotes)
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"></svg>\n'
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(max(v, 1e-6))) if log_y else (lambda v: v)
    xs, ys = [fx(x) for x, _ in pts], [fy(y) for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if not log_y:
        y0 = min(y0, 0.0)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - (pad if log_y else 0), y1 + pad
    chart = Chart((x0, x1), (y0, y1), title=title, xlabel=xlabel, ylabel=ylabel, width=w, height=h,
                  margins=(70, 150, 40, 50 + 16 * len(footnotes)), log_x=log_x, log_y=log_y,
                  x_ticks=sorted({x for x, _ in pts}), x_format="g", y_format=".3g", footnotes=footnotes)
    n = len(series)
    for i, (name, s) in enumerate(series.items()):
        # The first series widest, drawn first: later ones lie on top.
        chart.line(sorted(s), name, COLOURS[i % len(COLOURS)], width=2 + 1.5 * (n - 1 - i),
                   dash=DASHES[i % len(DASHES)], opacity=0.85, dot=2 + (n - 1 - i) * 0.7)
    return chart.svg()
