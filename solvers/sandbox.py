"""Run one CP-SAT solve where a crash of the solver cannot take the caller down.

OR-Tools ends its process on an internal check failure (`Check failed: ...`,
then SIGABRT), and a launcher's supervisor replans in its own process: one
such abort would end the whole training job with no log. So `solve_contained`
forks, solves in the child and sends back the response (its text format; the
model is not copied, the child has it already). The parent waits on the child
and turns every way it can end into either the response or `SolverFailed`:

- it crashed (killed by a signal, or exited without a response): the message
  OR-Tools wrote on its stderr is kept for the diagnostic;
- it outlived its stop time by `KILL_AFTER_S` (a deadline is a promise): killed;
- it used no CPU for `STALL_S` (a deadlock, which forking a process with
  threads can cause in principle): killed;
- Ctrl-C in the caller: the child is killed and `KeyboardInterrupt` raised.

The caller then falls back to the plan it already has (greedy's, verified).
The same model, parameters and seed give the same response in the child as in
the process itself, so plans stay deterministic. Solves are serialised by a
lock: no other CP-SAT solve of this process runs while one forks.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import select
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass

#: A child still running this long after its stop time is killed (it was told to stop by then).
KILL_AFTER_S = 0.1
#: A child that used no CPU for this long is deadlocked (a search always computes): killed.
STALL_S = 30.0
#: How often the parent checks the child while it waits for its response.
POLL_S = 0.25
#: The child's exit status when Python itself failed there (the traceback is on its stderr).
_CHILD_ERROR = 70
#: How much of the child's stderr a diagnostic quotes (OR-Tools' last lines say what failed).
_STDERR_KEEP = 4000

_LOCK = threading.Lock()
#: The children solving now (`running`).
_CHILDREN: set[int] = set()


#: How every `SolverFailed` message begins, so that a plan's `SolverInfo.detail` says a solver failed
#: (`failure_of`) wherever the plan is reported.
FAILURE = "solver failure: "


class SolverFailed(Exception):
    """The solve ended without a response; `str()` says how (crash, killed at the deadline, stall)."""

    def __init__(self, detail: str, at_deadline: bool = False):
        super().__init__(FAILURE + detail)
        self.at_deadline = at_deadline


def failure_of(detail: str) -> str | None:
    """The solver failure a plan's `SolverInfo.detail` reports, or None."""
    i = detail.find(FAILURE)
    return None if i < 0 else detail[i + len(FAILURE):]


@dataclass(frozen=True)
class Solved:
    """A CP-SAT response, read as `CpSolver` reads its own."""

    response: object  # ortools' CpSolverResponse
    helper: object  # ortools' ResponseHelper (values of variables and literals in `response`)

    @property
    def status(self):
        return self.response.status

    @property
    def status_name(self) -> str:
        return self.response.status.name

    @property
    def objective_value(self) -> float:
        return self.response.objective_value

    @property
    def best_objective_bound(self) -> float:
        return self.response.best_objective_bound

    @property
    def deterministic_time(self) -> float:
        return self.response.deterministic_time

    def value(self, expression) -> int:
        return self.helper.value(self.response, expression)

    def boolean_value(self, literal) -> bool:
        return self.helper.boolean_value(self.response, literal)


def _solved(response) -> Solved:
    from ortools.sat.python.cp_model import cmh

    return Solved(response, cmh.ResponseHelper)


