"""schedc: a declarative schedule compiler for fault-tolerant pipeline-parallel training."""

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
    raise AttributeError(f"module 'schedc' has no attribute {name!r}")


__all__ = [
    "__version__",
    "Plan",
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

