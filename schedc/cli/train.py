"""`schedc train OUT`: train a compiled plan with live workers, through failures (docs/live.md).

Prints one line per finished iteration and per event (failure, replan,
reconfiguration, checkpoint), then a summary; `--log FILE` writes the whole
run as JSON, `--save-weights FILE` the final weights. Ctrl-C (or SIGTERM)
stops every worker and leaves no half-written file.
"""

from __future__ import annotations

import argparse
import json
import sys

from schedc.cli import sigterm_as_interrupt
from schedc.cli.output import check_writable, write_atomic
from schedc.diagnostics import RunError, error
from schedc.live.options import FAIL_SLOW_MODES, RECOVERY_METHODS
from schedc.live.options import TrainOptions as D  # the defaults, one place


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder written by `schedc compile SPEC -o OUT`")
    parser.add_argument("--iterations", type=int, default=None, help="iterations (default: the spec's)")
    parser.add_argument("--emulate", action="store_true",
                        help="ops sleep for their planned cost instead of computing (timing checks)")
    parser.add_argument("--device", default=D.device,
                        help="cpu (default); cuda: rank i on GPU i mod the GPUs of its host; cuda:N: every rank "
                             "on GPU N (docs/live.md: training on GPUs)")
    parser.add_argument("--backend", default=D.backend, choices=("auto", "gloo", "nccl"),
                        help="how ranks talk: a live run recovers over gloo (CUDA tensors go through host "
                             "memory); nccl is refused with the reason")
    parser.add_argument("--inject", action="append", default=[], metavar="TEXT",
                        help='a fault to inject, e.g. "at iteration 3 during B: fail gpu(dp=1, pp=2)" '
                             "(repeatable; docs/live.md has the syntax)")
    parser.add_argument("--save-weights", metavar="FILE", help="torch.save the final weights of the whole model")
    parser.add_argument("--log", metavar="FILE", help="write the run (iterations, events, recoveries) as JSON")
    parser.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every, metavar="K",
                        help="write a complete checkpoint every K iterations (default: none)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go (default OUT/checkpoints)")
    parser.add_argument("--keep-checkpoints", type=int, default=D.keep_checkpoints, metavar="N",
                        help=f"complete checkpoints to keep (default {D.keep_checkpoints})")
    parser.add_argument("--resume", action="store_true", help="start from the latest complete checkpoint")
    parser.add_argument("--recovery", choices=RECOVERY_METHODS, default=None,
                        help="how to go on after a failure (default: the spec's `recovery.policy`, else auto): "
                             "auto (the cheaper of reroute and "
                             "drop-pipeline by predicted iteration time and transition cost, each decision "
                             "printed with its numbers), reroute (survivors take the failed GPU's work), "
                             "drop-pipeline (its pipeline leaves), restart (everything restarts from the latest "
                             "checkpoint, the GPU replaced)")
    parser.add_argument("--shadow", action="store_true",
                        help="every GPU also keeps an exact copy of the previous stage, stepped with the "
                             "gradient its GPUs stream to it: losing every GPU of a stage then loses no work "
                             "(the survivors save the state and restart from it); costs memory and one more "
                             "optimizer step per iteration (docs/live.md: shadows)")
    parser.add_argument("--horizon", type=float, default=None, metavar="S",
                        help="recovery auto: seconds to the next failure assumed until two have been seen, "
                             "then their mean gap (default: the spec's `recovery.horizon`, else 900)")
    parser.add_argument("--fail-slow", choices=FAIL_SLOW_MODES, default=D.fail_slow,
                        help="slow GPUs: act (default: find them from their ops' times and rebalance or "
                             "exclude them when that pays, take them back when healthy), detect (only say "
                             "so), off")
    parser.add_argument("--detect-timeout", type=float, default=D.detect_timeout, metavar="S",
                        help="the least heartbeat silence, seconds, before a rank can count as hung (default "
                             f"{D.detect_timeout:g}); longer when its beats jitter (--phi) or its peers were "
                             "silent too")
    parser.add_argument("--phi", type=float, default=D.phi, metavar="PHI",
                        help="a silence counts as a hang when a gap that long has a probability under 10^-PHI, "
                             f"judged from the rank's own heartbeats (phi accrual; default {D.phi:g})")
    parser.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                        help="seconds without any op finishing before a busy rank counts as stuck "
                             "(default: max(10, 10 x the plan's iteration time))")
    parser.add_argument("--transition-timeout", type=float, default=D.transition_timeout, metavar="S",
                        help="seconds a new generation may take to become ready once its processes run; then "
                             "it is tried again, then every process restarts from the latest checkpoint, then "
                             f"the run stops with E554 (default {D.transition_timeout:g})")
    parser.add_argument("--replan-deadline", type=float, default=D.replan_deadline, metavar="S",
                        help=f"seconds the planner may take per failure (default {D.replan_deadline:g})")
    parser.add_argument("--max-restarts", type=int, default=D.max_restarts, metavar="N",
                        help=f"checkpoint restarts allowed when a stage loses every GPU (default {D.max_restarts})")
    parser.add_argument("--hosts", type=int, default=D.hosts, metavar="H",
                        help=f"hosts taking part; hosts 1..H-1 run `schedc agent` (default {D.hosts})")
    parser.add_argument("--store-host", default=D.store_host, metavar="HOST",
                        help=f"address the job's store listens on and agents connect to (default {D.store_host})")
    parser.add_argument("--store-port", type=int, default=D.store_port, metavar="PORT",
                        help="store port (default: a free one)")
    parser.add_argument("--json", action="store_true", help="print the run log as JSON instead of progress lines")


