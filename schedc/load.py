"""`schedc.load(path_or_text) -> Spec`: read, parse and validate a spec.

Path or text? A `pathlib.Path` is always a path. A `str` is spec *text* when
it contains a newline or a `{` (no spec fits on one line without a block,
and no sane file name contains `{`); otherwise it is a path. Bytes are
decoded as UTF-8 text.

Never prints, never exits: every problem is a `SpecError` carrying all
diagnostics (E1xx for reading and syntax, E2xx for meaning, E301 for a stage
lost to failures).
"""

from __future__ import annotations

import os

from schedc.diagnostics import Span, SpecError, error, source_lines
from schedc.parse import parse_text
from schedc.spec import Spec
from schedc.validate import validate

#: Specs larger than this are refused (E107): a spec is a few KiB; more is a mistake.
MAX_SPEC_BYTES = 1 << 20


def load(path_or_text: str | os.PathLike | bytes, *, name: str | None = None) -> Spec:
    """Load a spec from a file path or from spec text; raise `SpecError` with every problem found.

    >>> spec = load("cluster { dp = 1  pp = 1  gpu { memory = 1GiB } }\\n"
    ...             "stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms\\n"
    ...             "  optimizer = 0us  activation = 1MiB  stash = 0B  static = 0B  send = 1MiB } }\\n"
    ...             "train { microbatches = 2 }")
    >>> spec.dp, spec.stages[0].forward
    (1, 1000)
    """
    if isinstance(path_or_text, bytes):
        return load_text(decode_spec(path_or_text, name or "<spec>"), name=name or "<spec>")
    if isinstance(path_or_text, os.PathLike) or not looks_like_text(path_or_text):
        path = os.fspath(path_or_text)
        file = name or str(path)
        return load_text(decode_spec(read_spec_bytes(path, file), file), name=file)
    return load_text(path_or_text, name=name or "<spec>")


def load_argument(arg: str) -> tuple[Spec, str]:
    """A command line's SPEC: a path, or `-` for standard input (shown as `<stdin>`).
    Returns the spec and the text it was read from."""
    import sys

    if arg == "-":
        name, data = "<stdin>", sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
    else:
        name, data = arg, read_spec_bytes(arg)
    text = decode_spec(data, name)
    return load_text(text, name=name), text


def looks_like_text(s: str) -> bool:
    """True when the string is spec text rather than a path (see the module docstring)."""
    return "\n" in s or "{" in s or "\x00" in s  # (no path holds a NUL byte)


def load_text(text: str, *, name: str = "<spec>") -> Spec:
    """Parse and validate spec text; `name` is the file name shown in diagnostics."""
    if len(text) > MAX_SPEC_BYTES:
        raise _too_large(name, len(text.encode("utf-8", "surrogatepass")))
    return validate(parse_text(text, name), name=name)


def read_spec_bytes(path: str, file: str | None = None) -> bytes:
    """The bytes of a spec file, or `SpecError` E100 (missing, a directory, unreadable) / E107 (too large)."""
    file = file or path
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError([error("E100", f"cannot read `{file}`: no such file",
                               hint="check the path; spec files usually end in .sched")]) from None
    except IsADirectoryError:
        raise SpecError([error("E100", f"cannot read `{file}`: it is a directory",
                               hint="give the path of a spec file inside it")]) from None
    except PermissionError:
        raise SpecError([error("E100", f"cannot read `{file}`: permission denied")]) from None
    except (OSError, ValueError) as exc:  # ValueError: a path no system accepts
        raise SpecError([error("E100", f"cannot read `{file}`: {getattr(exc, 'strerror', None) or exc}")]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise _too_large(file, len(data))
    return data


def decode_spec(data: bytes, file: str) -> str:
    """UTF-8 text of a spec, or `SpecError` E106 pointing at the first invalid byte."""
    if len(data) > MAX_SPEC_BYTES:
        raise _too_large(file, len(data))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Lines as the parser counts them (a lone CR is a break too); the source shown is the
        # text with every invalid byte as U+FFFD, so the caret sits on the first one.
        lines = source_lines(_without_bom(data[: exc.start].decode("utf-8")))
        line, col = len(lines), len(lines[-1]) + 1
        span = Span(file, line, col, line, col + 1)
        raise SpecError([error(
            "E106", f"the spec is not UTF-8 text: invalid byte 0x{data[exc.start]:02x} at byte offset {exc.start}",
            span, label="not UTF-8", hint="save the spec as UTF-8 text; is this a binary file?")],
            {file: _without_bom(data.decode("utf-8", "replace"))}) from None
    return _without_bom(text)


def _without_bom(text: str) -> str:
    """A BOM is harmless; dropped so that columns count what an editor shows."""
    return text[1:] if text.startswith("\ufeff") else text


def _too_large(file: str, size: int) -> SpecError:
    return SpecError([error("E107", f"`{file}` is too large for a spec ({size} bytes; the limit is "
                                    f"{MAX_SPEC_BYTES} bytes)",
                            hint="a spec is a few kilobytes; is this the right file?")])
