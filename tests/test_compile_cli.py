"""`schedc.compile`, `Plan.write`, and the `schedc compile` / `schedc simulate` commands."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import schedc
import schedc.cli as cli
from schedc.diagnostics import SpecError
from schedc.plan import Plan, compile

SPEC = """
cluster { dp = 2  pp = 3  gpus_per_node = 8
          gpu { memory = 40GiB }  link { latency = 20us  bandwidth = 25GB/s } }
stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 0.2ms
               activation = 1GiB  stash = 256MiB  static = 4GiB  send = 16MiB } }
train { microbatches = 4 }
schedule { solver = "1f1b" }
"""


@pytest.fixture
def spec_path(tmp_path):
    p = tmp_path / "spec.sched"
    p.write_text(SPEC)
    return p


@pytest.fixture
def run_cli():
    return cli.main


def test_compile_returns_a_verified_plan(spec_path):
    plan = compile(spec_path)
    assert isinstance(plan, Plan) and plan.schedule.solver.name == "1f1b"
    m = plan.metrics
    # Fault-free, but 1F1B is not the best fault-free plan: its slowdown is measured against
    # greedy's, the one reference every solver's slowdown uses.
    assert (m.fault_free_solver, m.fault_free_iteration_time) == ("greedy", compile(spec_path, solver="greedy")
                                                                  .metrics.iteration_time)
    assert m.slowdown == m.iteration_time / m.fault_free_iteration_time > 1.0
    assert m.iteration_time >= m.lower_bound


def test_slowdown_has_one_reference_whatever_the_solver():
    """A faster plan never shows a larger slowdown than a slower one of the same spec."""
    spec = Path(__file__).resolve().parent.parent / "specs" / "example.sched"
    plans = {s: compile(spec, solver=s, time_limit=1) for s in ("greedy", "drop-pipeline", "reroute-1f1b")}
    refs = {p.metrics.fault_free_iteration_time for p in plans.values()}
    assert len(refs) == 1
    by_time = sorted(plans.values(), key=lambda p: p.metrics.iteration_time)
    assert [p.metrics.slowdown for p in by_time] == sorted(p.metrics.slowdown for p in by_time)


def test_unknown_solver_lists_known_names(spec_path):
    with pytest.raises(SpecError) as exc:
        compile(spec_path, solver="1f1c")
    d = exc.value.diagnostics[0]
    assert d.code == "E215" and "1f1b" in d.hint and "gpipe" in d.hint


def test_plan_write_files(spec_path, tmp_path):
    out = compile(spec_path).write(tmp_path / "out")
    names = sorted(p.name for p in out.iterdir())
    assert {"schedule.json", "trace.json", "timeline.svg", "pipeline_0.csv", "pipeline_1.csv"} <= set(names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left


def test_cli_compile_then_simulate(spec_path, tmp_path, run_cli, capsys):
    out = tmp_path / "out"
    assert run_cli(["compile", str(spec_path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "iteration time" in text and "ratio to lower bound" in text and "1f1b" in text
    assert run_cli(["simulate", str(out / "schedule.json"), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)["metrics"]
    stored = json.loads((out / "schedule.json").read_text())["metrics"]
    for key in ("iteration_time", "lower_bound", "bubble_ratio", "peak_memory", "fault_free_iteration_time"):
        assert simulated[key] == stored[key]


def test_cli_simulate_hand_edited_invalid_schedule(spec_path, tmp_path, run_cli, capsys):
    out = tmp_path / "out"
    assert run_cli(["compile", str(spec_path), "-o", str(out), "--json"]) == 0
    capsys.readouterr()
    path = out / "schedule.json"
    obj = json.loads(path.read_text())
    op = next(o for o in obj["ops"] if o["kind"] == "F" and o["pp"] == 1)
    op["start"] -= 1  # now before its input arrives, and 1 us too long
    path.write_text(json.dumps(obj))
    assert run_cli(["simulate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "error[E403]" in err and "<-- ERROR HERE" in err and "Traceback" not in err


def test_cli_simulate_malformed_file(tmp_path, run_cli, capsys):
    bad = tmp_path / "schedule.json"
    bad.write_text('{"format": "schedc.schedule/v1", "dp": "two"}')
    assert run_cli(["simulate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "error[E602]" in err and "$.dp" in err and "Traceback" not in err


def test_cli_compile_bad_spec(tmp_path, run_cli, capsys):
    bad = tmp_path / "bad.sched"
    bad.write_text("cluster { dp = 2 ")
    assert run_cli(["compile", str(bad), "-o", str(tmp_path / "o")]) == 1
    assert "error[E1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_compile_writes_runnable_programs_for_every_live_rank(tmp_path):
    plan = compile(Path(__file__).parents[1] / "specs" / "example.sched", solver="greedy")
    out = plan.write(tmp_path / "out")
    live = [g.rank for g in plan.schedule.instance.gpus if g.live]
    programs = sorted(p.name for p in out.glob("rank_*.py"))
    assert programs == [f"rank_{r:02d}.py" for r in live]  # the failed rank 6 gets no program
    assert (out / "main.py").exists() and (out / "programs.json").exists()
    # A recompile without the failure leaves no stale program behind and adds rank 6's.
    healthy = compile(plan.spec.without_failures(), solver="greedy")
    healthy.write(out)
    assert sorted(p.name for p in out.glob("rank_*.py")) == [f"rank_{r:02d}.py" for r in range(16)]


def test_a_redundant_plan_is_written_without_programs_and_run_says_why(spec_path, tmp_path, run_cli, capsys):
    """The `redundant` baseline (Bamboo) is a plan to compare against: its holders would run
    another stage's layers, so it gets schedule, timeline and trace but no programs, and
    `schedc run` on it explains that instead of saying "compile first"."""
    out = tmp_path / "bamboo"
    assert run_cli(["compile", str(spec_path), "--solver", "redundant", "-o", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"schedule.json", "timeline.svg", "trace.json", "spec.sched"} <= names
    assert not names & {"programs.json", "main.py"} and not any(n.startswith("rank_") for n in names)
    capsys.readouterr()
    assert run_cli(["run", str(out)]) != 0
    err = capsys.readouterr().err
    assert "E520" in err and "redundant" in err and "compile first" not in err
    assert run_cli(["train", str(out), "--emulate", "--iterations", "1"]) == 1  # (it was E000: a KeyError)
    err = capsys.readouterr().err
    assert "error[E520]: this plan is the `redundant` baseline" in err and "E000" not in err


def test_ordinary_bad_paths_and_numbers_are_diagnostics_not_internal_errors(spec_path, tmp_path, run_cli, capsys,
                                                                              monkeypatch):
    # (each was E000 with a Python exception's name: found by a newcomer's sweep)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert run_cli(["compile", str(spec_path), "-o", "."]) == 1
    assert "error[E558]: cannot write the plan to `.`: it is the folder you are in" in capsys.readouterr().err
    assert run_cli(["run", "afile"]) == 1
    assert "error[E520]: `afile` is a file, not a folder of compiled programs" in capsys.readouterr().err
    assert run_cli(["compile", str(spec_path), "-o", "out"]) == 0
    capsys.readouterr()
    for bad in ("inf", "nan", "1e300"):
        assert run_cli(["run", "out", "--timeout", bad]) == 1
        assert "error[E524]: --timeout must be a positive number of seconds" in capsys.readouterr().err
    for bad in ("0", "1000000001"):  # (a mistyped count is answered at once, not by a run that never ends)
        assert run_cli(["run", "out", "--iterations", bad]) == 1
        assert f"error[E524]: --iterations must be a whole number from 1 to 1,000,000,000, got {bad}" \
            in capsys.readouterr().err


def test_summary_shows_the_proven_bound(spec_path, tmp_path, run_cli, capsys):
    """Solvers that prove a bound (greedy, cpsat) show it and the plan's ratio to it; templates do not.
    The bound and `optimal` say which plans they hold among: a Bamboo-style plan (`redundant`) is
    outside them and can be faster."""
    from schedc.cli.simulate import summary_table

    plan = compile(spec_path, solver="greedy")
    text = summary_table(plan.metrics)
    bound = plan.schedule.solver.bound
    line = next(ln for ln in text.splitlines() if ln.startswith("proven bound"))
    assert bound and f"{bound / 1000:.3f} ms for re-routing plans" in line
    assert f"{plan.metrics.iteration_time / bound:.3f}x" in line
    assert plan.schedule.solver.status == "optimal"
    assert "status                     optimal among re-routing plans" in text.splitlines()
    assert "proven bound" not in summary_table(compile(spec_path, solver="1f1b").metrics)


@pytest.mark.parametrize("where, words", [
    ("file", "it is a file, not a directory"),
    ("under-a-file", "cannot write the plan to"),
])
def test_an_output_that_cannot_be_a_directory_is_a_diagnostic_before_the_solve(spec_path, tmp_path, run_cli,
                                                                                 capsys, where, words):
    afile = tmp_path / "taken"
    afile.write_text("keep me")
    out = afile if where == "file" else afile / "sub"
    assert run_cli(["compile", str(spec_path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error[E558]" in err and words in err and "E000" not in err
    assert afile.read_text() == "keep me" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("limit", ["-1", "0", "nan", "1e300", "inf"])
def test_a_time_limit_out_of_range_is_refused(spec_path, tmp_path, run_cli, capsys, limit):
    # (1e300: the spec's own `schedule.time_limit` stops at 1e6 s; the option took any size)
    assert run_cli(["compile", str(spec_path), "-o", str(tmp_path / "o"), "--time-limit", limit]) == 1
    err = capsys.readouterr().err
    assert "error[E206]" in err and "(at most 1e+06)" in err and not (tmp_path / "o").exists()


def test_a_nul_byte_is_spec_text_with_a_diagnostic_not_a_path():
    with pytest.raises(SpecError) as exc:
        schedc.load("\x00")
    assert exc.value.codes == ["E101"]


def _with_failure(failure: str) -> str:
    return SPEC.replace('schedule { solver = "1f1b" }', f"failures {{ {failure} }}\nschedule {{ solver = greedy }}")


def test_one_work_budget_covers_the_plan_and_its_fault_free_reference(monkeypatch):
    """A spec with a failed GPU: its plan gets 1 - REFERENCE_SHARE of `time_limit` and the
    fault-free reference the rest, so the whole compile spends one budget."""
    import schedc.plan as plan_module
    from schedc.solvers import get_solver

    given = []

    def spy(instance, options):
        given.append((instance.fault_free, options.time_limit))
        return get_solver("greedy")(instance, options)

    monkeypatch.setattr(plan_module, "_REFERENCES", {})
    monkeypatch.setattr(plan_module, "_solver", lambda spec, name: ("greedy", spy))
    compile(schedc.load(_with_failure("fail gpu(dp=1, pp=1)")), time_limit=2.0)
    share = plan_module.REFERENCE_SHARE
    assert given == [(False, pytest.approx(2.0 * (1 - share))), (True, pytest.approx(2.0 * share))]


def test_the_fault_free_reference_is_planned_once_for_every_failure_set(monkeypatch):
    """Every failure set of a spec has the same fault-free job: planned once per process, and
    what is kept is what planning it again gives (deterministic)."""
    import schedc.plan as plan_module

    monkeypatch.setattr(plan_module, "_REFERENCES", {})
    first = compile(schedc.load(_with_failure("fail gpu(dp=1, pp=1)")), time_limit=0.5)
    assert len(plan_module._REFERENCES) == 1
    calls = []
    real = plan_module.verify_schedule
    monkeypatch.setattr(plan_module, "verify_schedule", lambda s: calls.append(s.instance.fault_free) or real(s))
    second = compile(schedc.load(_with_failure("fail gpu(dp=0, pp=2)")), time_limit=0.5)
    assert calls == [False]  # its own plan only: the reference was not planned again
    assert second.metrics.fault_free_iteration_time == first.metrics.fault_free_iteration_time
    plan_module._REFERENCES.clear()
    again = compile(schedc.load(_with_failure("fail gpu(dp=0, pp=2)")), time_limit=0.5)
    assert (again.metrics.fault_free_iteration_time, again.metrics.fault_free_solver) == (
        second.metrics.fault_free_iteration_time, second.metrics.fault_free_solver)
    assert again.schedule.ops == second.schedule.ops


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_compile_output_folders_follow_the_umask(spec_path, tmp_path, umask):
    """`schedc compile -o OUT` (a process of its own, under `umask`) makes OUT as `mkdir` would:
    0777 less the umask, like its files (0666 less the umask), never 0700 whatever the umask."""
    import subprocess
    import sys

    out = tmp_path / "new" / "out"
    proc = subprocess.run([sys.executable, "-m", "schedc", "compile", str(spec_path), "-o", str(out)],
                          capture_output=True, text=True, preexec_fn=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stderr
    assert _mode(out) == 0o777 & ~umask
    assert _mode(out.parent) == 0o777 & ~umask  # (made by the command too)
    assert {_mode(f) for f in out.iterdir()} == {0o666 & ~umask}


def test_a_generation_folder_follows_the_umask_and_a_rewritten_folder_keeps_its_mode(spec_path, tmp_path):
    """`schedc train` writes OUT/live/gen-000N with `Plan.write(..., programs=...)`: the folder is
    made under the umask of the moment. Written again into a folder that exists, the folder keeps
    the mode its owner gave it."""
    plan = compile(spec_path)
    old = os.umask(0o002)
    try:
        gen = plan.write(tmp_path / "OUT" / "live" / "gen-0001", programs=plan.programs())
    finally:
        os.umask(old)
    assert _mode(gen) == 0o775 and _mode(gen / "schedule.json") == 0o664
    kept = tmp_path / "kept"
    kept.mkdir()
    kept.chmod(0o750)
    assert _mode(plan.write(kept)) == 0o750
