"""Spec text -> a plain tree of blocks, assignments and statements with spans (E1xx).

This is the first pass of docs/architecture.md's data flow. It knows the shape of the language
(grammar/schedc.lark), not its meaning: `schedc.validate` turns the tree into
a `Spec`. Syntax errors are reported as `SpecError`s with friendly messages
("unclosed `{`", "missing `=`", ...) pointing inside the input; only the
first syntax error is reported, since what follows it is guesswork.

    >>> doc = parse_text("train { microbatches = 8 }", "x.sched")
    >>> doc.items[0].name, doc.items[0].items[0].key
    ('train', 'microbatches')
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from typing import Callable, Literal, Mapping, Union

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from schedc.diagnostics import Diagnostic, Span, SpecError, did_you_mean, error

ValueKind = Literal["number", "string", "word", "bool", "slice"]


@dataclass(frozen=True)
class Value:
    """A value as written. Numbers keep their exact magnitude and their unit (maybe '')."""

    kind: ValueKind
    text: str  # the source text of the value
    span: Span
    number: Fraction | None = None  # kind == "number"
    unit: str = ""  # kind == "number"
    string: str | None = None  # kind == "string" (unescaped) or "word"
    boolean: bool | None = None  # kind == "bool"
    start: int | None = None  # kind == "slice": layers[start:stop]
    stop: int | None = None
    slice_of: str | None = None  # kind == "slice": the name before `[` (e.g. "layers")

    def describe(self) -> str:
        return {"number": "a number", "string": "a string", "word": "an identifier",
                "bool": "a boolean", "slice": "a layer slice"}[self.kind]


@dataclass(frozen=True)
class Assign:
    """`key = value`, or `key N = value` (`stage 0 = layers[0:7]`)."""

    key: str
    key_span: Span
    value: Value
    span: Span
    index: Value | None = None


@dataclass(frozen=True)
class Arg:
    name: str
    value: Value
    span: Span


@dataclass(frozen=True)
class Statement:
    """`fail gpu(dp=1, pp=2)`, `fail rank 3`, `slow gpu(...) speed = 0.5`, `recover gpu(...)`."""

    verb: Literal["fail", "slow", "recover"]
    target: str  # gpu, rank, node (checked by the validator)
    target_span: Span
    span: Span
    args: tuple[Arg, ...] | None = None  # target(args) form
    index: Value | None = None  # `target N` form
    setting: Assign | None = None  # slow: `speed = X`


@dataclass(frozen=True)
class Block:
    name: str
    name_span: Span
    items: tuple["Item", ...]
    span: Span
    label: Value | None = None  # `model "gpt" {`, `stage 3 {`


Item = Union[Block, Assign, Statement]


@dataclass(frozen=True)
class Document:
    items: tuple[Item, ...]
    file: str
    text: str


# -- the parser ----------------------------------------------------------------

@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("schedc.grammar").joinpath("schedc.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="contextual", start=["start", "events"],
                propagate_positions=True, maybe_placeholders=True)


def normalize_newlines(text: str) -> str:
    """`\r\n` and lone `\r` become `\n`, so that lines mean the same to lark, spans and editors."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def display_text(text: str) -> str:
    """`text` for source excerpts: other characters Python treats as line breaks become spaces.

    Spans count lines by `\n` only; `str.splitlines` (used when rendering) also splits
    on form feeds, `\x85`, `\u2028`, ... Same length, so columns stay right.
    """
    return text.translate({c: " " for c in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)})


#: Brackets nest at most this deep. The language needs 2 (`cluster { gpu { ... } }`); deeper
#: text is refused before lark builds a tree deeper than Python's recursion can follow.
MAX_NESTING = 32
#: Numbers are read when 1e-30 <= |x| < 1e30 (or 0), judged from their text before they are
#: expanded: `1e30000000` must not cost a 30-million-digit integer to refuse.
MAX_ORDER = 30

