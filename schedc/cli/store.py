"""Reaching a running job's store from the command line (`schedc agent`, `schedc rejoin`).

While torch's TCPStore client retries an address that does not answer, its C++
code logs each failed try to the process's stderr (file descriptor 2, below
Python), with the whole C++ stack of the exception (~40 "frame #N" lines);
the exception itself, which E557 quotes, says the same in one line. So the
connection is made with descriptor 2 pointed at a scratch file, thrown away,
and torch's C++ log is set to errors only before torch is imported: a store
that goes away later (the supervisor ended) is a diagnostic of the command's
own, not a warning with a C++ stack for each call that found it gone.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from schedc.diagnostics import RunError, error
from schedc.limits import seconds_problem

# Before the command imports torch (its C++ log level is read once, then): see the module docstring.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def connect(text: str, timeout: float, *, hint: str):
    """The `JobStore` at ``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:29500``), or E557."""

    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RunError([error("E557", f"--store `{text}` is not HOST:PORT", hint="e.g. --store 10.0.0.1:29500")])
    problem = seconds_problem(timeout, "--timeout")
    if problem:
        raise RunError([error("E557", problem)])
    from schedc.live.membership import JobStore

    try:
        with _native_stderr_discarded():
            return JobStore.connect(host, int(port), timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise RunError([error("E557", f"cannot reach the run's store at {text}: {str(exc).strip().splitlines()[0]}",
                              hint=hint)]) from None


@contextlib.contextmanager
def _native_stderr_discarded():
    """Within the block, what native code writes to stderr goes nowhere (see the module docstring)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no stderr to protect
        yield
        return
    try:
        with tempfile.TemporaryFile() as scratch:  # (a file, not a pipe: it never fills up and blocks)
            os.dup2(scratch.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