def run(args: argparse.Namespace) -> int:
    from schedc.live.supervisor import Supervisor, TrainError, TrainOptions
    from schedc.runtime.processes import stop_forkserver

    for path, what in ((args.save_weights, "--save-weights"), (args.log, "--log")):
        if path == "":  # (an empty name: it wrote nothing, and said nothing)
            raise RunError([error("E558", f"{what} was given an empty file name", hint=f"give {what} FILE")])
        if path:
            check_writable(path, what)  # before the run, not after an hour of it
    options = TrainOptions(
        iterations=args.iterations, emulate=args.emulate, inject=tuple(args.inject),
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, recovery=args.recovery,
        horizon=args.horizon, fail_slow=args.fail_slow,
        detect_timeout=args.detect_timeout, phi=args.phi, stall_timeout=args.stall_timeout,
        replan_deadline=args.replan_deadline,
        transition_timeout=args.transition_timeout,
        max_restarts=args.max_restarts, want_weights=bool(args.save_weights), hosts=args.hosts,
        store_host=args.store_host, store_port=args.store_port, device=args.device, backend=args.backend,
        shadow=args.shadow)

    def line(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    sup = Supervisor(args.out, options, on_line=line)
    with sigterm_as_interrupt():  # a scheduler ending the job: the same way out as Ctrl-C
        try:
            result = sup.run()
        except TrainError as exc:
            _write_log(args.log, exc.result, quiet=True)
            raise
        except KeyboardInterrupt:
            _write_log(args.log, sup.result(), quiet=True)
            raise
        finally:
            # The run started the workers' forkserver: it ends with the run (its workers are
            # stopped by now), not seconds after this process, as an orphan.
            stop_forkserver()
    if args.save_weights:
        import torch

        write_atomic(args.save_weights, "--save-weights", lambda tmp: torch.save(result.state_dict, tmp))
    _write_log(args.log, result)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=str))
        return 0
    print(summary(result))
    if args.save_weights:
        print(f"weights saved to {args.save_weights}")
    if args.log:
        print(f"log written to {args.log}")
    return 0


def _write_log(path: str | None, result, *, quiet: bool = False) -> None:
    """The run log, whole or not at all. `quiet` (the run failed or was stopped): a log that
    cannot be written is one line on stderr, not an error in place of the run's own."""
    if not path:
        return
    text = json.dumps(result.to_json(), indent=2, default=str) + "\n"
    try:
        write_atomic(path, "--log", lambda tmp: tmp.write_text(text))
    except RunError as exc:
        if not quiet:
            raise
        print(f"warning: {exc.diagnostics[0].message}", file=sys.stderr)


def summary(result) -> str:
    """The closing lines of `schedc train`: iterations, time, and each recovery's milestones."""
    gens = result.generations
    ranks = sorted({len(g.members) for g in gens})
    ranks_text = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
    lines = [f"{len(result.iterations)} iterations in {result.wall_s:.2f} s on {ranks_text} ranks, "
             f"{len(gens)} generation{'s' if len(gens) != 1 else ''}"]
    for i, rec in enumerate(result.recoveries, 1):
        d = rec.durations()
        parts = [f"{name} {d[key]:.2f} s" for name, key in (("detected", "detect"), ("planned", "plan"),
                                                              ("reconfigured", "reconfigure"),
                                                              ("first iteration", "first_iteration"))
                 if d[key] is not None]
        since = "fault" if rec.t_fault is not None else "detection"
        lines.append(f"recovery {i} ({rec.method}, rank(s) {rec.failed}): " + ", ".join(parts)
                     + f" after the {since}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
