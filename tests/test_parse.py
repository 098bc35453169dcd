"""The grammar and the parser: both spec-language examples, shapes, friendly syntax errors with positions."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from schedc.diagnostics import SpecError
from schedc.parse import Assign, Block, Statement, parse_statements, parse_text

SPECS = Path(__file__).parent.parent / "specs"


def test_design_examples_parse_exactly_as_written():
    doc = parse_text((SPECS / "example.sched").read_text(), "example.sched")
    assert [b.name for b in doc.items] == ["cluster", "stages", "train", "failures", "schedule"]
    all_block = doc.items[1].items[0]
    assert isinstance(all_block, Block) and all_block.name == "all"
    # several assignments on one line
    assert [a.key for a in all_block.items[:3]] == ["forward", "backward_input", "backward_weight"]
    fwd = all_block.items[0].value
    assert (fwd.number, fwd.unit) == (Fraction(1), "ms")
    fail, slow = doc.items[3].items
    assert isinstance(fail, Statement) and fail.verb == "fail" and fail.target == "gpu"
    assert [(a.name, int(a.value.number)) for a in fail.args] == [("dp", 1), ("pp", 2)]
    assert slow.setting.key == "speed" and slow.setting.value.number == Fraction(1, 2)

    doc = parse_text((SPECS / "gpt-1.3b.sched").read_text(), "gpt.sched")
    model = doc.items[0]
    assert model.name == "model" and model.label.string == "gpt-1.3b"
    part = doc.items[2]
    assert [(a.index.text, a.value.start, a.value.stop) for a in part.items] == [
        ("0", 0, 7), ("1", 7, 13), ("2", 13, 19), ("3", 19, 24)]
    assert doc.items[4].items[0].target == "node" and doc.items[4].items[0].index.text == "1"


def test_spans_point_at_values():
    doc = parse_text("train {\n  microbatches =  16\n}\n", "t")
    a = doc.items[0].items[0]
    assert isinstance(a, Assign)
    assert (a.value.span.line, a.value.span.column, a.value.span.end_column) == (2, 19, 21)
    assert (a.key_span.line, a.key_span.column) == (2, 3)


@pytest.mark.parametrize("text,unit,number", [
    ("1.0ms", "ms", Fraction(1)), ("40GiB", "GiB", Fraction(40)), ("25GB/s", "GB/s", Fraction(25)),
    ("312TFLOPS", "TFLOPS", Fraction(312)), ("1e-3", "", Fraction(1, 1000)), ("-8MiB", "MiB", Fraction(-8)),
    ("1.5e3us", "us", Fraction(1500)), (".5", "", Fraction(1, 2)),
])
def test_numbers_with_units(text, unit, number):
    v = parse_text(f"x {{ k = {text} }}").items[0].items[0].value
    assert (v.kind, v.unit, v.number) == ("number", unit, number)


def test_values_of_every_kind():
    items = parse_text('x { a = "s\\"q"  b = true  c = zb-h1  d = layers[2:5]  e = false }').items[0].items
    assert [i.value.kind for i in items] == ["string", "bool", "word", "slice", "bool"]
    assert items[0].value.string == 's"q' and items[1].value.boolean is True
    assert items[2].value.string == "zb-h1" and (items[3].value.start, items[3].value.stop) == (2, 5)


def test_keywords_only_where_statements_start():
    # `fail` may be a value, but not a key
    assert parse_text("x { a = fail }").items[0].items[0].value.text == "fail"
    with pytest.raises(SpecError) as e:
        parse_text("x { fail = 3 }")
    assert e.value.codes == ["E102"] and "keyword" in e.value.diagnostics[0].message


@pytest.mark.parametrize("text,code,line,col", [
    ("cluster { dp 4 }", "E104", 1, 14),
    ("a {\n  b = 1\n", "E103", 1, 3),
    ("a { b = 1 } }", "E105", 1, 13),
    ('a { b = "x }', "E108", 1, 9),
    ("a { b = 1; }", "E101", 1, 10),
    ("a { b = }", "E102", 1, 9),
    ("a { b = 1 c d }", "E104", 1, 13),
    ("a {\n  b = 1\n  c = = 2 }", "E102", 3, 7),
    ("a { b = @ }", "E101", 1, 9),
])
def test_syntax_errors_are_friendly_and_placed(text, code, line, col):
    with pytest.raises(SpecError) as e:
        parse_text(text, "t")
    (d,) = e.value.diagnostics
    assert (d.code, d.span.line, d.span.column) == (code, line, col), e.value.render()
    assert "Unexpected" not in d.message and "Token(" not in d.message  # no raw lark text


@pytest.mark.parametrize("value, col, message, label, hint", [
    # a unit of the language, apart from its number
    ("1 GB", 22, "a space between `1` and its unit `GB`", "the unit must touch its number", "write `1GB`"),
    ("1 GB/s", 22, "a space between `1` and its unit `GB/s`", "the unit must touch its number", "write `1GB/s`"),
    # not a unit of the language (and apart): its kind's units, and the nearest one where one is near
    ("1 gb", 22, "unknown unit `gb` after the number `1`", "did you mean `GB`?",
     "a unit touches its number (`1GB`); units: size: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    ("1 GIB", 22, "unknown unit `GIB` after the number `1`", "did you mean `GiB`?", "(`1GiB`); units: size: B,"),
    ("2 msec", 22, "unknown unit `msec` after the number `2`", "did you mean `ms`?", "units: time: ns, us, ms, s"),
    ("1 gb/s", 22, "unknown unit `gb/s` after the number `1`", "did you mean `GB/s`?", "units: bandwidth: a size"),
    ("1 foo", 22, "unknown unit `foo` after the number `1`", "not a unit",
     "units: time: ns, us, ms, s; size: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; bandwidth: a size unit + /s"),
])
def test_a_unit_apart_from_its_number_is_e204_at_the_unit(value, col, message, label, hint):
    """`memory = 1 GB` said E104, "missing `=`" (after `gb` for an unknown unit, pointing past it)."""
    with pytest.raises(SpecError) as e:
        parse_text(f"cluster {{\n    gpu {{ memory = {value} }}\n    dp = 2\n}}\n", "t")
    (d,) = e.value.diagnostics
    assert (d.code, d.span.line, d.span.column, d.message, d.label) == ("E204", 2, col, message, label), \
        e.value.render()
    assert hint in d.hint


def test_a_word_after_a_number_that_is_no_unit_is_still_a_key_missing_its_equals():
    for text, col in (("cluster { dp = 2 pp 4 }", 21), ("a { b = 1 c d }", 13)):
        with pytest.raises(SpecError) as e:
            parse_text(text, "t")
        assert [(d.code, d.span.column) for d in e.value.diagnostics] == [("E104", col)], e.value.render()


def test_event_statements():
    (st,) = parse_statements("recover gpu(dp=1, pp=2)")
    assert st.verb == "recover" and [a.name for a in st.args] == ["dp", "pp"]
    with pytest.raises(SpecError) as e:
        parse_statements("fail gpu(dp=1, pp=2", "<event>")
    assert e.value.diagnostics[0].span.file == "<event>"
