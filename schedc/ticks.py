"""Round axis ticks, and the width text takes, for every SVG schedc draws (the benchmark charts
of `schedc.bench.chart`, `schedc replay --plot`, the timeline of `schedc.export.svg`).

`nice_ticks` gives 3-7 round values (steps of 1, 2 or 5 x 10^k; on a log axis powers of ten,
with the 2 and 5 multiples between them when the range spans less than a decade or two) that
cover a data range; a chart then spans its first to its last tick. `text_width` estimates how
wide a line of text is drawn, so that a chart can wrap what would leave its canvas (`wrap`).
"""

from __future__ import annotations

import math

#: Width of an average character in a sans-serif font, as a share of the font size. DejaVu Sans
#: (the widest of the usual fallbacks) averages about 0.55 over lower-case text and digits;
#: 0.6 leaves room for capitals. Re-measure by rendering a long line and dividing its width by
#: its length and font size.
CHAR_WIDTH = 0.6
#: A data range narrower than this is drawn as one value (no chart plots such a span, and the
#: arithmetic of a step underflows below it).
TINY_SPAN = 1e-300


def nice_step(span: float, target: int = 5) -> float:
    """The smallest step of 1, 2 or 5 x 10^k that cuts `span` into at most `target` parts."""
    raw = span / target
    if not raw > 0 or not math.isfinite(raw):  # no span, or one too small to divide (5e-324 / 6 is 0)
        return 1.0
    base = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * base >= raw * (1 - 1e-9):
            return m * base
    return 10 * base


def _clean(v: float, step: float) -> float:
    """`v` rounded to the digits `step` has, so 3 x 0.1 reads 0.3, not 0.30000000000000004."""
    digits = max(0, -math.floor(math.log10(step)) + 1)
    out = round(v, digits)
    return 0.0 if out == 0 else out


def linear_ticks(lo: float, hi: float, *, most: int = 7, integer: bool = False) -> list[float]:
    """Multiples of one 1-2-5 step from the largest at or below `lo` to the smallest at or above
    `hi`: at least 3 and at most `most` of them (the finest step that stays within `most`)."""
    if hi < lo:
        lo, hi = hi, lo
    # One value (up to rounding, or a span no chart draws): a range around it.
    if hi - lo <= max(1e-9 * max(abs(lo), abs(hi)), TINY_SPAN):
        pad = abs(lo) / 2 or 1.0
        lo, hi = (lo - pad if lo - pad >= 0 or lo < 0 else 0.0), hi + pad
    step = nice_step(hi - lo, most - 1)  # the finest step: any finer needs more than `most` ticks
    if integer:
        step = max(step, 1.0)
    while True:
        first, last = math.floor(lo / step), math.ceil(hi / step)
        # lo / step can come out a hair under a whole number (0.6 / 0.2 = 2.9999999999999996)
        if _clean((first + 1) * step, step) <= lo:
            first += 1
        if _clean((last - 1) * step, step) >= hi:
            last -= 1
        # ... or a hair over one (-5e-324 / 2 underflows to -0.0, whose floor is 0)
        if _clean(first * step, step) > lo:
            first -= 1
        if _clean(last * step, step) < hi:
            last += 1
        if last - first + 1 <= most:
            break
        step = nice_step(step * 1.01, 1)  # the next 1-2-5 step up
    ticks = [_clean(k * step, step) for k in range(first, last + 1)]
    while len(ticks) < 3:  # a narrow range: one more step, below if that stays >= 0 or the data is < 0
        below = _clean(ticks[0] - step, step)
        if below >= 0 or lo < 0:
            ticks.insert(0, below)
        else:
            ticks.append(_clean(ticks[-1] + step, step))
    return ticks


def log_ticks(lo: float, hi: float, *, most: int = 7) -> list[float]:
    """Ticks for a log axis over [lo, hi] (values, both > 0): powers of ten (every k-th one over
    many decades); over a decade or two the 2 and 5 multiples too; within a narrower range,
    `linear_ticks`. The first is at or below `lo`, the last at or above `hi`."""
    lo, hi = min(lo, hi), max(lo, hi)
    if not lo > 0:
        raise ValueError(f"a log axis needs positive values, not {lo}")
    e0, e1 = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    if e1 == e0:
        e1 += 1
    if e1 - e0 + 1 >= 3:
        k = max(1, math.ceil((e1 - e0) / (most - 1)))
        while math.ceil(e1 / k) - math.floor(e0 / k) + 1 > most:  # aligned to k, one more may be needed
            k += 1
        return [10.0 ** e for e in range(k * math.floor(e0 / k), k * math.ceil(e1 / k) + 1, k)]
    values = sorted(m * 10.0 ** e for e in range(e0 - 1, e1 + 1) for m in (1, 2, 5))
    first = max(v for v in values if v <= lo * (1 + 1e-9))
    last = min(v for v in values if v >= hi * (1 - 1e-9))
    ticks = [_clean(v, v / 10) for v in values if first <= v <= last]
    if len(ticks) < 3:  # a range narrower than two 1-2-5 steps: the 1-2-5 values around it
        below = [v for v in values if v < first]
        ticks = [_clean(v, v / 10) for v in below[-(3 - len(ticks)):]] + ticks
    if 3 <= len(ticks) <= most:
        return ticks
    return [t for t in linear_ticks(lo, hi, most=most) if t > 0] or ticks


def nice_ticks(lo: float, hi: float, *, log: bool = False, most: int = 7, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] (data values, not log10 of them): `log_ticks` on a
    log axis, else `linear_ticks`."""
    return log_ticks(lo, hi, most=most) if log else linear_ticks(lo, hi, most=most, integer=integer)


def tick_label(value: float, ticks: list[float], log: bool = False) -> str:
    """`value` as its axis prints it: on a linear axis with as many decimals as the step needs
    (0.0, 0.5, 1.0), on a log axis as few as the value needs (0.01, 0.2, 1000)."""
    if log or len(ticks) < 2:
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0e}"
    step = abs(ticks[1] - ticks[0])
    digits = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{digits}f}"


def text_width(text: str, size: float) -> float:
    """About how many pixels `text` takes at font size `size` (see CHAR_WIDTH)."""
    return len(text) * size * CHAR_WIDTH


def wrap(text: str, width: float, size: float) -> list[str]:
    """`text` cut at spaces into lines no wider than `width` pixels at font size `size` (a word
    longer than a line stays whole on a line of its own)."""
    limit = max(1, int(width / (size * CHAR_WIDTH)))
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= limit:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]
