"""The bounds on numbers of seconds and counts that every command and library call takes.

A time option or limit (`--timeout`, `--detect-timeout`, `schedule.time_limit`,
`schedc bench --time-limit`, ...) must be a positive, finite number of seconds,
at most `MAX_SECONDS`: longer ones overflow the store's and threads' waits (a
`timedelta`), and no run means them. A count of iterations (the spec's
`train.iterations`, `--iterations` of `schedc run` and `schedc train`) is at
most `MAX_ITERATIONS`, and `schedc profile`'s rounds at most `MAX_ROUNDS`: a
mistyped number is answered at once, not by a run that never ends.
`seconds_problem` and `count_problem` say what is wrong with a value, in the
same words everywhere; each caller turns it into its own diagnostic code.
"""

from __future__ import annotations

import math

#: The longest time taken anywhere, seconds (11.6 days).
MAX_SECONDS = 1e6
#: The longest a figure of the recovery cost model may be, seconds (31.7 years): the expected time
#: to the next event (`horizon`), a checkpoint interval, a restart's cost. No wait is made of
#: these, so they may be longer than `MAX_SECONDS` (a reliable cluster goes weeks between events);
#: the spec's `recovery` block, `schedc train --horizon` and `schedc replay` take the same range.
MAX_COST_SECONDS = 1e9
#: The most iterations a run may ask for (the spec's `train.iterations` takes the same range).
MAX_ITERATIONS = 10**9
#: The most timed (or warm-up) rounds `schedc profile` runs per stage.
MAX_ROUNDS = 100_000


def seconds_problem(value: object, what: str, most: float = MAX_SECONDS) -> str | None:
    """None when `value` is a positive, finite number of seconds up to `most`; else the problem,
    e.g. "--timeout must be a positive number of seconds (at most 1e+06), got nan"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and 0 < value <= most:
        return None
    shown = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    return f"{what} must be a positive number of seconds (at most {most:g}), got {shown}"


def count_problem(value: object, what: str, least: int, most: int) -> str | None:
    """None when `value` is a whole number from `least` to `most`; else the problem, e.g.
    "--iterations must be a whole number from 1 to 1,000,000,000, got 0"."""
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= most:
        return None
    shown = f"{value:g}" if isinstance(value, float) else value
    return f"{what} must be a whole number from {least:,} to {most:,}, got {shown}"
