"""Runs of generated programs that must end: random verified schedules (deadlock
freedom), a killed peer (a clear error, no hang, no weights), and timing."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from schedc.codegen import write_programs
from schedc.diagnostics import InfeasibleError, RunError
from schedc.instance import make_instance
from schedc.runtime.launcher import Launch, launch
from strategies import instances
from test_runtime_support import schedule_for, spec_for

pytestmark = pytest.mark.e2e


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(inst=instances(max_dp=3, max_pp=3, max_microbatches=4),
       solver=st.sampled_from(["greedy", "cpsat", "1f1b", "zb-h1", "gpipe"]))
def test_random_verified_schedules_run_to_the_end(tmp_path_factory, inst, solver):
    """Every verified schedule's programs complete in --emulate mode (real gloo messages, tags, groups)."""
    try:
        sched = schedule_for(inst, solver)
    except InfeasibleError:
        assume(False)
    from schedc.verify import verify_schedule

    verify_schedule(sched)
    out = tmp_path_factory.mktemp("prog")
    write_programs(spec_for(inst), sched, out)
    result = launch(out, iterations=2, emulate=True, timeout=20)
    assert [r.iteration for r in result.iterations] == [0, 1]


def test_a_killed_peer_gives_a_clear_error_and_no_weights(tmp_path):
    """Kill one rank mid-run: the others stop within the timeout, naming it and what they waited for."""
    inst = make_instance(2, 2, 4, failed=[(1, 0)])
    write_programs(spec_for(inst), schedule_for(inst, "greedy"), tmp_path)
    run = Launch(tmp_path, iterations=400, timeout=5, want_weights=True)
    victim = 1  # GPU (0, 1): every other rank trades activations or gradients with it
    killed_at = []

    def kill_after_first(rep):
        if not killed_at:
            run.processes[victim].kill()
            killed_at.append(rep)

    try:
        with pytest.raises(RunError) as exc:
            run.wait(kill_after_first)
    finally:
        run.kill()
    # No hang: run.wait returned, with survivors naming the dead peer (their recv failed) rather
    # than a wait that ran out. How fast is a latency figure, which load stretches.
    assert killed_at, "the run ended before the kill"
    text = exc.value.render()
    assert "rank 1 died (killed by SIGKILL)" in text
    assert "from rank 1" in text  # a survivor names the dead peer and the message it waited for
    assert any(code == "E530" for code in exc.value.codes)


def test_schedc_run_with_a_rank_killed_mid_run_fails_clearly_and_saves_nothing(tmp_path):
    """The CLI end to end: a rank dies in iteration 1; exit 1, E531 naming it, and no weights file."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    inst = make_instance(2, 2, 2)
    spec = spec_for(inst, data="test_runtime_support:batch_that_kills_its_rank")
    write_programs(spec, schedule_for(inst, "greedy"), tmp_path / "out")
    weights = tmp_path / "w.pt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # (a hang is subprocess.run's TimeoutExpired)
    proc = subprocess.run([sys.executable, "-m", "schedc", "run", str(tmp_path / "out"), "--iterations", "3",
                           "--timeout", "5", "--save-weights", str(weights)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "iteration 1:" not in proc.stdout  # (iteration 0 may be unreported: the dead rank's last report can die with it)
    assert "error[E531]: rank 2 died (killed by SIGKILL)" in proc.stderr  # GPU (1, 0) runs d1 stage 0
    assert "from rank 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not weights.exists() and not list(tmp_path.glob(".w.pt*"))


def test_a_rank_that_fails_at_its_start_is_named_first_and_the_others_are_stopped(tmp_path):
    """A rank without its program fails as it starts; the others wait in the rendezvous. They were
    left to wait out their whole timeout (60 s), then three store time-outs (E590) buried the
    cause. Now its error comes first, and the others are stopped once it failed (E532)."""
    inst = make_instance(2, 2, 2)
    write_programs(spec_for(inst), schedule_for(inst, "greedy"), tmp_path)
    (tmp_path / "rank_01.py").unlink()
    with pytest.raises(RunError) as exc:
        Launch(tmp_path, iterations=1, timeout=60).wait()
    diags = exc.value.diagnostics
    assert diags[0].code == "E522" and "rank 1" in diags[0].message, exc.value.render()
    assert [d.code for d in diags[1:]] == ["E532"] * 3, exc.value.render()
    assert all("s after rank(s) [1] failed: it had not ended by itself" in d.message for d in diags[1:])


def test_a_stuck_peer_times_out_with_the_op_waited_for(tmp_path):
    """A stopped (not dead) peer: survivors wait exactly their timeout, then name it; no hang."""
    import os
    import signal

    inst = make_instance(2, 2, 4, failed=[(1, 0)])
    write_programs(spec_for(inst), schedule_for(inst, "greedy"), tmp_path)
    run = Launch(tmp_path, iterations=400, timeout=2)

    def stop_after_first(rep):
        if rep.iteration == 0:
            os.kill(run.processes[1].pid, signal.SIGSTOP)

    try:
        with pytest.raises(RunError) as exc:
            run.wait(stop_after_first)
    finally:
        run.kill()
    # No hang: run.wait returned, and rank 0 says it gave up after its 2 s timeout (below), which
    # is what the test is about; the wall time around it is load's to stretch.
    text = exc.value.render()
    # Which message rank 0 waits for depends on where SIGSTOP caught rank 1; that it names the
    # stuck peer, the timeout and an op in torch notation does not.
    assert re.search(r"rank 0 waited 2 s for the (activation|output gradient) of d\d:\d[FB]\d+ from rank 1",
                     text), text
    assert re.search(r"rank 1 was stopped \d+ s after rank\(s\) \[[\d, ]+\] failed: it had not ended by itself",
                     text), text


def test_a_wrong_process_count_or_missing_program_is_a_diagnostic(tmp_path):
    inst = make_instance(1, 2, 2)
    write_programs(spec_for(inst), schedule_for(inst, "test-list"), tmp_path)
    (tmp_path / "rank_01.py").unlink()
    with pytest.raises(RunError) as exc:
        launch(tmp_path, iterations=1, emulate=True, timeout=2)
    assert "E522" in exc.value.codes


def test_emulated_timing_follows_the_simulator():
    """Emulated ops take their planned time: the measured steady period is not far below the
    simulator's (a loaded machine can only make it longer). How close it comes, above, is what
    bench/emulate_timing.py reports (target: within 10%); load stretches it, so no upper bound here."""
    from bench.emulate_timing import measure

    report = measure(iterations=8, scale_ms=8.0)
    assert report["ratio"] >= 0.5, report