def solve_contained(solver, model, stop_at: float | None = None) -> Solved:
    """`solver.Solve(model)` in a child process; `stop_at`: a `time.monotonic()` time at which the
    search is stopped (its best solution so far is the response). Raises `SolverFailed`."""
    if not hasattr(os, "fork"):  # no fork (Windows): solve here, uncontained
        return _solve_here(solver, model, stop_at)
    with _LOCK:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns when a process with threads forks; the child runs only CP-SAT.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover (the child; it never returns)
            os.close(out_r)
            os.close(err_r)
            _child(solver, model, stop_at, out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        try:
            text, err, status = _wait(pid, out_r, err_r, stop_at)
        finally:
            os.close(out_r)
            os.close(err_r)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        from ortools.sat.python.cp_model import cmh

        response = cmh.CpSolverResponse()
        if response.parse_text_format(text.decode()):
            return _solved(response)
        raise SolverFailed("CP-SAT's response could not be read back")
    raise SolverFailed(_how_it_ended(status, err))


def running() -> list[int]:
    """The process ids of the solves running now (for tests that kill one mid-solve)."""
    return list(_CHILDREN)


def _child(solver, model, stop_at: float | None, out_w: int, err_w: int) -> None:  # pragma: no cover
    """The forked child: solve, write the response's text to `out_w`, exit. It imports nothing (a
    module lock another thread of the parent held at the fork would never be released here)."""
    code = _CHILD_ERROR
    try:
        # Ctrl-C reaches the whole process group: the parent decides, and kills this child.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        faulthandler.disable()  # a crash here is reported by the parent, not as a Python dump
        os.dup2(err_w, 2)  # OR-Tools' fatal message goes to the parent, not the user's terminal
        # The parent's sockets and pipes (a store, its workers): a peer that waits for one to close
        # must not wait for this child too.
        os.closerange(3, out_w)
        os.closerange(out_w + 1, 1 << 20)
        _die_with_parent()
        _stop_timer(solver, stop_at)
        solver.Solve(model)
        data = str(solver.response_proto).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(out_w, view):]
        code = 0
    except BaseException:  # noqa: BLE001 (reported through the exit status and stderr)
        traceback.print_exc()
    finally:
        os._exit(code)


def _stop_timer(solver, stop_at: float | None) -> threading.Timer | None:
    """A started timer that stops `solver`'s search at `stop_at` (`time.monotonic()`), or None."""
    if stop_at is None:
        return None
    timer = threading.Timer(max(0.0, stop_at - time.monotonic()), solver.StopSearch)
    timer.daemon = True
    timer.start()
    return timer


def _die_with_parent() -> None:  # pragma: no cover (the child)
    """Linux: the child gets SIGKILL when the parent dies (a killed launcher leaves no solver)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait(pid: int, out_r: int, err_r: int, stop_at: float | None) -> tuple[bytes, bytes, int]:
    """Read the child's response and stderr until it exits; kill it when it must not go on."""
    _CHILDREN.add(pid)
    out, err = bytearray(), bytearray()
    open_fds = {out_r, err_r}
    cpu, cpu_since = _cpu_ticks(pid), time.monotonic()
    why, at_deadline = None, False
    try:
        while open_fds:
            wait = POLL_S if stop_at is None else max(0.0, min(POLL_S, stop_at + KILL_AFTER_S - time.monotonic()))
            ready, _, _ = select.select(list(open_fds), [], [], wait)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.discard(fd)
                elif fd == out_r:
                    out += chunk
                else:
                    err = (err + chunk)[-_STDERR_KEEP:]
            now = time.monotonic()
            if stop_at is not None and now > stop_at + KILL_AFTER_S:
                why, at_deadline = "CP-SAT did not stop at the deadline and was killed", True
                break
            ticks = _cpu_ticks(pid)
            if ticks != cpu:
                cpu, cpu_since = ticks, now
            elif now - cpu_since > STALL_S:
                why = f"CP-SAT used no CPU for {STALL_S:.0f} s and was killed"
                break
    except BaseException:
        _kill(pid)
        raise
    finally:
        _CHILDREN.discard(pid)
    if why is not None:
        _kill(pid)
        raise SolverFailed(why, at_deadline)
    _, status = os.waitpid(pid, 0)
    return bytes(out), bytes(err), status


def _kill(pid: int) -> None:
    """End the child (ours, by pid) and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _cpu_ticks(pid: int) -> int | None:
    """The child's CPU time so far (user + system clock ticks), or None where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _how_it_ended(status: int, err: bytes) -> str:
    """'CP-SAT crashed (SIGABRT): Check failed: ...' from the child's wait status and stderr."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        how = f"CP-SAT crashed ({name})"
    else:
        how = f"CP-SAT's process exited with status {os.WEXITSTATUS(status)} and no response"
    lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    said = next((ln for ln in lines if "Check failed" in ln or "Error" in ln), lines[-1] if lines else "")
    return f"{how}: {said}" if said else how


def _solve_here(solver, model, stop_at: float | None) -> Solved:
    """Solve in this process (where it cannot fork): the search runs on a helper thread, so that a
    Ctrl-C (delivered to the main thread) stops it at once and is raised to the caller."""
    timer = _stop_timer(solver, stop_at)
    try:
        worker = threading.Thread(target=solver.Solve, args=(model,), name="schedc-cpsat", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.05)
        except KeyboardInterrupt:
            solver.StopSearch()
            worker.join()
            raise
    finally:
        if timer is not None:
            timer.cancel()
    return _solved(solver.response_proto)