# -- units: what a number may carry, and the factor to the unit it is stored in -------

#: unit -> factor to microseconds
TIME_UNITS = {"ns": Fraction(1, 1000), "us": Fraction(1), "ms": Fraction(1000), "s": Fraction(1_000_000)}
#: unit -> factor to bytes
SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
#: unit -> factor to bytes per second
RATE_UNITS = {f"{u}/s": f for u, f in SIZE_UNITS.items()}
#: unit -> factor to FLOP/s
FLOPS_UNITS = {"FLOPS": 1, "GFLOPS": 10**9, "TFLOPS": 10**12, "PFLOPS": 10**15}

#: Every unit (a space between a number and one of these is a common slip: E204's hint).
_UNITS = frozenset({*TIME_UNITS, *SIZE_UNITS, *RATE_UNITS, *FLOPS_UNITS})
#: The units by kind, as a hint lists them.
_UNIT_KINDS = (("time", tuple(TIME_UNITS)), ("size", tuple(SIZE_UNITS)),
               ("bandwidth", ("a size unit + /s (GB/s, GiB/s, ...)",)), ("compute", tuple(FLOPS_UNITS)))
#: Spellings of other languages and habits, and the unit they mean.
_UNIT_ALIASES = {"sec": "s", "secs": "s", "second": "s", "seconds": "s", "msec": "ms", "msecs": "ms",
                 "usec": "us", "usecs": "us", "nsec": "ns", "nsecs": "ns", "byte": "B", "bytes": "B"}

_BRACKETS_RE = re.compile(r'"(?:\\.|[^"\\\n])*"?|#[^\n]*|[{(\[]|[})\]]')


def parse_text(text: str, file: str = "<spec>") -> Document:
    """Parse spec text into a `Document`; raise `SpecError` (E1xx) on a syntax error."""
    text = normalize_newlines(text)
    tree = _run_parser(text, file, "start")
    with _showing(text, file):
        return Document(items=tuple(_item(c, file) for c in tree.children), file=file, text=text)


def parse_statements(text: str, file: str = "<event>") -> tuple[Statement, ...]:
    """Parse a list of failure/recover statements (replan events)."""
    text = normalize_newlines(text)
    tree = _run_parser(text, file, "events")
    with _showing(text, file):
        return tuple(statement_of(c, file) for c in tree.children)


@contextmanager
def _showing(text: str, file: str):
    """Give a `SpecError` raised while reading the tree (E110) the text to show its line from."""
    try:
        yield
    except SpecError as exc:
        raise SpecError(exc.diagnostics, {file: display_text(text)}) from None


def _check_nesting(text: str, file: str) -> None:
    """E109 at the first bracket that opens deeper than `MAX_NESTING` (strings, comments skipped)."""
    depth = 0
    for m in _BRACKETS_RE.finditer(text):
        ch = m.group()
        if ch in "{([":
            depth += 1
            if depth > MAX_NESTING:
                span = _point(text, m.start(), file)
                raise SpecError([error("E109", f"brackets nested more than {MAX_NESTING} deep", span,
                                       label="too deep",
                                       hint="a spec nests blocks two deep at most, e.g. `cluster { gpu { ... } }`; "
                                            "look for a missing `}`")], {file: display_text(text)})
        elif ch in "})]":
            depth = max(0, depth - 1)


