"""`schedc run OUT`: run compiled per-rank programs locally (CPU with gloo, or GPUs).

Starts every live rank of ``OUT/programs.json`` as a local process
(`schedc.runtime.launcher.launch`), prints one line per finished iteration
(its wall time and mean loss), and fails with an E5xx diagnostic if any rank
fails. torch is imported only inside `run`, so other sub-commands stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schedc.diagnostics import RunError, error
from schedc.limits import seconds_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder written by `schedc compile SPEC -o OUT`")
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations to run (default: the spec's train.iterations)")
    parser.add_argument("--emulate", action="store_true",
                        help="replace every compute op by sleeping for its scheduled duration; "
                             "communication stays real (checks the schedule's timing)")
    parser.add_argument("--save-weights", metavar="FILE", default=None,
                        help="after the last iteration, torch.save the whole model's state_dict "
                             "(keys of model.source's full nn.Sequential)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds a rank waits for a peer before failing (default 60)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default); cuda: local rank i on GPU i mod the GPU count; cuda:N: all on GPU N")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="auto (default): nccl when every rank has a GPU of its own, else gloo")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary")


def run(args: argparse.Namespace) -> int:
    from schedc.runtime.launcher import launch

    if args.save_weights and args.emulate:
        raise RunError([error("E525", "--save-weights needs real compute, not --emulate",
                              hint="drop --emulate to train and save weights")])
    problem = seconds_problem(args.timeout, "--timeout")
    if problem:
        raise RunError([error("E524", problem)])
    if args.save_weights == "":  # (an empty name: it wrote nothing, and said nothing)
        raise RunError([error("E558", "--save-weights was given an empty file name", hint="give --save-weights FILE")])
    if args.save_weights:
        from schedc.plan import check_output_file

        check_output_file(args.save_weights, "--save-weights")  # before the run, not after it

    def progress(rep) -> None:
        if not args.json:
            loss = "" if args.emulate else f"  loss {rep.loss:.6f}"
            print(f"iteration {rep.iteration}: {rep.end - rep.start:.4f} s{loss}", flush=True)

    from schedc.runtime.processes import stop_forkserver

    try:
        result = launch(Path(args.out), iterations=args.iterations, emulate=args.emulate,
                        timeout=args.timeout, want_weights=bool(args.save_weights), progress=progress,
                        device=args.device, backend=args.backend)
    finally:
        # The ranks are stopped by now: their forkserver ends with the command, not seconds
        # after it as an orphan tearing down its torch import.
        stop_forkserver()
    if args.save_weights:
        import torch

        from schedc.cli.output import write_atomic

        write_atomic(args.save_weights, "--save-weights", lambda tmp: torch.save(result.state_dict, tmp))
    predicted = result.manifest.metrics.get("iteration_time")
    summary = {
        "ok": True,
        "iterations": len(result.iterations),
        "losses": None if args.emulate else result.losses,
        "iteration_times_s": [r.end - r.start for r in result.iterations],
        "steady_iteration_time_s": result.iteration_time(),
        "predicted_iteration_time_s": None if predicted is None else predicted / 1e6,
        "wall_s": result.wall_s,
        "weights": args.save_weights,
        "devices": list(result.placement.devices) if result.placement else None,
        "backend": result.placement.backend if result.placement else None,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        where = result.placement.describe() if result.placement else f"{len(result.manifest.live_ranks)} ranks"
        line = f"{len(result.iterations)} iterations on {where} in " \
               f"{result.wall_s:.2f} s; steady iteration time {result.iteration_time() * 1e3:.2f} ms"
        if predicted is not None:
            line += f" (schedule: {predicted / 1e3:.2f} ms)"
        print(line, file=sys.stdout)
        if args.save_weights:
            print(f"weights saved to {args.save_weights}")
    return 0
