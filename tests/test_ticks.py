"""Chart axes (`schedc.ticks`, `schedc.bench.chart`): round ticks that cover the data, and text
that stays on the canvas."""

from __future__ import annotations

import math
import re

from hypothesis import given, strategies as st

from schedc.bench.chart import Chart, line_chart
from schedc.ticks import nice_ticks, text_width, wrap


def _round_step(step: float) -> bool:
    """`step` is 1, 2 or 5 x 10^k."""
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 5, 10))


def _multiples_of_a_round_step(ticks: list[float]) -> bool:
    step = ticks[1] - ticks[0]
    return (_round_step(step) and all(math.isclose(b - a, step, rel_tol=1e-6) for a, b in zip(ticks, ticks[1:]))
            and all(math.isclose(t / step, round(t / step), abs_tol=1e-6) for t in ticks))


def _round_on_a_log_axis(ticks: list[float]) -> bool:
    """Powers of ten evenly spaced, or each a 1, 2 or 5 x 10^k, or multiples of a round step."""
    exps = [math.log10(t) for t in ticks]
    if all(math.isclose(e, round(e), abs_tol=1e-9) for e in exps):
        gaps = {round(b - a) for a, b in zip(exps, exps[1:])}
        return len(gaps) == 1
    return all(_round_step(t) for t in ticks) or _multiples_of_a_round_step(ticks)


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(finite, finite, st.booleans())
def test_linear_ticks_are_round_cover_the_data_and_number_3_to_7(a, b, integer):
    lo, hi = min(a, b), max(a, b)
    ticks = nice_ticks(lo, hi, integer=integer)
    assert 3 <= len(ticks) <= 7, ticks
    assert ticks[0] <= lo and ticks[-1] >= hi, (lo, hi, ticks)
    assert _multiples_of_a_round_step(ticks), ticks
    if integer:
        assert all(t == int(t) for t in ticks), ticks
    if lo >= 0:
        assert ticks[0] >= 0, ticks  # no negative tick on a chart of non-negative data


@given(st.floats(min_value=-9, max_value=9), st.floats(min_value=0, max_value=12))
def test_log_ticks_are_powers_of_ten_or_their_2_5_multiples_and_cover_the_data(e, decades):
    lo, hi = 10 ** e, 10 ** (e + decades)
    ticks = nice_ticks(lo, hi, log=True)
    assert 3 <= len(ticks) <= 7, ticks
    assert ticks[0] <= lo * (1 + 1e-9) and ticks[-1] >= hi * (1 - 1e-9), (lo, hi, ticks)
    assert all(t > 0 for t in ticks) and _round_on_a_log_axis(ticks), ticks


def test_the_ticks_the_issue_saw_come_out_round():
    """The bench charts' axes once read 0.263, 0.525, 0.788 (linear), 0.0836, 0.282, 0.952 (log)
    and -1.1, 1.1, 3.2 (docs/figures)."""
    assert nice_ticks(0, 1.05) == [0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    assert nice_ticks(0.0836, 0.952, log=True) == [0.01, 0.1, 1.0]
    assert nice_ticks(-1.1, 7.5) == [-2, 0, 2, 4, 6, 8]
    assert nice_ticks(16, 4096, log=True) == [10, 100, 1000, 10000]
    assert nice_ticks(0.3, 0.9, log=True) == [0.2, 0.5, 1.0]
    assert nice_ticks(1, 2, integer=True) == [0, 1, 2]


def test_ranges_too_narrow_to_divide_still_get_round_ticks():
    """Cases Hypothesis found: a span that underflows when divided (a math domain error), and a
    log range narrower than two 1-2-5 steps (it fell back to ticks a millionth apart)."""
    assert nice_ticks(0.0, 5e-324) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(-5e-324, 6.0) == [-2, 0, 2, 4, 6]
    assert nice_ticks(31.622776, 31.622781, log=True) == [10, 20, 50]


def _texts(svg: str):
    width = float(re.search(r'<svg[^>]* width="([\d.]+)"', svg).group(1))
    height = float(re.search(r'<svg[^>]* height="([\d.]+)"', svg).group(1))
    out = []
    for m in re.finditer(r"<text ([^>]*)>([^<]*)</text>", svg):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))
        if "transform" in attrs:  # the rotated y label: it runs along the height
            continue
        text = m.group(2).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        x, size = float(attrs["x"]), float(attrs.get("font-size", 12))
        w = text_width(text, size)
        left = {"middle": x - w / 2, "end": x - w}.get(attrs.get("text-anchor", "start"), x)
        out.append((text, left, left + w, float(attrs["y"])))
    return width, height, out


