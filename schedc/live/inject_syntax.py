"""`--inject` text -> its moment, action and target, with the spans to point at (E1xx, E560).

The grammar is grammar/inject.lark. Its event is a failure statement of the spec language,
read by `schedc.parse` and given its meaning by `schedc.failures`, as in a spec's `failures`
block. This module knows what an injection says; `schedc.live.inject` checks it against the
plan (E207, E561, E562). Diagnostics point into the injection (file ``<inject N>``):

    >>> parse_injection("at iteration 2 during B 1: hang rank 3", 0).moment
    Moment(kind='iteration', iteration=2, phase='during', op='B', mb=1, generation=None, seconds=None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, Mapping, NoReturn

from lark import Lark, Token, Transformer, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from schedc.diagnostics import Diagnostic, Span, SpecError, did_you_mean, error
from schedc.failures import failure_from_statement
from schedc.limits import MAX_SECONDS
from schedc.parse import (TERMINAL_NAMES, TIME_UNITS, Statement, describe_expected, end_span, run_parser,
                          statement_of, syntax_diagnostic, token_span, value_of_token)
from schedc.spec import Failure

OP_KINDS = ("F", "B", "W", "O")
_OP_NAMES = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W",
             "optimizer": "O", **{k: k for k in OP_KINDS}}
#: What each verb does: a signal (kill, stop), a slowdown the target applies to itself (slow,
#: slow_link), or a rejoin the supervisor starts.
ACTIONS = {"fail": "kill", "hang": "stop", "slow": "slow", "recover": "rejoin"}
SYNTAX = ("write `at iteration I: fail gpu(dp=D, pp=S)`; the moment may also be "
          "`iteration I during F|B|W|O [M]`, `iteration I after F|B|W|O [M]`, `recovery N` or `2.5s`")
_VERB_HINT = ("`fail ...` kills the target's processes (SIGKILL), `hang ...` stops them (SIGSTOP), "
              "`slow ...` slows a GPU or link down, `recover gpu(...)` brings a failed GPU back")
_OP_HINT = "F forward, B backward (input), W backward (weights), O optimizer step"
#: The largest iteration, microbatch or generation number an injection names.
MAX_NUMBER = 999_999_999


@dataclass(frozen=True)
class Moment:
    """When an injection fires (see `schedc.live.inject`)."""

    kind: Literal["iteration", "recovery", "time"]
    iteration: int | None = None
    phase: Literal["start", "during", "after"] = "start"
    op: str | None = None
    mb: int | None = None
    generation: int | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        if self.kind == "time":
            return f"{self.seconds:g}s"
        if self.kind == "recovery":
            return f"recovery {self.generation}"
        text = f"iteration {self.iteration}"
        if self.phase != "start":
            text += f" {self.phase} {self.op}" + ("" if self.mb is None else f" {self.mb}")
        return text


@dataclass(frozen=True)
class ParsedInjection:
    """One injection as written, not yet checked against a plan."""

    moment: Moment
    action: Literal["kill", "stop", "slow", "slow_link", "rejoin"]
    failure: Failure  # the target (a link's as `fail gpu` / `fail rank`)
    #: Where its parts are, for checks against the plan: `iteration`, `phase`, `op`, `mb`
    #: (of an iteration moment), `event`, and `until` (its iteration number).
    spans: Mapping[str, Span]
    speed: float | None = None  # slow
    delay: float | None = None  # slow_link: seconds
    until: int | None = None


def parse_injection(text: str, index: int) -> ParsedInjection:
    """Injection `index` (0-based), parsed; a `SpecError` showing the text when it is not one."""
    file = f"<inject {index + 1}>"
    try:
        if "\n" in text or "\r" in text:
            _stop("an injection is one line", Span(file, 1, 1, 1, 2),
                  hint="pass each injection as its own --inject option")
        tree = _Unprefixed().transform(run_parser(_parser(), text, file, "injection", _diagnose))
        return _read(tree, file)
    except SpecError as exc:
        raise SpecError(exc.diagnostics, {file: text}) from None


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark.open_from_package("schedc.grammar", "inject.lark", ("",), parser="lalr", lexer="contextual",
                                  start="injection", propagate_positions=True, maybe_placeholders=True)


class _Unprefixed(Transformer):
    """Rules imported from schedc.lark arrive as `schedc__fail`, `schedc__target_args`, ...: back
    to the names `schedc.parse.statement_of` reads."""

    def __default__(self, data, children, meta):
        return Tree(str(data).rpartition("__")[2], children, meta)


def _stop(message: str, span: Span | None, *, label: str = "", hint: str = "") -> NoReturn:
    raise SpecError([error("E560", message, span, label=label, hint=hint)])


# -- the tree -> a ParsedInjection ------------------------------------------------------

def _read(tree: Tree, file: str) -> ParsedInjection:
    _at, moment_tree, event, until_word, _iteration, until_number = tree.children
    moment, spans = _moment(moment_tree, file)
    st_tree = event.children[0] if event.data == "event" else event
    if st_tree.data == "slow_link":
        _check_delay_number(st_tree, file)
    st = statement_of(st_tree, file)
    spans["event"] = st.span
    action = "slow_link" if st_tree.data == "slow_link" else ACTIONS[st.verb]
    until = None
    if until_word is not None:
        if st.verb != "slow":
            _stop("only `slow` takes `until iteration B`", _between(until_word, until_number, file),
                  label="remove this")
        spans["until"] = token_span(until_number, file)
        until = _whole_number(until_number, "an iteration number", file)
    if action in ("slow", "slow_link", "rejoin") and moment.phase != "start":
        _stop(f"`{st.verb}` starts at an iteration's start or at a time, not during an op", spans.get("phase"),
              label="remove this", hint=f"write `at iteration I: {st.verb} ...`")
    if action == "rejoin" and (moment.kind == "recovery" or moment.iteration == 0):
        _stop("`recover` starts at the start of an iteration after the first, or at a time", st.span,
              hint="write `at iteration I: recover gpu(...)` with I >= 1, or `at 2.5s: recover gpu(...)`")
    if action in ("slow", "slow_link") and moment.kind != "iteration":
        _stop("`slow` starts at an iteration's start", st.span,
              hint="write `at iteration I: slow ...` (and `until iteration B`)")
    if action == "slow_link":
        return ParsedInjection(moment, action, _link_target(st), spans, delay=_delay(st), until=until)
    failure, problems = failure_from_statement(st, allow_recover=True, verb="fail" if st.verb == "hang" else None)
    if problems:
        raise SpecError(problems)
    assert failure is not None
    return ParsedInjection(moment, action, failure, spans, speed=failure.speed, until=until)  # type: ignore[arg-type]


def _moment(tree: Tree, file: str) -> tuple[Moment, dict[str, Span]]:
    if tree.data == "at_time":
        return _time(tree, file), {}
    if tree.data == "at_recovery":
        return Moment(kind="recovery", generation=_whole_number(tree.children[1], "a generation number", file,
                                                                minimum=1)), {}
    _word, number, phase, op_word, mb_word = tree.children
    named = {"iteration": number, "phase": phase, "op": op_word, "mb": mb_word}
    spans = {k: token_span(t, file) for k, t in named.items() if t is not None}
    iteration = _whole_number(number, "an iteration number", file)
    if phase is None:
        return Moment(kind="iteration", iteration=iteration), spans
    op = _OP_NAMES.get(str(op_word)) or _OP_NAMES.get(str(op_word).lower())
    if op is None:
        _stop(f"unknown op kind `{op_word}`", spans["op"],
              label=did_you_mean(str(op_word), _OP_NAMES) or "expected F, B, W or O", hint=_OP_HINT)
    mb = None
    if mb_word is not None:
        if op == "O":
            _stop("the optimizer step O belongs to no microbatch", spans["mb"], label="remove the microbatch",
                  hint=SYNTAX)
        mb = _whole_number(mb_word, "a microbatch number", file)
    moment = Moment(kind="iteration", iteration=iteration, phase=str(phase), op=op, mb=mb)  # type: ignore[arg-type]
    return moment, spans


def _time(tree: Tree, file: str) -> Moment:
    number, unit_word = tree.children
    span = token_span(number, file)
    try:
        value = value_of_token(number, file)
    except SpecError:  # E110: past 1e30 (`1e300s`), far past the range a moment has
        _time_out_of_range(number, unit_word, span)
    if value.unit and unit_word is not None:
        _stop(f"unexpected `{unit_word}` after the time", token_span(unit_word, file), label="expected `:`",
              hint=SYNTAX)
    unit = value.unit or (str(unit_word) if unit_word is not None else "")
    if not unit:
        _stop(f"the time `{number}` needs a unit", span, label="write s or ms", hint="e.g. `at 2.5s: fail rank 3`")
    if unit not in ("s", "ms"):
        _stop(f"a moment's time is in s or ms, not `{unit}`", span, label=did_you_mean(unit, ("s", "ms")) or
              "write s or ms", hint="e.g. `at 2.5s: fail rank 3` or `at 800ms: hang rank 1`")
    assert value.number is not None
    seconds = float(value.number) / (1000.0 if unit == "ms" else 1.0)
    if not 0 <= seconds <= MAX_SECONDS:
        _time_out_of_range(number, unit_word, span)
    return Moment(kind="time", seconds=seconds)


def _time_out_of_range(number: Token, unit_word: Token | None, span: Span) -> NoReturn:
    written = f"{number}{'' if unit_word is None else ' ' + str(unit_word)}"
    _stop(f"a moment's time must be from 0 to {MAX_SECONDS:,.0f} s after the start (11.6 days), got `{written}`",
          span, label=f"expected 0 to {MAX_SECONDS:,.0f} s", hint="e.g. `at 2.5s: fail rank 3`")


def _whole_number(word: Token, what: str, file: str, minimum: int = 0) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", word) or int(word) < minimum:
        _stop(f"{what} must be {_whole_range(minimum)}, got `{word}`", token_span(word, file),
              label=f"expected {minimum} to {MAX_NUMBER:,}")
    return int(word)


def _whole_range(minimum: int) -> str:
    return f"a whole number from {minimum} to {MAX_NUMBER:,}"


def _link_target(st: Statement) -> Failure:
    """A link is named as its GPU: `gpu(dp=D, pp=S)` or `rank R` (read as by `fail`)."""
    failure, problems = failure_from_statement(replace(st, setting=None), allow_recover=False, verb="fail")
    if problems:
        raise SpecError(problems)
    assert failure is not None
    if failure.kind == "fail_node":
        _stop("a slow link is one GPU's: `gpu(dp=D, pp=S)` or `rank R`", st.target_span,
              label="not a node", hint="inject one `slow link` per GPU of the node")
    return failure


def _delay(st: Statement) -> float:
    """`delay = T`, in seconds."""
    assert st.setting is not None  # the grammar requires `key = value` after a link's target
    key, value = st.setting.key, st.setting.value
    if key != "delay":
        _stop(f"unknown setting `{key}` of `slow link`", st.setting.key_span,
              label=did_you_mean(key, ("delay",)) or "expected `delay`",
              hint="write `slow link gpu(dp=0, pp=1) delay = 5ms`")
    if value.kind != "number" or value.unit not in TIME_UNITS or value.number is None:
        _stop(f"`delay` must be a time such as 5ms, got `{value.text}`", value.span, label="expected a time",
              hint="a time is a number with its unit: ns, us, ms or s")
    seconds = float(value.number * TIME_UNITS[value.unit]) / 1e6  # type: ignore[operator]
    if not 0 <= seconds <= MAX_SECONDS:
        _delay_out_of_range(value.text, value.span)
    return seconds


def _delay_out_of_range(text: str, span: Span | None) -> NoReturn:
    _stop(f"`delay` must be from 0 to {MAX_SECONDS:,.0f} s, got `{text}`", span,
          label=f"expected 0 to {MAX_SECONDS:,.0f} s", hint="e.g. `delay = 5ms`")


def _check_delay_number(st_tree: Tree, file: str) -> None:
    """A delay past what numbers may be (`1e300s`, E110 in the statement): said with its range."""
    value = st_tree.children[-1]
    tok = value.children[0] if isinstance(value, Tree) and value.children else value
    if isinstance(tok, Token) and tok.type.rpartition("__")[2] == "NUMBER":
        try:
            value_of_token(tok, file)
        except SpecError:
            _delay_out_of_range(str(tok), token_span(tok, file))


def _between(first: Token, last: Token, file: str) -> Span:
    a, b = token_span(first, file), token_span(last, file)
    return Span(file, a.line, a.column, b.end_line, b.end_column)


# -- syntax errors ----------------------------------------------------------------------

_NAMES = {**TERMINAL_NAMES, "AT": "`at`", "ITERATION": "`iteration`", "RECOVERY": "`recovery`",
          "DURING": "`during`", "AFTER": "`after`", "UNTIL": "`until`", "HANG": "`hang`", "LINK": "`link`",
          "TIME_UNIT": "`s` or `ms`", "$END": "the end of the injection"}
#: Terminals of the injection itself; errors about any other are the spec grammar's (the event).
_OWN = frozenset({"AT", "COLON", "ITERATION", "RECOVERY", "DURING", "AFTER", "UNTIL", "HANG", "LINK", "TIME_UNIT"})
_VERBS = frozenset({"FAIL", "HANG", "SLOW", "RECOVER"})
_NUMBERS = {"ITERATION": ("an iteration number", 0), "RECOVERY": ("a generation number", 1)}


def _diagnose(exc: UnexpectedInput, text: str, file: str, recent: list[Token]) -> Diagnostic:
    """The spec parser's messages for the event's statement; the injection's own around it."""
    if isinstance(exc, UnexpectedCharacters):
        ch = text[exc.pos_in_stream]
        shown = ch if ch.isprintable() and not ch.isspace() else repr(ch)
        return error("E560", f"unexpected character `{shown}`", Span(file, exc.line, exc.column, exc.line,
                                                                     exc.column + 1),
                     label="not part of an injection", hint=SYNTAX)
    token: Token | None = getattr(exc, "token", None)
    if isinstance(exc, UnexpectedToken) and exc.interactive_parser is not None:
        # What LALR's merged lookaheads allow is more than what may come next here (after
        # `fail rank 1`, a slow's `speed` key): ask the parser, and tell the spec's messages too.
        exc.expected = set(exc.interactive_parser.accepts())
    expected = {str(t) for t in getattr(exc, "expected", None) or ()}
    at_end = isinstance(exc, UnexpectedEOF) or token is None or token.type == "$END"
    where = end_span(text, file) if at_end else token_span(token, file)  # type: ignore[arg-type]
    word = "" if at_end else str(token)
    prev = recent[-1].type if recent else None

    def e560(message: str, label: str, hint: str = SYNTAX) -> Diagnostic:
        return error("E560", message, where, label=label, hint=hint)

    if "AT" in expected:
        return e560("an injection starts with `at`", did_you_mean(word, ("at",)) or "expected `at`")
    if {"ITERATION", "RECOVERY"} <= expected:
        if at_end or word == ":":
            return e560("the injection has no moment after `at`", "expected a moment")
        return e560(f"unknown moment `{word}`", did_you_mean(word, ("iteration", "recovery")) or
                    "expected `iteration`, `recovery` or a time")
    if "NUMBER" in expected and prev in _NUMBERS:
        what, low = _NUMBERS[prev]
        if at_end or word == ":":
            return e560(f"the injection needs {what} here", f"expected {what}")
        return e560(f"{what} must be {_whole_range(low)}, got `{word}`", f"expected {low} to {MAX_NUMBER:,}",
                    hint="")
    if "NAME" in expected and prev in ("DURING", "AFTER"):
        return e560(f"`{recent[-1]}` needs an op kind", "expected F, B, W or O", hint=_OP_HINT)
    if "COLON" in expected and (at_end or word in ACTIONS):
        return e560("missing `:` between the moment and the event",
                    "expected `:` here" if at_end else "expected `:` before this")
    if {"DURING", "AFTER"} <= expected:
        return e560(f"unexpected `{word}` after `{' '.join(recent)}`",
                    did_you_mean(word, ("during", "after")) or "expected `during`, `after` or `:`")
    if "TIME_UNIT" in expected:
        return e560(f"unexpected `{word}` after the time", did_you_mean(word, ("s", "ms")) or "expected `:`")
    if expected & _VERBS and "NAME" not in expected:
        if at_end:
            return e560("the injection has no event after `:`", "expected an event",
                        hint="e.g. `fail gpu(dp=1, pp=2)` or `hang rank 3`")
        return e560(f"cannot inject `{word}`", did_you_mean(word, ACTIONS) or "expected fail, hang, slow or recover",
                    hint=_VERB_HINT)
    if "UNTIL" in expected and word in ACTIONS:
        return e560("an injection has exactly one event", "a second event",
                    hint="pass each event as its own --inject option")
    if "UNTIL" in expected and not at_end:
        return e560(f"unexpected `{word}` after the event", did_you_mean(word, ("until",)) or
                    "expected `until iteration B` or the end")
    if len(recent) == 2 and recent[0].type == "SLOW" and did_you_mean(str(recent[1]), ("link",)):
        return error("E560", f"`slow` cannot name `{recent[1]}`", token_span(recent[1], file),
                     label=did_you_mean(str(recent[1]), ("link",)),
                     hint="write `slow gpu(dp=D, pp=S) speed = X` or `slow link gpu(dp=D, pp=S) delay = T`")
    if expected & _OWN:
        return e560(f"unexpected {'end of the injection' if at_end else f'`{word}`'}; "
                    f"expected {describe_expected(expected, _NAMES)}", "unexpected here")
    return syntax_diagnostic(exc, text, file, recent)
