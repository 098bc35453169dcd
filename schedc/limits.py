"""The one bound on a number of seconds that every command and library call takes.

A time option or limit (`--timeout`, `--detect-timeout`, `schedule.time_limit`,
`schedc bench --time-limit`, ...) must be a positive, finite number of seconds,
at most `MAX_SECONDS`: longer ones overflow the store's and threads' waits (a
`timedelta`), and no run means them. `seconds_problem` says what is wrong with
a value, in the same words everywhere; each caller turns it into its own
diagnostic code.
"""

from __future__ import annotations

import math

#: The longest time taken anywhere, seconds (11.6 days).
MAX_SECONDS = 1e6


def seconds_problem(value: object, what: str) -> str | None:
    """None when `value` is a positive, finite number of seconds up to `MAX_SECONDS`; else the
    problem, e.g. "--timeout must be a positive number of seconds (at most 1e+06), got nan"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and 0 < value <= MAX_SECONDS:
        return None
    shown = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    return f"{what} must be a positive number of seconds (at most {MAX_SECONDS:g}), got {shown}"