def _on_canvas(svg: str) -> None:
    width, height, texts = _texts(svg)
    assert texts
    for text, left, right, y in texts:
        assert 0 <= left and right <= width, (text, left, right, width)
        assert 0 < y <= height, (text, y, height)


def test_a_long_footnote_wraps_within_the_canvas_and_the_canvas_grows_for_it():
    long = ("each point: the mean over the fail-stop scenarios with that many failed GPUs (1: 2, 2: 3, 3: 1, "
            "4: 2, 6: 2, 8: 1); their models and shapes differ, and this note goes on well past one line")
    series = {"cpsat": [(1, 0.79), (2, 0.52), (8, 0.26)], "drop-pipeline": [(1, 0.7), (2, 0.4)]}
    one = line_chart(series, "Throughput under failures", "failed GPUs", "throughput / fault-free",
                     integer_x=True, footnotes=["short"])
    two = line_chart(series, "Throughput under failures", "failed GPUs", "throughput / fault-free",
                     integer_x=True, footnotes=[long, "drop-pipeline: no plan beyond 2 failed GPUs (a stage lost "
                                                      "every replica, or it refuses that failure set)"])
    _on_canvas(one)
    _on_canvas(two)
    assert _texts(two)[1] > _texts(one)[1]  # taller by the wrapped lines
    assert len(wrap(long, 620, 11)) >= 2 and all(text_width(ln, 11) <= 620 for ln in wrap(long, 620, 11))


def test_markers_near_the_right_edge_keep_their_labels_on_the_canvas():
    chart = Chart((0, 50), (0, 2.3), title="t", xlabel="seconds", ylabel="iterations per second")
    chart.line([(0, 1.0), (50, 2.0)], "mitigated", "#1f77b4")
    chart.marker(49.5, "restore after the slow GPU recovered", "#d62728")
    _on_canvas(chart.svg())


def test_the_latency_chart_plots_medians_with_the_spread_as_whiskers():
    from schedc.bench.compare import latency_chart

    rows = [{"method": "cpsat", "gpus": 16, "runs": 5, "min_s": 0.01, "p50_s": 0.02, "max_s": 4.1},
            {"method": "cpsat", "gpus": 64, "runs": 5, "min_s": 0.05, "p50_s": 0.3, "max_s": 0.4},
            {"method": "greedy", "gpus": 16, "runs": 5, "min_s": 0.01, "p50_s": 0.015, "max_s": 0.02},
            {"method": "greedy", "gpus": 64, "runs": 5, "min_s": 0.04, "p50_s": 0.2, "max_s": 0.3}]
    svg = latency_chart(rows)
    _on_canvas(svg)
    assert svg.count("<polyline") == 2 and svg.count('stroke-width="1.2" fill="none"') == 4
    chart_top = re.findall(r'<text x="[\d.]+" y="[\d.]+" text-anchor="end">([^<]*)</text>', svg)
    assert chart_top == ["0.01", "0.1", "1", "10"]  # the y axis covers the slowest run, in round ticks
    words = " ".join(t for t, *_ in _texts(svg)[2])
    assert "the median solve time of the 5 run(s)" in words and "whiskers: fastest to slowest run" in words
