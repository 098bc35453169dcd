"""A crashing, hanging or runaway CP-SAT never takes its caller down (solvers/sandbox.py).

OR-Tools ends its process on an internal check failure. These tests make the solve crash for
real: the solve runs in a forked child, so `CpSolver.Solve` patched in this process is what the
child runs, and `os.abort()` there is the SIGABRT OR-Tools raises. The caller must get the plan it
had before the search (greedy's, verified), with the failure said, and go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import schedc
from live_support import check_exact, spec_text, wait_until
from schedc.solvers import SolveOptions, get_solver, sandbox
from schedc.solvers.cpsat import solve, warm_up
from schedc.verify import verify_schedule
from tests.strategies import bench_explicit

ROOT = Path(__file__).resolve().parents[1]
#: What OR-Tools printed before its abort in the reported crash.
CHECK_FAILED = "Check failed: solution->size() == postsolve_mapping.size() (0 vs. 518)"


def _abort_like_or_tools(self, model, *args, **kwargs):
    os.write(2, f"F1126 20:00:00.000000 1 cp_model_solver.cc:1] {CHECK_FAILED}\n".encode())
    os.abort()


def _ignore_every_stop(self, model, *args, **kwargs):
    time.sleep(3600)  # neither its limits nor StopSearch end it


def _deadlock(self, model, *args, **kwargs):
    threading.Event().wait()  # waits forever and uses no CPU


@pytest.fixture
def cp_model():
    warm_up()
    from ortools.sat.python import cp_model

    return cp_model


def _instance():
    """Greedy's plan is above the proven bound here, so CP-SAT runs (tests/test_cpsat.py)."""
    return bench_explicit(slow={(1, 0): 0.5, (1, 3): 0.6})


def _greedy_ops(instance, options):
    return get_solver("greedy")(instance, options).ops


def test_an_or_tools_abort_mid_solve_leaves_the_plan_found_before_it(cp_model, monkeypatch):
    inst, options = _instance(), SolveOptions(time_limit=0.2)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", _abort_like_or_tools)
    schedule = solve(inst, options)  # this process is still here
    verify_schedule(schedule)
    assert schedule.solver.status == "fallback"
    assert schedule.ops == _greedy_ops(inst, options)
    failure = sandbox.failure_of(schedule.solver.detail)
    assert failure is not None and failure.startswith("CP-SAT crashed (SIGABRT)"), schedule.solver.detail
    assert CHECK_FAILED in failure  # OR-Tools' own words, not a C++ stack on the user's terminal
    assert sandbox.running() == []


def test_a_solver_killed_from_outside_mid_solve_leaves_the_plan_found_before_it(cp_model):
    """SIGKILL of the solving process while CP-SAT searches (a large budget keeps it searching)."""
    inst, options = _instance(), SolveOptions(time_limit=600)
    result = []
    caller = threading.Thread(target=lambda: result.append(solve(inst, options)), daemon=True)
    caller.start()
    (pid,) = wait_until(sandbox.running, "CP-SAT's solve to start")
    os.kill(pid, signal.SIGKILL)
    caller.join(60)
    (schedule,) = result
    verify_schedule(schedule)
    assert schedule.solver.status == "fallback"
    assert schedule.ops == _greedy_ops(inst, options)
    assert sandbox.failure_of(schedule.solver.detail).startswith("CP-SAT crashed (SIGKILL)")
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped, not a zombie


def test_a_solver_that_does_not_stop_at_the_deadline_is_killed(cp_model, monkeypatch):
    inst = _instance()
    options = SolveOptions(time_limit=600, deadline=time.monotonic() + 5)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", _ignore_every_stop)
    schedule = solve(inst, options)
    verify_schedule(schedule)
    assert schedule.solver.status == "fallback" and schedule.solver.stopped_by == "deadline"
    assert "did not stop at the deadline" in (sandbox.failure_of(schedule.solver.detail) or ""), schedule.solver
    assert sandbox.running() == []


def test_a_deadlocked_solver_is_killed(cp_model, monkeypatch):
    """No deadline, but a child that uses no CPU is not searching: it is not waited for forever."""
    monkeypatch.setattr(sandbox, "STALL_S", 0.5)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", _deadlock)
    schedule = solve(_instance(), SolveOptions(time_limit=600))
    verify_schedule(schedule)
    assert "used no CPU" in sandbox.failure_of(schedule.solver.detail)


