"""`schedc rejoin --store HOST:PORT "recover gpu(dp=D, pp=S)"`: take a repaired GPU back into a live run.

The run's supervisor (`schedc train`) starts a worker for the GPU on its
host, lets it catch up from a live peer of its stage while training goes on,
and switches it in at an iteration boundary (docs/live.md). This command
only asks; the run's output says what happens.
"""

from __future__ import annotations

import argparse
import time

from schedc.cli.store import connect
from schedc.diagnostics import RunError, error

#: Where the user finds the address: the line of the run's first generation (`schedc.live.transitions`,
#: its "running" note); README.md and docs/live.md quote it (tests/test_live_failslow.py checks all three).
STORE_LINE = "generation 0: N ranks running from iteration I; store HOST:PORT"
STORE_WHERE = f"is `schedc train` running? its line `{STORE_LINE}` gives the address"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, metavar="HOST:PORT",
                        help=f"the run's store: `schedc train` prints it at the end of its line `{STORE_LINE}` "
                             "(choose it beforehand with train's --store-host/--store-port)")
    parser.add_argument("event", metavar="EVENT", help='the GPU, e.g. "recover gpu(dp=1, pp=2)"')
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds to keep trying to reach the store (default 10)")


def run(args: argparse.Namespace) -> int:
    from schedc.events import parse_events
    from schedc.live.protocol import RejoinAsked

    if not args.event.strip():  # (the parser's hint would suggest a `fail` statement, which this refuses)
        raise RunError([error("E557", "no event given: rejoin takes one `recover gpu(dp=D, pp=S)`",
                              hint='e.g. schedc rejoin --store 10.0.0.1:29500 "recover gpu(dp=1, pp=2)"')])
    events = parse_events(args.event)  # a SpecError with a caret when it is not an event
    if len(events) != 1 or events[0].kind != "recover_gpu":
        raise RunError([error("E557", f"`{args.event}` is not one `recover gpu(dp=D, pp=S)`",
                              hint='e.g. schedc rejoin --store 10.0.0.1:29500 "recover gpu(dp=1, pp=2)"')])
    job = connect(args.store, args.timeout, hint=STORE_WHERE)
    (ev,) = events
    dp, pp = job.config().cluster
    if not (0 <= ev.dp < dp and 0 <= ev.pp < pp):
        raise RunError([error("E557", f"the run has no GPU (dp={ev.dp}, pp={ev.pp}): its cluster is dp {dp} x pp {pp}",
                              hint=f"dp is 0..{dp - 1}, pp is 0..{pp - 1}")])
    job.report(RejoinAsked(event=args.event, t=time.time()))
    print(f"asked the run at {args.store} to take back: {args.event}")
    return 0
