"""Reaching a running job's store from the command line (`schedc agent`, `schedc rejoin`)."""

from __future__ import annotations

import math

from schedc.diagnostics import RunError, error


def connect(text: str, timeout: float, *, hint: str):
    """The `JobStore` at ``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:29500``), or E557."""
    from schedc.live.membership import JobStore

    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RunError([error("E557", f"--store `{text}` is not HOST:PORT", hint="e.g. --store 10.0.0.1:29500")])
    if not (math.isfinite(timeout) and timeout > 0):
        raise RunError([error("E557", f"--timeout must be a positive number of seconds, got {timeout}")])
    try:
        return JobStore.connect(host, int(port), timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise RunError([error("E557", f"cannot reach the run's store at {text}: {str(exc).strip().splitlines()[0]}",
                              hint=hint)]) from None
