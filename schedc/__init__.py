"""schedc: a declarative schedule compiler for fault-tolerant pipeline-parallel training."""

from schedc.diagnostics import (
    Diagnostic,
    InfeasibleError,
    RunError,
    SchedcError,
    SpecError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Diagnostic",
    "InfeasibleError",
    "RunError",
    "SchedcError",
    "SpecError",
    "VerificationError",
]
