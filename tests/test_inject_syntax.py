"""The --inject language on its own (grammar/inject.lark): what a text says, and its syntax errors
with the injection shown, a caret under the offending word and a suggestion for a near miss.
Checks against a plan (E207, E561, E562) are in test_live_units.py."""

from __future__ import annotations

import pytest

from schedc.diagnostics import SpecError
from schedc.failures import failure_from_statement
from schedc.live.inject_syntax import Moment, parse_injection
from schedc.parse import parse_statements


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as exc:
        parse_injection(text, 0)
    assert len(exc.value.diagnostics) == 1
    return exc.value


@pytest.mark.parametrize("event", [
    "fail gpu(dp=1, pp=2)", "fail rank 3", "fail node 1", "slow gpu(dp=0, pp=1) speed = 0.25",
    "recover gpu(dp=1, pp=0)",
])
def test_the_event_is_read_as_the_spec_reads_a_failure_statement(event):
    (st,) = parse_statements(event)
    failure, _ = failure_from_statement(st, allow_recover=True)
    assert parse_injection(f"at iteration 1: {event}", 0).failure == failure


@pytest.mark.parametrize("text, moment, action", [
    ("at iteration 2 after F 1: hang rank 3", Moment("iteration", 2, "after", "F", 1), "stop"),
    ("at iteration 2 during optimizer: fail rank 3", Moment("iteration", 2, "during", "O"), "kill"),
    ("at iteration 2 during Backward_Weight: fail rank 3", Moment("iteration", 2, "during", "W"), "kill"),
    ("at recovery 3: fail rank 1", Moment("recovery", generation=3), "kill"),
    ("at 800ms: recover gpu(dp=0, pp=0)", Moment("time", seconds=0.8), "rejoin"),
    ("at 2 s: hang node 0", Moment("time", seconds=2.0), "stop"),
    ("  at   iteration 1 :fail rank 0  ", Moment("iteration", 1), "kill"),
])
def test_moments_and_actions(text, moment, action):
    parsed = parse_injection(text, 0)
    assert (parsed.moment, parsed.action) == (moment, action)


def test_slowdowns_carry_their_speed_delay_and_end():
    slow = parse_injection("at iteration 1: slow gpu(dp=0, pp=1) speed = 0.5 until iteration 4", 0)
    assert (slow.action, slow.speed, slow.until, slow.failure.kind) == ("slow", 0.5, 4, "slow_gpu")
    link = parse_injection("at iteration 1: slow link gpu(dp=0, pp=1) delay = 250us", 0)
    assert (link.action, link.delay, link.until, link.failure.kind) == ("slow_link", 0.00025, None, "fail_gpu")
    assert parse_injection("at iteration 1: slow link rank 2 delay = 1s", 0).failure.rank == 2


