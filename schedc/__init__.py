"""schedc: a declarative schedule compiler for fault-tolerant pipeline-parallel training."""

import os as _os
import sys as _sys


def _interrupted_while_loading(signum, frame):
    _os.write(2, b"interrupted\n")
    _os._exit(130)


def _run_as_the_command() -> bool:
    """Whether this interpreter was started as `schedc ...` or `python -m schedc ...` (its own
    command line, not the one a multiprocessing child is handed)."""
    words = list(getattr(_sys, "orig_argv", ()))[1:]
    while words and words[0].startswith("-") and words[0] != "-m":  # the interpreter's options
        words.pop(0)
    if words[:2] == ["-m", "schedc"]:
        return True
    return bool(words) and _os.path.basename(words[0]) in ("schedc", "schedc.exe")


# The `schedc` command: a Ctrl-C while the modules below load ends it with one line and exit
# status 130, as at any later moment, not with a traceback of whatever was importing;
# `schedc.cli.main` takes over from here. `import schedc` in a program of the user's (or in a
# worker process) leaves that program's signal handling alone.
if _run_as_the_command():
    import signal as _signal

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _interrupted_while_loading)

from schedc.diagnostics import (
    Diagnostic,
    InfeasibleError,
    RunError,
    SchedcError,
    SpecError,
    VerificationError,
)
from schedc.version import __version__

# Imported eagerly on purpose: the function `load` must shadow the submodule
# `schedc.load` of the same name (lark and pydantic only; no torch, no OR-Tools).
from schedc.load import load  # noqa: E402
from schedc.printer import print_spec  # noqa: E402
from schedc.replan import replan  # noqa: E402  (same reason; OR-Tools loads only when it runs)



def __getattr__(name: str):
    # `compile` and `Plan` load lazily so `import schedc` stays light (no OR-Tools, no torch).
    if name in ("compile", "Plan"):
        from schedc import plan

        return getattr(plan, name)
    if name == "Replanner":
        from schedc.replanner import Replanner

        return Replanner
    raise AttributeError(f"module 'schedc' has no attribute {name!r}")


__all__ = [
    "__version__",
    "Plan",
    "Replanner",
    "compile",
    "Diagnostic",
    "InfeasibleError",
    "RunError",
    "SchedcError",
    "SpecError",
    "VerificationError",
    "load",
    "print_spec",
    "replan",
]

