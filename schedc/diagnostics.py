"""Diagnostics: what went wrong, where, and how to fix it.

Every user-facing error in schedc is a list of `Diagnostic`s carried by a
`SchedcError` subclass. Rendering follows the rustc style the design asks
for::

    error[E201]: unknown key `forwrd` in `stages.all`
     --> specs/example.sched:12:9
       |
    12 |         forwrd = 1.0ms
       |         ^^^^^^ did you mean `forward`?
       = hint: the keys of a stage are forward, backward_input, ...

Codes are stable: E1xx syntax, E2xx spec meaning, E3xx infeasible,
E4xx verification, E5xx codegen/run.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Span:
    """A region of a source text. Lines (as `source_lines` counts them) and columns (in
    characters) are 1-based; `end_*` is exclusive. Column n+1 of a line of n characters is
    its end (where "unexpected end of input" points)."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Label:
    """A secondary place that explains a diagnostic (e.g. the `fail` line that caused it)."""

    span: Span
    message: str


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span | None = None
    label: str = ""
    hint: str = ""
    notes: tuple[Label, ...] = ()
    detail: str = ""  # free text shown after the source excerpt (e.g. a rank x step grid)

    @property
    def severity(self) -> str:
        return "error"

    def to_json(self) -> dict:
        out: dict = {"code": self.code, "message": self.message}
        if self.span is not None:
            out["file"] = self.span.file
            out["line"] = self.span.line
            out["column"] = self.span.column
        if self.hint:
            out["hint"] = self.hint
        if self.notes:
            out["notes"] = [
                {"file": n.span.file, "line": n.span.line, "column": n.span.column, "message": n.message}
                for n in self.notes
            ]
        if self.detail:
            out["detail"] = self.detail
        return out


class SchedcError(Exception):
    """Base of every error schedc raises on purpose. Carries diagnostics."""

    def __init__(self, diagnostics: Sequence[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)
        self.sources: dict[str, str] = dict(sources or {})
        first = self.diagnostics[0] if self.diagnostics else None
        summary = f"error[{first.code}]: {first.message}" if first else "error"
        if len(self.diagnostics) > 1:
            summary += f" (and {len(self.diagnostics) - 1} more)"
        super().__init__(summary)

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]

    def render(self) -> str:
        return render_all(self.diagnostics, self.sources)

    def __str__(self) -> str:
        # What the CLI prints, carets, suggestions and hints included: a library caller's
        # traceback (`schedc.replan(plan, "fial gpu(...)")`) says as much as `schedc` does.
        # `args[0]` stays the one-line summary.
        return self.render() if self.diagnostics else super().__str__()


class SpecError(SchedcError):
    """The spec text is malformed (E1xx) or means something impossible (E2xx)."""


class InfeasibleError(SchedcError):
    """No schedule exists for the spec, or the chosen solver cannot make one (E3xx)."""


class LostStageError(SpecError, InfeasibleError):
    """Only E3xx problems: failures leave a stage without any live GPU (E301), or no microbatch
    fits in memory (E302). Both a `SpecError` and an `InfeasibleError`."""


def spec_error(diags: Sequence[Diagnostic], sources: dict[str, str]) -> SpecError:
    """The error for a spec's problems: a `LostStageError` when all are E3xx, else a `SpecError`."""
    # E1xx/E2xx sort before E3xx (meaning errors usually explain the rest); within each, in
    # source order, so a user can work down the file.
    ordered = sorted(diags, key=lambda d: (d.code[:2] == "E3",
                                           (d.span.line, d.span.column) if d.span else (0, 0)))
    if all(d.code.startswith("E3") for d in ordered):
        return LostStageError(ordered, sources)
    return SpecError(ordered, sources)


class VerificationError(SchedcError):
    """A schedule breaks a rule of docs/architecture.md, "the meaning of a schedule" (E4xx)."""


class RunError(SchedcError):
    """Code generation or a run of generated programs failed (E5xx)."""


def error(code: str, message: str, span: Span | None = None, *, label: str = "", hint: str = "",
          notes: Iterable[Label] = (), detail: str = "") -> Diagnostic:
    return Diagnostic(code=code, message=message, span=span, label=label, hint=hint,
                      notes=tuple(notes), detail=detail)