def test_spans_locate_the_moments_words_the_event_and_until():
    text = "at iteration 12 during W 3: slow link rank 1 delay = 1ms until iteration 40"
    with pytest.raises(SpecError):  # a slowdown starts at an iteration's start: the phase is shown
        parse_injection(text, 0)
    spans = parse_injection("at iteration 12 during W 3: fail rank 1", 4).spans
    assert {k: (s.file, s.column, s.end_column) for k, s in spans.items()} == {
        "iteration": ("<inject 5>", 14, 16), "phase": ("<inject 5>", 17, 23), "op": ("<inject 5>", 24, 25),
        "mb": ("<inject 5>", 26, 27), "event": ("<inject 5>", 29, 40)}
    spans = parse_injection("at iteration 1: slow gpu(dp=0, pp=0) speed = 0.5 until iteration 40", 0).spans
    assert (spans["event"].column, spans["event"].end_column) == (17, 49)
    assert (spans["until"].column, spans["until"].end_column) == (66, 68)


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, code, column, message, label", [
    ("at iteraton 1: fail rank 0", "E560", 4, "unknown moment `iteraton`", "did you mean `iteration`?"),
    ("at iteration 1 durng B: fail rank 0", "E560", 16, "unexpected `durng` after `iteration 1`",
     "did you mean `during`?"),
    ("at iteration 1 during forwad: fail rank 0", "E560", 23, "unknown op kind `forwad`", "did you mean `forward`?"),
    ("at iteration 1: fial rank 0", "E560", 17, "cannot inject `fial`", "did you mean `fail`?"),
    # A keyword ends at the end of its word: `failed` is one (misspelt) word.
    ("at iteration 1: failed rank 0", "E560", 17, "cannot inject `failed`", "did you mean `fail`?"),
    ("at iteration 1: slow lnk rank 1 delay = 2ms", "E560", 22, "`slow` cannot name `lnk`", "did you mean `link`?"),
    ("at iteration 1: slow link rank 1 dealy = 2ms", "E560", 34, "unknown setting `dealy` of `slow link`",
     "did you mean `delay`?"),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed = 0.5 untl iteration 3", "E560", 50,
     "unexpected `untl` after the event", "did you mean `until`?"),
    ("attack iteration 1: fail rank 0", "E560", 1, "an injection starts with `at`", "expected `at`"),
    ("at: fail rank 0", "E560", 3, "the injection has no moment after `at`", "expected a moment"),
    ("at iteration 1:", "E560", 16, "the injection has no event after `:`", "expected an event"),
    ("at iteration 1", "E560", 15, "missing `:` between the moment and the event", "expected `:` here"),
    ("at iteration", "E560", 13, "the injection needs an iteration number here", "expected an iteration number"),
    ("at iteration 1.5: fail rank 0", "E560", 14,
     "an iteration number must be a whole number from 0 to 999,999,999, got `1.5`", "expected 0 to 999,999,999"),
    ("at iteration 1 during: fail rank 0", "E560", 22, "`during` needs an op kind", "expected F, B, W or O"),
    ("at iteration 1 during B 1 2: fail rank 0", "E560", 27, "unexpected `2`; expected `:`", "unexpected here"),
    ("at 3 sec: fail rank 0", "E560", 6, "unexpected `sec` after the time", "expected `:`"),
    ("at 3min: fail rank 0", "E560", 4, "a moment's time is in s or ms, not `min`", "write s or ms"),
    ("at -1s: fail rank 0", "E560", 4, "a moment's time must be from 0 to 1,000,000 s after the start (11.6 days), "
     "got `-1s`", "expected 0 to 1,000,000 s"),
    ("at iteration 1; fail rank 0", "E560", 15, "unexpected character `;`", "not part of an injection"),
    ("at iteration 1: fail rank 1 fail rank 2", "E560", 29, "an injection has exactly one event", "a second event"),
    ("at iteration 1: fail gpu(dp=1, pp=0))", "E560", 37, "unexpected `)` after the event",
     "expected `until iteration B` or the end"),
    ("at iteration 1: fail rank 1 until iteration 3", "E560", 29, "only `slow` takes `until iteration B`",
     "remove this"),
    ("at iteration 1: slow link node 1 delay = 2ms", "E560", 27, "a slow link is one GPU's: `gpu(dp=D, pp=S)` or "
     "`rank R`", "not a node"),
    ("at iteration 1: slow link rank 1 delay = 2", "E560", 42, "`delay` must be a time such as 5ms, got `2`",
     "expected a time"),
    ("at iteration 1: fail\nrank 0", "E560", 1, "an injection is one line", ""),
    # The event's own mistakes are the spec language's.
    ("at iteration 1: fail gpu(dp=1 pp=0)", "E102", 31, "unexpected `pp`; expected `)` or `,`", "unexpected here"),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed 0.5", "E104", 44, "missing `=` after `speed`",
     "expected `=`, found `0.5`"),
    ("at iteration 1: hang host 2", "E201", 22, "`hang` cannot name `host`", "unknown target"),
    ("at iteration 1: fail gpu(dp=1, ppp=0)", "E201", 32, "unknown coordinate `ppp`", "did you mean `pp`?"),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed = 2", "E206", 46, "`speed` must be in (0, 1], got 2",
     "out of range"),
    ("at iteration 1: fail rank 1e99", "E110", 27, "number `1e99` is out of range: schedc reads numbers from "
     "1e-30 to 1e30 in size (and 0)", "out of range"),
])
def test_syntax_errors_point_at_the_word(text, code, column, message, label):
    (d,) = _error(text).diagnostics
    assert (d.code, d.span.file, d.span.line, d.span.column, d.message, d.label) == \
        (code, "<inject 1>", 1, column, message, label)