def _checked_number(text: str, span: Span, file: str) -> Fraction:
    """The value of a number's text, or E110 when it lies outside 1e-30 <= |x| < 1e30 (and is not 0)."""
    m = re.fullmatch(r"[+-]?(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?", text)
    assert m is not None  # the grammar's NUMBER guarantees this shape
    whole, frac, exp = m.group(1) or "", m.group(2) or "", m.group(3) or "0"
    lead = whole.lstrip("0")
    if not lead and not frac.strip("0"):
        return Fraction(0)
    digits = exp.lstrip("+-").lstrip("0")
    if len(digits) > 6:  # an exponent of a million or more, either way
        order = MAX_ORDER * (-1 if exp.startswith("-") else 1) * 10
    else:
        e = int(exp)
        order = (len(lead) - 1 + e) if lead else (e - (len(frac) - len(frac.lstrip("0"))) - 1)
    if not -MAX_ORDER <= order < MAX_ORDER:
        shown = text if len(text) <= 40 else text[:20] + "..." + text[-12:]
        raise SpecError([error("E110", f"number `{shown}` is out of range: schedc reads numbers from 1e-30 "
                                       "to 1e30 in size (and 0)", span, label="out of range",
                               hint="check the value; for a size or time, pick a unit that keeps the "
                                    "number small (`2TiB`, `3s`)")])
    return Fraction(text)


def _run_parser(text: str, file: str, start: str) -> Tree:
    _check_nesting(text, file)
    return run_parser(_parser(), text, file, start, syntax_diagnostic)


#: What turns a lark error into a diagnostic: (error, text, file, the two tokens before it).
Diagnose = Callable[[UnexpectedInput, str, str, "list[Token]"], Diagnostic]


def run_parser(parser: Lark, text: str, file: str, start: str, diagnose: Diagnose) -> Tree:
    """`text` parsed by `parser` (any of schedc's grammars); a syntax error is a `SpecError`
    with the single diagnostic `diagnose` makes of it."""
    # Feed tokens one by one so that an error knows the tokens before it.
    interactive = parser.parse_interactive(text, start=start)
    recent: list[Token] = []
    try:
        for tok in interactive.iter_parse():
            recent = (recent + [tok])[-2:]
        return interactive.resume_parse()
    except UnexpectedInput as exc:
        if isinstance(exc, UnexpectedToken) and exc.interactive_parser is None:
            exc.interactive_parser = interactive  # as lark's own parse() gives it: what it accepts here
        raise SpecError([diagnose(exc, text, file, recent)], {file: display_text(text)}) from None


# -- friendly syntax errors ----------------------------------------------------

#: How a syntax error names a terminal of the grammar (the --inject grammar adds its own).
TERMINAL_NAMES = {
    "LBRACE": "`{`", "RBRACE": "`}`", "EQUAL": "`=`", "LPAR": "`(`", "RPAR": "`)`",
    "LSQB": "`[`", "RSQB": "`]`", "COLON": "`:`", "COMMA": "`,`", "NAME": "a name",
    "NUMBER": "a number", "STRING": "a string", "FAIL": "`fail`", "SLOW": "`slow`",
    "RECOVER": "`recover`", "$END": "the end of the input",
}


def describe_expected(expected: set[str], names: Mapping[str, str] = TERMINAL_NAMES) -> str:
    """`a name, `(` or `=``: what the parser could have taken, in words."""
    words = sorted({names.get(t, t) for t in expected})
    if not words:
        return "nothing"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def token_span(tok: Token, file: str) -> Span:
    line, col = tok.line or 1, tok.column or 1
    end_line = tok.end_line or line
    end_col = tok.end_column if tok.end_column is not None else col + max(len(tok), 1)
    return Span(file, line, col, end_line, max(end_col, col + 1) if end_line == line else end_col)


def _point(text: str, pos: int, file: str, width: int = 1) -> Span:
    """Span of `width` characters at offset `pos` of `text` (clamped into the text)."""
    pos = max(0, min(pos, len(text)))
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return Span(file, line, col, line, col + max(width, 1))


def end_span(text: str, file: str) -> Span:
    """Where 'the end of the input' is shown: just after the last non-blank character."""
    stripped = text.rstrip()
    return _point(text, len(stripped), file)


def unclosed_brace(text: str) -> int | None:
    """Offset of the innermost `{` never closed (ignoring strings and comments), or None."""
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if ch == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            stack.pop()
        i += 1
    return stack[-1] if stack else None