def exception_site(exc: BaseException, *, outside_schedc: bool = False) -> str:
    """Where an exception from user code was raised, for a one-line diagnostic: the deepest frame
    outside torch and schedc (the user's model), and the library frame it failed in, e.g.
    ``mymodel.py:12 (in torch's linear.py:134)``. '' without a traceback, and with
    `outside_schedc` when the error rose in schedc's own code (the caller says where instead)."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return ""
    def library(f) -> str | None:
        parts = f.filename.replace(os.sep, "/").split("/")
        for lib in ("torch", "schedc"):
            if lib in parts[:-1]:
                return lib
        return None
    last = frames[-1]
    own = [f for f in frames if library(f) is None and not f.filename.startswith("<")]
    name = lambda f: f"{os.path.basename(f.filename)}:{f.lineno}"
    if own and own[-1] is not last and library(last):
        return f"{name(own[-1])} (in {library(last)}'s {name(last)})"
    if outside_schedc and library(last) == "schedc":
        return ""
    return name(last)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`did you mean `x`?` for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"did you mean `{match[0]}`?" if match else ""


#: A source line longer than this is shown as a window around the span, not whole.
EXCERPT_WIDTH = 100
#: Diagnostics of one code shown in full; the rest are counted ("and 49,990 more like this").
SHOWN_PER_CODE = 10
#: Notes of one diagnostic shown with their excerpt; the rest are counted (an E301 after
#: 10,000 `fail` lines has 10,000 notes).
NOTES_SHOWN = 10


#: Characters `str.splitlines` breaks at that are no line break in a spec: shown as spaces.
_NOT_BREAKS = {c: " " for c in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}


def source_lines(text: str) -> list[str]:
    """The lines that spans count: separated by `\n`, `\r\n` or a lone `\r` (as the parser,
    after `schedc.parse.normalize_newlines`, and editors count them), nothing else. Form feeds,
    `\x85`, `\u2028` and the like are not breaks (`str.splitlines` would shift every line
    after one); they come back as spaces, so columns stay right."""
    return text.replace("\r\n", "\n").replace("\r", "\n").translate(_NOT_BREAKS).split("\n")


@lru_cache(maxsize=8)
def _lines(text: str) -> list[str]:
    # Once per source, not once per diagnostic: a long line is not copied per note.
    return [line.expandtabs(1) for line in source_lines(text)]


def _excerpt(span: Span, sources: dict[str, str], label: str) -> list[str]:
    text = sources.get(span.file)
    if text is None:
        return []
    lines = _lines(text)
    if not 1 <= span.line <= len(lines):
        return []
    src = lines[span.line - 1]
    width = len(str(span.line))
    gutter = " " * width
    start = max(span.column - 1, 0)
    if span.end_line == span.line and span.end_column > span.column:
        length = span.end_column - span.column
    else:
        length = max(len(src.rstrip()) - start, 1)
    length = max(1, min(length, max(len(src) - start, 1)))
    if len(src) > EXCERPT_WIDTH:  # a window of the line around the span
        left = max(0, min(start - EXCERPT_WIDTH // 3, len(src) - EXCERPT_WIDTH))
        shown = src[left:left + EXCERPT_WIDTH]
        prefix = "..." if left > 0 else ""
        suffix = "..." if left + EXCERPT_WIDTH < len(src) else ""
        start = start - left + len(prefix)
        length = max(1, min(length, EXCERPT_WIDTH - (start - len(prefix))))
        src = prefix + shown + suffix
    out = [f"{gutter} |", f"{span.line} | {src}", f"{gutter} | {' ' * start}{'^' * length}"]
    if label:
        out[-1] += f" {label}"
    return out


def render(diag: Diagnostic, sources: dict[str, str] | None = None) -> str:
    """Render one diagnostic as text (no colours; stable for golden tests)."""
    sources = sources or {}
    out = [f"{diag.severity}[{diag.code}]: {diag.message}"]
    if diag.span is not None:
        width = len(str(diag.span.line))
        out.append(f"{' ' * width}--> {diag.span}")
        out.extend(_excerpt(diag.span, sources, diag.label))
    for note in diag.notes[:NOTES_SHOWN]:
        width = len(str(note.span.line))
        out.append(f"{' ' * width}--> {note.span}")
        out.extend(_excerpt(note.span, sources, note.message))
    if len(diag.notes) > NOTES_SHOWN:
        out.append(f"  ... and {len(diag.notes) - NOTES_SHOWN:,} more notes like these")
    if diag.detail:
        out.extend(diag.detail.rstrip("\n").splitlines())
    if diag.hint:
        out.append(f"  = hint: {diag.hint}")
    return "\n".join(out)


def shown(diagnostics: Sequence[Diagnostic], per_code: int = SHOWN_PER_CODE
          ) -> tuple[list[Diagnostic], dict[str, int]]:
    """The diagnostics to show (the first `per_code` of each code, in order) and how many of
    each code were left out: a spec repeating one mistake 50,000 times gets ten, and a count."""
    seen: dict[str, int] = {}
    out, omitted = [], {}
    for d in diagnostics:
        seen[d.code] = seen.get(d.code, 0) + 1
        if seen[d.code] <= per_code:
            out.append(d)
        else:
            omitted[d.code] = omitted.get(d.code, 0) + 1
    return out, omitted


def render_all(diagnostics: Sequence[Diagnostic], sources: dict[str, str] | None = None) -> str:
    first, omitted = shown(diagnostics)
    parts = [render(d, sources) for d in first]
    parts += [f"... and {n:,} more like this ({code})" for code, n in omitted.items()]
    body = "\n\n".join(parts)
    n = len(diagnostics)
    if n > 1:
        body += f"\n\n{n:,} errors"
    return body