def test_a_contained_solve_answers_as_a_solve_in_this_process(cp_model):
    """Same model, parameters and seed: the same response as `CpSolver.Solve` here (plans stay
    deterministic), read back through the response's text."""
    def build():
        m = cp_model.CpModel()
        xs = [m.NewIntVar(0, 20, f"x{i}") for i in range(12)]
        bs = [m.NewBoolVar(f"b{i}") for i in range(12)]
        for x, b in zip(xs, bs):
            m.Add(x >= 5).OnlyEnforceIf(b)
        m.Add(sum(xs) <= 100)
        m.Maximize(sum((i % 5 + 1) * x for i, x in enumerate(xs)) - sum(bs))
        return m, xs, bs

    def configured():
        s = cp_model.CpSolver()
        s.parameters.num_workers = 1
        s.parameters.random_seed = 3
        s.parameters.max_deterministic_time = 1.0
        return s

    m, xs, bs = build()
    contained = sandbox.solve_contained(configured(), m)
    here = configured()
    status = here.Solve(m)
    assert contained.status == status and contained.status_name == here.StatusName(status)
    assert contained.objective_value == here.ObjectiveValue()
    assert contained.best_objective_bound == here.BestObjectiveBound()
    assert [contained.value(x) for x in xs] == [here.Value(x) for x in xs]
    assert [contained.boolean_value(b) for b in bs] == [here.BooleanValue(b) for b in bs]
    assert [contained.boolean_value(~b) for b in bs] == [not here.BooleanValue(b) for b in bs]


def test_the_layout_solver_falls_back_to_greedys_layout_on_a_crash(cp_model, monkeypatch):
    from schedc.layout import held_units, units_of
    from schedc.load import load_text
    from schedc.repartition import greedy_layout
    from schedc.solvers.partition_cpsat import solve_layout
    from test_partition_cpsat import GPT_350M

    spec = load_text(GPT_350M)
    units, held = units_of(spec), held_units(spec)
    live = [r for r in range(16) if r not in (3, 12)]
    speed = {r: 0.5 if r == 5 else 1.0 for r in live}
    monkeypatch.setattr(cp_model.CpSolver, "Solve", _abort_like_or_tools)
    found = solve_layout(units, 2, 7, 16, spec.cluster.gpu.memory, live, held, speed, time_limit=2.0,
                         horizon_iterations=100, bandwidth=spec.cluster.link.bandwidth)
    assert found.status == "fallback"
    assert found.layout == greedy_layout(units, 2, 7, 16, spec.cluster.gpu.memory, live, held, speed)


def test_schedc_compile_says_the_solver_crashed_and_writes_the_plan_found_before(tmp_path):
    script = f"""
import os, sys
from ortools.sat.python import cp_model
def abort(self, model, *a, **k):
    os.write(2, b"{CHECK_FAILED}\\n"); os.abort()
cp_model.CpSolver.Solve = abort
from schedc.cli import main
sys.exit(main(sys.argv[1:]))
"""
    spec = tmp_path / "s.sched"
    spec.write_text(spec_text(dp=3, pp=3, microbatches=4).replace("solver = greedy", "solver = cpsat")
                    + "failures { fail gpu(dp=0, pp=1) }\n")
    out = subprocess.run([sys.executable, "-c", script, "compile", str(spec), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    warning = [ln for ln in out.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "CP-SAT crashed (SIGABRT)" in warning[0] and CHECK_FAILED in warning[0], out.stderr
    assert "Traceback" not in out.stderr and "fallback" in out.stdout
    assert (tmp_path / "out" / "schedule.json").is_file()


@pytest.mark.e2e
def test_a_solver_crash_during_a_live_replan_does_not_end_the_run(tmp_path, cp_model, monkeypatch):
    """`schedc train`'s supervisor replans in its own process: an OR-Tools abort there would end
    the job with no log. The run goes on, exactly, on the plan found before the search."""
    from schedc.live import train

    out = tmp_path / "out"
    schedc.compile(spec_text(dp=3, pp=3, microbatches=4).replace("solver = greedy", "solver = cpsat")).write(out)
    monkeypatch.setattr(cp_model.CpSolver, "Solve", _abort_like_or_tools)
    # A deadline long enough that load never skips CP-SAT (which aborts at once here).
    result = train(out, iterations=6, inject=["at iteration 2: fail gpu(dp=0, pp=1)"], want_weights=True,
                   replan_deadline=60)
    (rec,) = result.recoveries
    assert rec.solver["status"] == "fallback"
    warnings = [e["message"] for e in result.events if e["kind"] == "warning"]
    assert any("CP-SAT crashed (SIGABRT)" in w for w in warnings), result.events
    check_exact(out, result, 6)