def syntax_diagnostic(exc: UnexpectedInput, text: str, file: str, recent: list[Token]) -> Diagnostic:
    if isinstance(exc, UnexpectedCharacters):
        pos = exc.pos_in_stream
        ch = text[pos] if pos < len(text) else ""
        span = _point(text, pos, file)
        if ch == '"':
            return error("E108", "unterminated string", span, label="this string is never closed",
                         hint='close the string on the same line: "..."')
        rate = _spaced_rate(text, pos, file) if ch == "/" else None
        if rate is not None:
            return rate
        shown = ch if ch.isprintable() and not ch.isspace() else repr(ch)
        hint = _character_hint(ch)
        return error("E101", f"unexpected character `{shown}`", span, label="not part of the spec language",
                     hint=hint)

    token = getattr(exc, "token", None)
    expected = set(getattr(exc, "expected", ()) or ())
    at_end = isinstance(exc, UnexpectedEOF) or (token is not None and token.type == "$END")
    if at_end:
        brace = unclosed_brace(text)
        if brace is not None:
            return error("E103", "unclosed `{`", _point(text, brace, file), label="this `{` is never closed",
                         hint="add the matching `}` at the end of the block")
        return error("E102", f"unexpected end of input; expected {describe_expected(expected)}",
                     end_span(text, file), hint="the last statement is incomplete")

    assert token is not None  # every other UnexpectedInput carries the token
    span = token_span(token, file)
    found = f"`{token.value}`"
    if token.type == "RBRACE" and "RBRACE" not in expected:
        # A `}` where a block cannot end here: either one too many, or a value is missing.
        if "EQUAL" not in expected and recent and recent[-1].type == "EQUAL":
            return error("E102", "missing value before `}`", span, label="expected a value here",
                         hint="write `key = value`")
        if unclosed_brace(text[:token.start_pos or 0]) is None:
            return error("E105", "unmatched `}`", span, label="no `{` is open here",
                         hint="remove this `}` or add the `{` it closes")
    if token.type == "NUMBER" and len(recent) == 2 and recent[-1].type == "LPAR":
        target = recent[0].value
        return error("E102", f"`{target}(...)` takes named coordinates, found {found}", span,
                     label="expected `dp=` or `pp=`", hint=f"write `{target}(dp=0, pp=1)`")
    if token.type == "COMMA" and recent and recent[-1].type in ("RPAR", "NUMBER", "NAME") and "COMMA" not in expected:
        return error("E102", "unexpected `,` between statements", span, label="no commas here",
                     hint="write one statement per line: `fail gpu(dp=0, pp=1)` then `fail gpu(dp=1, pp=1)`")
    if token.type == "NAME" and "FAIL" in expected and not recent:
        guess = did_you_mean(token.value, ("fail", "slow", "recover"))
        if guess:
            return error("E102", f"unknown statement `{token.value}`", span, label=guess,
                         hint="statements start with `fail`, `slow` or `recover`")
    if "EQUAL" in expected and token.type != "EQUAL":
        if len(recent) == 2 and recent[0].type == "NAME" and recent[1].type in ("NUMBER", "STRING"):
            key, val = recent
            return error("E104", f"missing `=` between `{key.value}` and `{val.value}`",
                         token_span(val, file), label="expected `=` before this",
                         hint=f"write `{key.value} = {val.value}`")
        if len(recent) == 2 and recent[0].type == "NUMBER" and recent[1].value in _UNITS:
            num, unit = recent
            return error("E204", f"a space between `{num.value}` and its unit `{unit.value}`",
                         token_span(unit, file), label="the unit must touch its number",
                         hint=f"write `{num.value}{unit.value}`")
        if len(recent) == 2 and recent[0].type == "NUMBER" and recent[1].type == "NAME" \
                and recent[1].line == recent[0].line and token.type not in ("NUMBER", "STRING"):
            # `memory = 1 gb }`: a word after a number, and no value after it (`dp = 2 pp 4` is a
            # key missing its `=`): a unit, misspelt and apart, when it looks like one or ends the line.
            num, word = recent
            guess = _unit_guess(word.value)
            if guess or token.type == "RBRACE" or token.line != word.line:
                return _unknown_unit(num.value, word, guess, file)
        if recent and recent[-1].type == "NAME":
            key = recent[-1]
            return error("E104", f"missing `=` after `{key.value}`", span,
                         label=f"expected `=`, found {found}",
                         hint=f"write `{key.value} = value`, or `{key.value} {{ ... }}` for a block")
    if token.type == "EQUAL" and recent and recent[-1].type in ("FAIL", "SLOW", "RECOVER"):
        word = recent[-1].value
        return error("E102", f"`{word}` is a keyword and cannot be a key", token_span(recent[-1], file),
                     label="keyword", hint=f"`{word}` starts a statement such as `{word} gpu(dp=0, pp=1)`")
    if recent and recent[-1].type == "EQUAL" and token.type in ("EQUAL", "RBRACE", "LBRACE"):
        return error("E102", f"missing value after `=`, found {found}", span, label="expected a value",
                     hint="values are numbers (with units), strings, true/false, names or layers[a:b]")
    return error("E102", f"unexpected {found}; expected {describe_expected(expected)}", span,
                 label="unexpected here")