@pytest.mark.parametrize("text, column, message, label", [
    # (each said "must be a whole number" of a whole number, or ">= 1" of one that is)
    ("at iteration -1: fail rank 0", 14, "an iteration number must be a whole number from 0 to 999,999,999, got `-1`",
     "expected 0 to 999,999,999"),
    ("at iteration 99999999999999999999: fail rank 0", 14,
     "an iteration number must be a whole number from 0 to 999,999,999, got `99999999999999999999`",
     "expected 0 to 999,999,999"),
    ("at iteration 2 during B -1: fail rank 0", 25,
     "a microbatch number must be a whole number from 0 to 999,999,999, got `-1`", "expected 0 to 999,999,999"),
    ("at recovery 99999999999999999999: fail rank 0", 13,
     "a generation number must be a whole number from 1 to 999,999,999, got `99999999999999999999`",
     "expected 1 to 999,999,999"),
    ("at recovery 0: fail rank 0", 13, "a generation number must be a whole number from 1 to 999,999,999, got `0`",
     "expected 1 to 999,999,999"),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed = 0.5 until iteration 99999999999", 66,
     "an iteration number must be a whole number from 0 to 999,999,999, got `99999999999`",
     "expected 0 to 999,999,999"),
    # (said "the time is out of range"; 1e300s was E110, numbers from 1e-30 to 1e30)
    ("at -2s: fail rank 0", 4, "a moment's time must be from 0 to 1,000,000 s after the start (11.6 days), got `-2s`",
     "expected 0 to 1,000,000 s"),
    ("at 1e300s: fail rank 0", 4,
     "a moment's time must be from 0 to 1,000,000 s after the start (11.6 days), got `1e300s`",
     "expected 0 to 1,000,000 s"),
    # (a negative delay was "must be a time such as 5ms"; 1e300s was E110; 2e6s was taken)
    ("at iteration 1: slow link rank 1 delay = -5ms", 42, "`delay` must be from 0 to 1,000,000 s, got `-5ms`",
     "expected 0 to 1,000,000 s"),
    ("at iteration 1: slow link rank 1 delay = 1e300s", 42, "`delay` must be from 0 to 1,000,000 s, got `1e300s`",
     "expected 0 to 1,000,000 s"),
    ("at iteration 1: slow link rank 1 delay = 2e6s", 42, "`delay` must be from 0 to 1,000,000 s, got `2e6s`",
     "expected 0 to 1,000,000 s"),
])
def test_numbers_out_of_range_say_the_range(text, column, message, label):
    (d,) = _error(text).diagnostics
    assert (d.code, d.span.column, d.message, d.label) == ("E560", column, message, label)


def test_the_ends_of_the_ranges_are_taken():
    assert parse_injection("at iteration 999999999: fail rank 0", 0).moment.iteration == 999_999_999
    assert parse_injection("at 1000000s: fail rank 0", 0).moment.seconds == 1e6
    assert parse_injection("at iteration 1: slow link rank 1 delay = 1000000s", 0).delay == 1e6
    assert parse_injection("at iteration 1: slow link rank 1 delay = 0ms", 0).delay == 0


def test_a_near_miss_is_shown_with_a_caret_and_a_suggestion():
    assert _error("at iteration 2 durng B: fail gpu(dp=1, pp=0)").render() == "\n".join([
        "error[E560]: unexpected `durng` after `iteration 2`",
        " --> <inject 1>:1:16",
        "  |",
        "1 | at iteration 2 durng B: fail gpu(dp=1, pp=0)",
        "  |                ^^^^^ did you mean `during`?",
        "  = hint: write `at iteration I: fail gpu(dp=D, pp=S)`; the moment may also be "
        "`iteration I during F|B|W|O [M]`, `iteration I after F|B|W|O [M]`, `recovery N` or `2.5s`",
    ])
    assert _error("at 1s: hnag rank 2").render() == "\n".join([
        "error[E560]: cannot inject `hnag`",
        " --> <inject 1>:1:8",
        "  |",
        "1 | at 1s: hnag rank 2",
        "  |        ^^^^ did you mean `hang`?",
        "  = hint: `fail ...` kills the target's processes (SIGKILL), `hang ...` stops them (SIGSTOP), "
        "`slow ...` slows a GPU or link down, `recover gpu(...)` brings a failed GPU back",
    ])


def test_an_error_in_the_event_is_the_spec_parsers_shown_in_the_injection():
    assert _error("at iteration 3: fail gpu(1, 2)").render() == "\n".join([
        "error[E102]: `gpu(...)` takes named coordinates, found `1`",
        " --> <inject 1>:1:26",
        "  |",
        "1 | at iteration 3: fail gpu(1, 2)",
        "  |                          ^ expected `dp=` or `pp=`",
        "  = hint: write `gpu(dp=0, pp=1)`",
    ])


@pytest.mark.parametrize("text", ["at iteration 1: slow link gpu(dp=0, pp=0) delay = 1ms", "at 1s: hang rank 0",
                                  "at iteration 2: recover gpu(dp=0, pp=0)"])
def test_keywords_are_not_names_in_the_spec(text):
    # The injection's keywords live in inject.lark only: the spec language may still use them as keys.
    from schedc.parse import parse_text

    doc = parse_text("schedule { at = 1  link = 2  hang = 3  until = 4  iteration = 5 }")
    assert [a.key for a in doc.items[0].items] == ["at", "link", "hang", "until", "iteration"]
    assert parse_injection(text, 0)
