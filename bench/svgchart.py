"""A small line chart as SVG text, for the benchmarks' figures (no plotting dependency)."""

from __future__ import annotations


class Chart:
    """Axes from (x0, 0) to (x1, y1) with a title, axis labels, a grid, lines and a legend."""

    def __init__(self, x0: float, x1: float, y1: float, *, title: str, xlabel: str, ylabel: str,
                 width: int = 720, height: int = 360, legend_width: int = 150, x_digits: int = 1):
        self.x0, self.x1, self.y1 = x0, x1, y1
        self.w, self.h, self.ml, self.mr, self.mt, self.mb = width, height, 60, legend_width, 40, 45
        self.x_digits = x_digits
        self.legend = 0
        w, h, ml, mr, mt, mb = self.w, self.h, self.ml, self.mr, self.mt, self.mb
        self.background = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
                           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
                           f'<text x="{(ml + w - mr) / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
        self.body = [f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
                     f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
                     f'<text x="{(ml + w - mr) / 2}" y="{h - 10}" text-anchor="middle">{xlabel}</text>',
                     f'<text x="14" y="{(mt + h - mb) / 2}" text-anchor="middle" transform="rotate(-90 14 '
                     f'{(mt + h - mb) / 2})">{ylabel}</text>']
        for i in range(5):
            y = y1 * i / 4
            self.body.append(f'<line x1="{ml - 4}" y1="{self.py(y):.1f}" x2="{w - mr}" y2="{self.py(y):.1f}" '
                             'stroke="#ddd"/>')
            self.body.append(f'<text x="{ml - 6}" y="{self.py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
            x = x0 + (x1 - x0) * i / 4
            self.body.append(f'<text x="{self.px(x):.1f}" y="{h - mb + 16}" text-anchor="middle">'
                             f'{x:.{x_digits}f}</text>')

    def px(self, x: float) -> float:
        return self.ml + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.ml - self.mr)

    def py(self, y: float) -> float:
        return self.h - self.mb - y / self.y1 * (self.h - self.mt - self.mb)

    def band(self, xa: float, xb: float, label: str, fill: str, ink: str) -> None:
        """A shaded span of x behind everything, labelled at its top left."""
        self.background.append(f'<rect x="{self.px(xa):.1f}" y="{self.mt}" width="{self.px(xb) - self.px(xa):.1f}" '
                               f'height="{self.h - self.mt - self.mb}" fill="{fill}"/>')
        self.background.append(f'<text x="{self.px(xa) + 4:.1f}" y="{self.mt + 12}" fill="{ink}">{label}</text>')

    def marker(self, x: float, label: str, colour: str, row: int = 0) -> None:
        """A dashed vertical line at x, labelled (row: which of a few label heights)."""
        if not self.x0 <= x <= self.x1:
            return
        self.body.append(f'<line x1="{self.px(x):.1f}" y1="{self.mt}" x2="{self.px(x):.1f}" y2="{self.h - self.mb}" '
                         f'stroke="{colour}" stroke-dasharray="4 3"/>')
        self.body.append(f'<text x="{self.px(x) + 4:.1f}" y="{self.mt + 12 + 13 * row}" fill="{colour}" '
                         f'font-size="11">{label}</text>')

    def line(self, points: list[tuple[float, float]], label: str, colour: str) -> None:
        path = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in points)
        self.body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        self.note(label, colour)

    def note(self, text: str, colour: str | None = None) -> None:
        """A legend entry (with a swatch when `colour` is given)."""
        x, y = self.w - self.mr + 10, self.mt + 18 * self.legend
        if colour is not None:
            self.body.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{colour}" stroke-width="2"/>')
            self.body.append(f'<text x="{x + 25}" y="{y + 4}">{text}</text>')
        else:
            self.body.append(f'<text x="{x}" y="{y + 4}" font-size="10">{text}</text>')
        self.legend += 1

    def svg(self) -> str:
        return "\n".join(self.background + self.body + ["</svg>"]) + "\n"