def _unit_guess(word: str) -> str | None:
    """The unit `word` likely means: another spelling (`msec`), the same letters in another case
    (`gib`), or the closest unit (`Gi`); None when nothing is close."""
    lower = word.lower()
    by_lower = {u.lower(): u for u in _UNITS}
    if lower in _UNIT_ALIASES or lower in by_lower:
        return _UNIT_ALIASES.get(lower) or by_lower[lower]
    close = difflib.get_close_matches(lower, sorted(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def _spaced_rate(text: str, pos: int, file: str) -> Diagnostic | None:
    """E204 for `1 GB/s` (its `/` is the character the lexer stops at): a rate apart from its number."""
    m = re.search(r"(?:^|[\s=])(-?[0-9.][0-9.eE+-]*)[ \t]+([A-Za-z]+)$", text[:pos])
    if not m or not re.match(r"s(?![\w-])", text[pos + 1:pos + 3]):
        return None
    number, unit = m.group(1), m.group(2) + "/s"
    start = pos - len(m.group(2))
    span = _point(text, start, file, len(unit))
    if unit in RATE_UNITS:
        return error("E204", f"a space between `{number}` and its unit `{unit}`", span,
                     label="the unit must touch its number", hint=f"write `{number}{unit}`")
    guess = _unit_guess(unit)
    tok = Token("NAME", unit, start_pos=start, line=span.line, column=span.column, end_line=span.line,
                end_column=span.column + len(unit))
    return _unknown_unit(number, tok, guess, file)


def _unknown_unit(number: str, word: Token, guess: str | None, file: str) -> Diagnostic:
    """E204 for `1 gb`: not a unit of the language, and apart from its number."""
    kinds = [(k, us) for k, us in _UNIT_KINDS if guess in us or (k == "bandwidth" and guess in RATE_UNITS)] \
        if guess else []
    listed = "; ".join(f"{kind}: {', '.join(units)}" for kind, units in (kinds or _UNIT_KINDS))
    example = f"{number}{guess}" if guess else f"{number}GiB"
    return error("E204", f"unknown unit `{word.value}` after the number `{number}`", token_span(word, file),
                 label=f"did you mean `{guess}`?" if guess else "not a unit",
                 hint=f"a unit touches its number (`{example}`); units: {listed}")


def _character_hint(ch: str) -> str:
    if ch == ";":
        return "statements need no `;`: put them on separate lines or separate them with spaces"
    if ch == "'":
        return 'strings use double quotes: "..."'
    if ch in "\t\r\x0b\x0c" or not ch.isprintable():
        return "the spec contains a control character; save it as plain UTF-8 text"
    return "the spec language has blocks `name { ... }`, `key = value` and `fail`/`slow` statements"


# -- tree -> plain dataclasses -------------------------------------------------

def _meta_span(tree: Tree, file: str) -> Span:
    m = tree.meta
    if getattr(m, "empty", True):
        return Span(file, 1, 1, 1, 2)
    return Span(file, m.line, m.column, m.end_line, m.end_column)


def _item(tree: Tree, file: str) -> Item:
    if tree.data == "block":
        return _block(tree, file)
    if tree.data == "assignment":
        return _assign(tree, file)
    return statement_of(tree, file)


def _block(tree: Tree, file: str) -> Block:
    name, label, *items = tree.children
    lab = None
    if label is not None:
        lab = value_of_token(label.children[0], file)
    return Block(name=str(name), name_span=token_span(name, file), label=lab,
                 items=tuple(_item(c, file) for c in items), span=_meta_span(tree, file))


def _assign(tree: Tree, file: str) -> Assign:
    name, index, value = tree.children
    return Assign(key=str(name), key_span=token_span(name, file), value=_value(value, file),
                  span=_meta_span(tree, file),
                  index=value_of_token(index, file) if index is not None else None)


def statement_of(tree: Tree, file: str) -> Statement:
    """A statement's subtree -> `Statement`. Also reads the `--inject` grammar's `hang target` and
    `slow link target key = value`: the verb, then the target, then the setting, words between
    them (`link`) skipped."""
    verb_tok, *rest = tree.children
    span = _meta_span(tree, file)
    target = next(c for c in rest if isinstance(c, Tree))
    after = rest[rest.index(target) + 1:]
    target_name = target.children[0]
    args = index = setting = None
    if target.data == "target_args":
        args = tuple(
            Arg(name=str(a.children[0]), value=value_of_token(a.children[1], file), span=_meta_span(a, file))
            for a in target.children[1:] if a is not None
        )
    else:
        index = value_of_token(target.children[1], file)
    if after:
        key, val = after
        vspan = _value(val, file)
        setting = Assign(key=str(key), key_span=token_span(key, file), value=vspan,
                         span=Span(file, key.line, key.column, vspan.span.end_line, vspan.span.end_column))
    return Statement(verb=str(verb_tok), target=str(target_name), target_span=token_span(target_name, file),
                     span=span, args=args, index=index, setting=setting)


_NUMBER_RE = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(.*)", re.S)


def value_of_token(tok: Token, file: str) -> Value:
    span = token_span(tok, file)
    if tok.type == "NUMBER":
        m = _NUMBER_RE.fullmatch(str(tok))
        assert m is not None  # the grammar's NUMBER guarantees this shape
        return Value("number", str(tok), span, number=_checked_number(m.group(1), span, file), unit=m.group(2))
    if tok.type == "STRING":
        return Value("string", str(tok), span, string=_unescape(str(tok)[1:-1]))
    if str(tok) in ("true", "false"):
        return Value("bool", str(tok), span, boolean=str(tok) == "true")
    return Value("word", str(tok), span, string=str(tok))


def _unescape(body: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _value(tree: Tree, file: str) -> Value:
    if tree.data == "slice":
        name, a, b = tree.children
        span = _meta_span(tree, file)
        lo = value_of_token(a, file) if a is not None else None
        hi = value_of_token(b, file) if b is not None else None
        text = f"{name}[{a or ''}:{b or ''}]"
        return Value("slice", text, span, slice_of=str(name),
                     start=_slice_bound(lo), stop=_slice_bound(hi))
    return value_of_token(tree.children[0], file)


def _slice_bound(v: Value | None) -> int | None:
    # Non-integer bounds (`layers[1.5:3]`, `layers[2ms:3]`) become -1, which the validator rejects.
    if v is None:
        return None
    if v.unit or v.number is None or v.number.denominator != 1:
        return -1
    return int(v.number)
