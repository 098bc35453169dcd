"""What the command line shows on a terminal: colour and a spinner, never in a pipe or a log.

Uses rich, imported only when stderr is a terminal (a script, CI or `| head`
gets the same plain text as always). `NO_COLOR` (https://no-color.org) turns
colour off; `TERM=dumb` too.
"""

from __future__ import annotations

import contextlib
import os
import sys


def interactive() -> bool:
    """Whether stderr is a terminal a person watches."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def status(message: str):
    """A spinner with `message` on stderr while the block runs (a terminal only)."""
    if not interactive():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message, spinner="dots")


def print_diagnostics(text: str) -> None:
    """Rendered diagnostics to stderr: coloured on a terminal (unless NO_COLOR), plain otherwise."""
    if not interactive() or os.environ.get("NO_COLOR"):
        print(text, file=sys.stderr)
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in text.splitlines():
        styled = Text(line)
        if line.startswith(("error[", "warning[")):
            head = line.split(":", 1)[0]
            styled.stylize("bold red" if line.startswith("error") else "bold yellow", 0, len(head))
        elif line.lstrip().startswith("-->"):
            styled.stylize("blue")
        elif line.lstrip().startswith("= hint:"):
            styled.stylize("cyan")
        elif set(line.strip(" |")) <= set("^") and "^" in line:
            styled.stylize("bold red")
        console.print(styled)
