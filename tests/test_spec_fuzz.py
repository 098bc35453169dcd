"""Hypothesis: generated specs load to what was generated; any input gives a Spec or a SpecError."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schedc
from schedc.diagnostics import SpecError
from schedc.load import decode_spec, load_text
from schedc.printer import print_spec
from spec_strategies import spec_texts

# The fuzz tests share the profile's budget: a few thousand examples in CI in total.
_BASE = settings().max_examples
FUZZ = settings(max_examples=max(20, _BASE * 2), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

_VALID = open(os.path.join(os.path.dirname(__file__), "..", "specs", "example.sched"), encoding="utf-8").read()


def _input_lines(text: str) -> list[str]:
    """The input's lines as an editor shows them: `\n`, `\r\n` and a lone `\r` end a line
    (the parser reads a lone `\r` as a break, as `str.splitlines` does); nothing else does."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _assert_within_lines(exc: SpecError, text: str) -> None:
    """Every span (and note) of `exc` lies on a line of `text`. A line of n characters has
    columns 1..n+1 (n+1: its end, where an "unexpected end" caret goes); a span's end column,
    exclusive, is at most one past that."""
    lines = _input_lines(text)
    for d in exc.diagnostics:
        for span in (d.span, *(n.span for n in d.notes)):
            if span is None:
                continue
            assert 1 <= span.line <= span.end_line <= len(lines), (d, text)
            assert 1 <= span.column <= len(lines[span.line - 1]) + 1, (d, text)
            assert 1 <= span.end_column <= len(lines[span.end_line - 1]) + 2, (d, text)
            assert (span.end_line, span.end_column) >= (span.line, span.column), (d, text)


def _assert_clean(text: str) -> None:
    """A valid Spec or a SpecError whose diagnostics all point inside the input."""
    try:
        load_text(text, name="fuzz")
    except SpecError as exc:
        assert exc.diagnostics
        exc.render()
        _assert_within_lines(exc, text)


#: Pieces of specs, line breaks of every kind (and characters `str.splitlines` breaks at that a
#: spec does not), and bytes that are not UTF-8.
_PIECES = st.one_of(
    st.sampled_from(["cluster", "{", "}", "=", "dp", "pp", " ", "\t", "1", "2GiB", "1ms", '"s"', "#c",
                     "stages", "all", "fail gpu(dp=0, pp=0)", "failures", "train"]).map(str.encode),
    st.sampled_from([b"\r", b"\n", b"\r\n", b"\x0c", "\u2028".encode(), "\x85".encode(), b"\xef\xbb\xbf"]),
    st.binary(min_size=1, max_size=2))


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.lists(_PIECES, max_size=60).map(b"".join)))
def test_every_diagnostic_of_any_input_points_within_its_lines(data):
    """Bytes through `schedc.load`: E106 (not UTF-8) counts lines as the parser does (a lone CR
    is a break: `0d d8` is line 2, column 1), and so does every later diagnostic."""
    try:
        schedc.load(data)
    except SpecError as exc:
        exc.render()
        text = data.decode("utf-8", "replace")
        _assert_within_lines(exc, text[1:] if text.startswith("\ufeff") else text)


def test_a_bad_byte_after_a_lone_carriage_return_is_on_the_next_line():
    try:
        schedc.load(b"\r\xd8")
    except SpecError as exc:
        (d,) = exc.diagnostics
        assert d.code == "E106" and (d.span.line, d.span.column, d.span.end_column) == (2, 1, 2)
        assert exc.render().splitlines()[1:5] == [" --> <spec>:2:1", "  |", "2 | \ufffd", "  | ^ not UTF-8"]
    else:
        raise AssertionError("`0d d8` loaded")


def test_an_excerpt_is_the_line_the_span_counts():
    """A form feed is no line break to the parser: the excerpt of a replan event's typo is the
    line its span counts, not the one before (`str.splitlines` would split at the form feed)."""
    from schedc.events import parse_events

    try:
        parse_events("fail gpu(dp=0,\x0c pp=0)\nfial gpu(dp=1, pp=0)")
    except SpecError as exc:
        rendered = exc.render().splitlines()
        assert exc.diagnostics[0].span.line == 2 and rendered[3] == "2 | fial gpu(dp=1, pp=0)", rendered
    else:
        raise AssertionError("parsed")


@FUZZ
@given(spec_texts())
def test_generated_specs_load_to_their_values(case):
    text, v = case
    spec = load_text(text)
    assert (spec.dp, spec.pp, spec.cluster.gpus_per_node) == (v["dp"], v["pp"], v["gpus_per_node"])
    assert spec.cluster.placement == v["placement"] and spec.microbatches == v["microbatches"]
    assert spec.cluster.gpu.memory == v["memory"]
    assert (spec.cluster.link.latency, spec.cluster.link.bandwidth) == (v["latency"], v["bandwidth"])
    for got, want in zip(spec.stages, v["stages"]):
        assert {k: getattr(got, k) for k in want} == want
    assert {(g.dp, g.pp) for g in spec.gpus if not g.live} == set(v["failed"])
    assert {((g.dp, g.pp), g.speed) for g in spec.gpus if g.live and (g.dp, g.pp) in dict(v["slow"])} == \
        {(c, s) for c, s in v["slow"]}
    assert spec.schedule.solver == v["solver"]
    assert (None if spec.recovery is None else vars(spec.recovery)) == v["recovery"]
    for g in spec.gpus:
        assert spec.cluster.rank_of(g.dp, g.pp) == g.rank
    assert schedc.load(print_spec(spec)) == spec


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(text):
    _assert_clean(text)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    try:
        text = decode_spec(data, "fuzz")
    except SpecError as exc:
        assert exc.codes == ["E106"]
        return
    _assert_clean(text)


_TOKENS = _VALID.replace("{", " { ").replace("}", " } ").split()


@FUZZ
@given(st.data())
def test_mutated_valid_specs_never_crash(data):
    tokens = list(_TOKENS)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(tokens) - 1))
        op = data.draw(st.sampled_from(["delete", "duplicate", "swap", "replace"]))
        if op == "delete":
            del tokens[i]
        elif op == "duplicate":
            tokens.insert(i, tokens[i])
        elif op == "swap":
            j = data.draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            tokens[i] = data.draw(st.sampled_from(["=", "{", "}", "0", "-1", "1.5", "x", '"s"', "fail", "9GiB",
                                                   "layers[1:0]", "stage", "gpu(dp=9, pp=0)", "node"]))
    sep = data.draw(st.sampled_from([" ", "\n"]))
    _assert_clean(sep.join(tokens))
