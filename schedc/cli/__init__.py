"""The `schedc` command line.

Each sub-command is one module in this package exposing
``add_arguments(parser)`` and ``run(args) -> int``. This module only
dispatches, and turns every error into a diagnostic and an exit code: no
Python traceback reaches the user (set SCHEDC_DEBUG=1 to see one).

Exit codes: 0 success, 1 the input is invalid / infeasible / a run failed
(diagnostics on stderr), 2 bad command-line usage or an internal error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import traceback

from schedc import __version__
from schedc.diagnostics import SchedcError, shown

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("schedc.cli.check", "parse and validate a spec; print what it means"),
    "compile": ("schedc.cli.compile", "compile a spec into a verified schedule, exports and per-rank programs"),
    "simulate": ("schedc.cli.simulate", "re-verify and re-simulate a schedule.json"),
    "run": ("schedc.cli.run", "run compiled per-rank programs locally (CPU with gloo, or GPUs)"),
    "train": ("schedc.cli.train", "train a compiled plan with live workers that survive failures"),
    "agent": ("schedc.cli.agent", "run the agent of one more host of `schedc train --hosts N`"),
    "rejoin": ("schedc.cli.rejoin", "ask a running `schedc train` to take a repaired GPU back"),
    "bench": ("schedc.cli.bench", "compare schedc's planner with the baselines"),
    "profile": ("schedc.cli.profile", "time a model's stages and measure their memory; print a stages block"),
    "replay": ("schedc.cli.replay", "replay an availability trace through the planner and the recovery policies"),
}


def _chosen_command(argv: list[str]) -> str | None:
    """The sub-command named in argv (the first word that is not an option)."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Only `command`'s module is imported (fast start; see COMMANDS)."""
    parser = argparse.ArgumentParser(
        prog="schedc",
        description="Declarative schedule compiler for fault-tolerant pipeline-parallel training.",
    )
    parser.add_argument("--version", action="version", version=f"schedc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: this process's own) and return its exit code. As the
    `schedc` program itself, a command that loaded torch ends the process here instead
    (`_end_now`): torch's teardown would keep it seconds after its last line."""
    code = _main(argv)
    if argv is None and "torch" in sys.modules and getattr(sys.modules.get("schedc"), "_run_as_the_command",
                                                           lambda: False)():
        _end_now(code)
    return code


def _end_now(code: int) -> None:
    """End this process with `code` once its output is written and its exit handlers have run,
    skipping the interpreter's own teardown: with torch loaded, freeing every module's objects
    takes seconds of CPU after the command is done (more on a loaded machine), and its
    C++ destructors may run under threads torch still keeps. Everything the command wrote is
    closed by now; the exit handlers (multiprocessing's among them) run as they would."""
    import atexit

    _flush()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone (`| head`), or the stream is closed
            pass


def _main(argv: list[str] | None) -> int:
    try:
        _interruptible()
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser(_chosen_command(argv))
        args = parser.parse_args(argv)
        try:
            return int(args._module.run(args) or 0)
        except SchedcError as exc:
            try:
                if getattr(args, "json", False):
                    first, omitted = shown(exc.diagnostics, per_code=100)
                    out = {"ok": False, "diagnostics": [d.to_json() for d in first]}
                    if omitted:
                        out["omitted"] = omitted  # code -> how many more, not listed
                    print(json.dumps(out, indent=2))
                else:
                    from schedc.cli.terminal import print_diagnostics

                    print_diagnostics(exc.render())
            except BrokenPipeError:  # (`... --json | head`: the reader left, and the command failed all the same)
                _silence_stdout()
            return 1
    except KeyboardInterrupt as exc:
        if os.environ.get("SCHEDC_DEBUG"):
            traceback.print_exc()
        return _interrupted(getattr(exc, "signal_name", "SIGINT"))
    except BrokenPipeError:  # `schedc ... | head`: the reader left; say nothing more
        _silence_stdout()
        return 0
    except Exception as exc:  # the last line of defence: a bug in schedc, not a user mistake
        if os.environ.get("SCHEDC_DEBUG"):
            traceback.print_exc()
        print(f"error[E000]: internal error in schedc: {type(exc).__name__}: {exc}\n"
              "  = hint: this is a bug in schedc, not in your input; rerun with SCHEDC_DEBUG=1 "
              "and report the traceback", file=sys.stderr)
        return 2


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler ending the job), raised where Ctrl-C would be, so that it takes the
    same way out (`sigterm_as_interrupt`); `main` names it in its last line."""

    signal_name = "SIGTERM"


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread."""
    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interruptible() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt, which `main` turns into one line and exit
    130 (before, while the package loaded, `schedc/__init__.py`'s handler did that by itself).
    Left alone where Ctrl-C is ignored (a shell's background job) or handled by the caller."""
    if signal.getsignal(signal.SIGINT) is getattr(sys.modules.get("schedc"), "_interrupted_while_loading", None):
        signal.signal(signal.SIGINT, _ctrl_c_once)


def _ctrl_c_once(signum, frame) -> None:
    """The `schedc` command's Ctrl-C: KeyboardInterrupt, once. A second one while the command
    ends (a double press) is ignored: it printed a traceback from wherever the ending was, the
    interpreter's own shutdown included (SIGTERM and SIGKILL still end it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _interrupted(signal_name: str) -> int:
    """The one line of an interrupted command, and exit status 130 (128 + SIGINT, as a shell
    reports a Ctrl-C; SIGTERM too, which `train` and `agent` take the same way out).

    Other threads may still run native code: CP-SAT's search goes on for a moment after it is
    told to stop (and Python 3.11 takes a `join` that Ctrl-C interrupted for the thread's end),
    torch keeps threads of its own. The interpreter's normal exit would destroy their objects
    under them, and the C++ runtime would abort the process ("terminate called without an
    active exception", exit 134). Everything was cleaned up on the way here (finally blocks, the
    supervisor's teardown), so with any other thread alive the process ends at once instead."""
    print("interrupted" if signal_name == "SIGINT" else f"terminated ({signal_name})", file=sys.stderr)
    if _other_threads():
        _flush()
        os._exit(130)
    return 130


def _other_threads() -> bool:
    """Whether this process runs any thread besides the calling one (Linux; else Python's)."""
    try:
        return len(os.listdir("/proc/self/task")) > 1
    except OSError:
        return threading.active_count() > 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
