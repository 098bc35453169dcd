"""`schedc agent --store HOST:PORT --host H`: the agent of one more host of a live run.

`schedc train OUT --hosts N` on the first host runs the supervisor and that
host's agent; every other host runs this command, which starts, watches and
signals the workers of its nodes until the run ends (docs/live.md).
"""

from __future__ import annotations

import argparse

from schedc.cli import sigterm_as_interrupt
from schedc.cli.store import connect
from schedc.diagnostics import RunError, error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, metavar="HOST:PORT",
                        help="the run's store, as `schedc train --hosts N` prints it")
    parser.add_argument("--host", required=True, type=int, metavar="H", help="this host's number, 1..N-1")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds to keep trying to reach the store (default 60)")


def run(args: argparse.Namespace) -> int:
    from schedc.live.agent import Agent

    if args.host < 1:
        raise RunError([error("E557", f"--host must be 1 or more (host 0 runs the supervisor), got {args.host}")])
    job = connect(args.store, args.timeout,
                  hint="start `schedc train OUT --hosts N` first and use the address it prints")
    from schedc.runtime.processes import stop_forkserver

    with sigterm_as_interrupt():  # the way out of Ctrl-C: every worker of this host is stopped
        try:
            Agent(job, args.host).serve()
        finally:
            stop_forkserver()  # this host's workers are stopped: their forkserver ends now, not as an orphan
    return 0
