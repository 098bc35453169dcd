"""`schedc train` and `schedc agent` as a user meets them: bad input, Ctrl-C, a bug in the
user's code, a rank stuck in compute, and two agents (hosts) coordinating through the store."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import schedc
from live_data import STUCK_MARKER
from live_support import WAIT_S, check_exact, children_of, compiled, session_members, spec_text, wait_until
from schedc.live import TrainError, train
from test_runtime_support import max_weight_diff

pytestmark = pytest.mark.e2e
TESTS = Path(__file__).parent


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _schedc(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "schedc", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)


def _descendants_of_session(sid: int) -> list[str]:
    """Live processes of a session (zombies are dead already; PID 1 reaps them)."""
    out = subprocess.run(["ps", "-eo", "sid=,stat=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split() and line.split()[0] == str(sid) and not line.split()[1].startswith("Z")]


@pytest.mark.parametrize("args, code, words", [
    (["train", "{tmp}/nope"], "E550", "does not exist: it is not a compiled plan"),
    (["train", "{out}", "--inject", "at iteration 1: fail gpu(dp=7, pp=0)"], "E207", "there is no GPU (dp=7, pp=0)"),
    (["train", "{out}", "--inject", "at iteration 9: fail rank 0"], "E562", "iteration 9 is never reached"),
    (["train", "{out}", "--inject", "at iteration -1: fail rank 0"], "E560", "a whole number from 0 to 999,999,999"),
    (["train", "{out}", "--inject", "at 1e300s: fail rank 0"], "E560", "must be from 0 to 1,000,000 s after the start"),
    (["train", "{out}", "--save-weights", "{tmp}/no/such/dir/w.pt"], "E558", "which does not exist"),
    # (as root the permissions say "writable": only creating a file there tells)
    (["train", "{out}", "--log", "/proc/x.json"], "E558", "no file can be created in `/proc`"),
    (["train", "{out}", "--save-weights", "/proc/w.pt"], "E558", "no file can be created in `/proc`"),
    (["train", "{out}", "--iterations", "0"], "E555", "iterations must be a whole number from 1 to 1,000,000,000, got 0"),
    (["train", "{out}", "--iterations", "10000000000"], "E555", "from 1 to 1,000,000,000, got 10000000000"),
    (["train", "{out}", "--recovery", "restart"], "E555", "give --checkpoint-every K"),
    (["train", "{out}", "--resume"], "E556", "no complete checkpoint"),
    (["agent", "--store", "nowhere", "--host", "1"], "E557", "is not HOST:PORT"),
    (["agent", "--store", "127.0.0.1:99999", "--host", "1"], "E557", "is not HOST:PORT"),
    (["rejoin", "--store", "127.0.0.1:1", "--timeout", "nan", "recover gpu(dp=1, pp=0)"], "E557",
     "--timeout must be a positive number"),
    (["rejoin", "--store", "127.0.0.1:1", "--timeout", "-1", "recover gpu(dp=1, pp=0)"], "E557",
     "--timeout must be a positive number"),
    (["rejoin", "--store", "127.0.0.1:1", "fail gpu(dp=1, pp=0)"], "E557", "is not one `recover gpu"),
    (["rejoin", "--store", "127.0.0.1:1", ""], "E557", "no event given: rejoin takes one `recover gpu"),
    (["agent", "--store", "127.0.0.1:1", "--host", "1", "--timeout", "1e300"], "E557", "(at most 1e+06), got 1e+300"),
    (["train", "{out}", "--hosts", "3"], "E555", "--hosts 3 is more than the job's 2 node(s)"),
    (["train", "{out}", "--store-port", "70000"], "E555", "store-port must be a TCP port"),
    (["train", "{out}", "--transition-timeout", "1e300"], "E555", "(at most 1e+06), got 1e+300"),
    (["train", "{out}", "--save-weights", ""], "E558", "--save-weights was given an empty file name"),
    (["train", "{out}", "--log", ""], "E558", "--log was given an empty file name"),
])
def test_bad_input_is_a_diagnostic_not_a_traceback(tmp_path, args, code, words):
    out = compiled(tmp_path)
    proc = _schedc(*[a.format(tmp=tmp_path, out=out) for a in args])
    assert proc.returncode == 1, proc.stderr
    assert f"error[{code}]" in proc.stderr and words in proc.stderr, proc.stderr
    assert (proc.stdout + proc.stderr).count(words) == 1, (proc.stdout, proc.stderr)  # said once, not twice
    assert "Traceback" not in proc.stderr
    assert not (out / "live").exists()  # nothing ran


def test_a_busy_store_port_is_a_diagnostic(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        proc = _schedc("train", str(compiled(tmp_path)), "--store-port", str(busy.getsockname()[1]))
    assert proc.returncode == 1 and "error[E557]" in proc.stderr and "cannot serve the run's store" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_fresh_run_does_not_write_among_an_earlier_runs_checkpoints(tmp_path):
    out = compiled(tmp_path)
    train(out, iterations=2, checkpoint_every=1)
    with pytest.raises(schedc.RunError) as exc:
        train(out, iterations=3, checkpoint_every=1)
    assert exc.value.codes == ["E556"] and "earlier run" in exc.value.render()
    assert [r.iteration for r in train(out, iterations=3, checkpoint_every=1, resume=True).iterations] == [2]


def test_resume_passes_over_a_damaged_checkpoint_with_a_warning_and_refuses_when_none_is_left(tmp_path):
    """A corrupt meta.json made --resume start from the checkpoint before it without a word."""
    out = compiled(tmp_path)
    train(out, iterations=2, checkpoint_every=1, emulate=True)
    (out / "checkpoints" / "iter-000002" / "meta.json").write_text("{")
    proc = _schedc("train", str(out), "--iterations", "3", "--resume", "--emulate")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "warning" in line]
    assert len(warnings) == 1, proc.stdout
    assert f"] warning: skipped checkpoint `{out / 'checkpoints' / 'iter-000002'}`: its meta.json is not valid JSON (" \
        in warnings[0] and warnings[0].endswith("); resuming from the older `iter-000001`"), warnings
    assert "4 ranks running from iteration 1" in proc.stdout
    (out / "checkpoints" / "iter-000001" / "meta.json").write_text("{")
    proc = _schedc("train", str(out), "--iterations", "3", "--resume", "--emulate")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error[E570]: no checkpoint in `{out / 'checkpoints'}` can be resumed: 2 damaged "
                                  "one(s), none complete\n  = note: skipped `iter-000001`: its meta.json"), proc.stderr


def test_an_injection_error_shows_the_injection_with_a_caret(tmp_path):
    proc = _schedc("train", str(compiled(tmp_path)), "--inject", "at iteraton 1: fail rank 0")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[:5] == [
        "error[E560]: unknown moment `iteraton`",
        " --> <inject 1>:1:4",
        "  |",
        "1 | at iteraton 1: fail rank 0",
        "  |    ^^^^^^^^ did you mean `iteration`?",
    ]


def test_train_prints_progress_saves_weights_and_a_log(tmp_path):
    out = compiled(tmp_path, model="mlp", optimizer="adam")
    proc = _schedc("train", str(out), "--iterations", "4", "--inject",
                   "at iteration 1 during B: fail gpu(dp=1, pp=0)", "--save-weights", str(tmp_path / "w.pt"),
                   "--log", str(tmp_path / "log.json"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("rank 2 GPU (dp=1, pp=0) failed: killed by SIGKILL" in ln for ln in lines)
    assert any(ln.startswith("iteration    3  loss") and ln.endswith("gen 1") for ln in lines)
    assert any(ln.startswith("recovery 1 (reroute, rank(s) [2]): detected") for ln in lines)
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["format"] == "schedc.trainlog/v1" and log["ok"]
    assert [g["number"] for g in log["generations"]] == [0, 1] and log["generations"][1]["plan_dir"]
    rec = log["recoveries"][0]
    assert rec["failed"] == [2] and rec["durations_s"]["first_iteration"] > 0
    assert (out / "live" / "gen-0001" / "schedule.json").is_file()  # the new plan, for the record
    import torch

    from schedc.runtime import load_manifest, reference_train

    ref, _ = reference_train(load_manifest(out), 4)
    assert max_weight_diff(torch.load(tmp_path / "w.pt", weights_only=True), ref) <= 1e-5


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default action, even when this test runs as a shell's
    background job (which starts with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_worker_and_leaves_nothing_half_written(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, in the middle of a run
    that writes a checkpoint every iteration."""
    from schedc.live.membership import ORPHAN_TIMEOUT

    out = compiled(tmp_path, forward="20ms")
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as o, stderr.open("w") as e:  # files: read while it runs, no pipe to block on
        proc = subprocess.Popen([sys.executable, "-m", "schedc", "train", str(out), "--iterations", "1000",
                                 "--checkpoint-every", "1", "--log", str(tmp_path / "log.json")],
                                stdout=o, stderr=e, text=True, env=_env(),
                                start_new_session=True, preexec_fn=_sigint_default)
    try:
        # Mid-run: iteration 3's progress line is out (workers up, checkpoints being written).
        wait_until(lambda: "iteration    3" in stdout.read_text() or proc.poll() is not None,
                   "the progress line of iteration 3")
        assert proc.poll() is None, f"the run ended before Ctrl-C: {stderr.read_text()}"
        assert _descendants_of_session(proc.pid), "no workers were running"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = stderr.read_text()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    # No orphan: workers and the forkserver are gone soon after the supervisor. Waited for, as
    # their exits are not instant, but for less than a worker cut off from its supervisor takes
    # to leave on its own (ORPHAN_TIMEOUT), so that only the supervisor stopping them passes.
    wait_until(lambda: _descendants_of_session(proc.pid) == [], "every process of the run's session to exit",
               timeout=ORPHAN_TIMEOUT / 2, state=lambda: _descendants_of_session(proc.pid))
    ckpt = out / "checkpoints"
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    assert all((p / "meta.json").is_file() for p in ckpt.iterdir() if p.name.startswith("iter-"))
    log = json.loads((tmp_path / "log.json").read_text())
    assert not log["ok"] and log["error"][0]["code"] == "E559"


def test_a_bug_in_the_users_code_stops_the_run_with_its_location(tmp_path):
    out = compiled(tmp_path, data="live_data:batch_with_a_bug")
    with pytest.raises(TrainError) as exc:
        train(out, iterations=3)
    text = exc.value.render()
    assert "error[E551]" in text and "not a hardware failure" in text
    assert "ValueError: shard 17 is missing (at live_data.py:" in text
    assert exc.value.result.recoveries == []  # nothing was routed around a bug


def test_a_rank_stuck_in_compute_is_fenced_and_routed_around(tmp_path):
    STUCK_MARKER.unlink(missing_ok=True)
    out = compiled(tmp_path, data="live_data:batch_stuck_once", optimizer="adam")
    try:
        result = train(out, iterations=4, want_weights=True, stall_timeout=2.0)
        check_exact(out, result, 4)  # (the marker exists: the reference training does not get stuck)
    finally:
        STUCK_MARKER.unlink(missing_ok=True)
    (rec,) = result.recoveries
    (cause,) = rec.causes.values()
    assert "stuck in an op" in cause


def test_two_agents_coordinate_through_the_store_and_survive_a_whole_host(tmp_path):
    """The supervisor with host 0's agent, and `schedc agent` for host 1 (node 1 = pipeline 1):
    host 1's node dies; its agent reports it through the store; the run ends exact."""
    from schedc.runtime.launcher import free_port

    out = compiled(tmp_path, model="gpt", optimizer="adam")
    port = free_port()
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as o, stderr.open("w") as e:
        sup = subprocess.Popen([sys.executable, "-m", "schedc", "train", str(out), "--iterations", "4", "--hosts",
                                "2", "--store-port", str(port), "--save-weights", str(tmp_path / "w.pt"),
                                "--inject", "at iteration 1 during B: fail node 1"],
                               stdout=o, stderr=e, text=True, env=_env())
    agent = None
    try:
        # As a user would: start the agent once the supervisor says it waits for agents.
        wait_until(lambda: "schedc agent --store" in stdout.read_text() or sup.poll() is not None,
                   "the supervisor to wait for agents", state=stderr.read_text)
        with (tmp_path / "agent.txt").open("w") as e:  # (a pipe would be held open by what outlives the agent)
            agent = subprocess.Popen([sys.executable, "-m", "schedc", "agent", "--store", f"127.0.0.1:{port}",
                                      "--host", "1"], stdout=e, stderr=e, env=_env(), start_new_session=True)
        agent.wait(timeout=120)
        # The agent has exited: its forkserver and workers have ended before it (no wait here;
        # multiprocessing's resource tracker ends by itself once the agent's pipe to it is closed).
        left = session_members(agent.pid, "multiprocessing.forkserver")  # it and what it forked
        wait_until(lambda: not _descendants_of_session(agent.pid), "every process of the agent's session to end",
                   state=lambda: _descendants_of_session(agent.pid))
        sup.wait(timeout=WAIT_S)
    finally:
        if sup.poll() is None:
            sup.kill()
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    stdout, stderr = stdout.read_text(), stderr.read_text()
    assert agent.returncode == 0, (tmp_path / "agent.txt").read_text()
    assert left == [], f"the agent's processes still ran after it exited: {left}"
    assert sup.returncode == 0, stderr
    # The node is named when all its ranks are seen dead at once; under heavy load their deaths may
    # reach the supervisor in two batches (a GPU of node 1 first, then the other, one generation
    # later), each replan naming its GPU, as in test_live_exactness's node case: the run must end
    # on the 2 ranks of host 0 either way.
    replans = re.findall(r"replan: (.*) -> generation (\d+), (\d+) ranks", stdout)
    named = sorted(ev for r in replans for ev in r[0].split("; "))
    assert named in (["fail node 1"], ["fail gpu(dp=1, pp=0)", "fail gpu(dp=1, pp=1)"]), stdout
    assert replans[-1][2] == "2", stdout
    import torch

    from schedc.runtime import load_manifest, reference_train

    ref, _ = reference_train(load_manifest(out), 4)
    assert max_weight_diff(torch.load(tmp_path / "w.pt", weights_only=True), ref) <= 1e-5


def test_a_timed_injection_fires_by_the_clock(tmp_path):
    # --emulate: ops take their planned time (iterations of about 0.1 s here), so 0.4 s is early in
    # a run of 40 (about 4 s: on a loaded machine a run of 10 could end before the clock fired it).
    out = compiled(tmp_path, forward="20ms")
    result = train(out, iterations=40, emulate=True, inject=["at 0.4s: fail gpu(dp=1, pp=0)"])
    assert [r.iteration for r in result.iterations] == list(range(40))
    (rec,) = result.recoveries
    started = next(e["t"] for e in result.events if e["kind"] == "running")
    # By the clock: never before its time (load can only make it later). How soon after its
    # time it fires is a latency, which load stretches; not asserted. That it fired mid-run is:
    # the run went on under the new plan.
    assert rec.failed == [2] and rec.t_fault - started >= 0.4
    assert rec.t_first is not None and rec.t_first > rec.t_fault


def test_resuming_a_checkpoint_of_another_kind_of_run_is_a_diagnostic(tmp_path):
    out = compiled(tmp_path)
    train(out, iterations=2, checkpoint_every=1, emulate=True)
    with pytest.raises(TrainError) as exc:
        train(out, iterations=3, resume=True)
    assert exc.value.codes == ["E570"] and "emulate" in exc.value.render()


def test_an_unwritable_checkpoint_directory_is_refused_before_the_run(tmp_path):
    out = compiled(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainError) as exc:
        train(out, iterations=2, checkpoint_every=1, checkpoint_dir=str(tmp_path / "file" / "ckpt"))
    assert exc.value.codes == ["E558"]


def _failed_lines(stdout: str) -> list[str]:
    return [ln.split("] ", 1)[-1] for ln in stdout.splitlines() if " failed: " in ln]


def _train_in_background(tmp_path, *args):
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as o, stderr.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "schedc", "train", *map(str, args)], stdout=o, stderr=e,
                                text=True, env=_env(), start_new_session=True)
    return proc, stdout, stderr


def test_a_killed_forkserver_and_resource_tracker_are_no_ranks_death_and_are_replaced(tmp_path):
    """SIGKILL to the forkserver that forked every rank, and to multiprocessing's resource
    tracker, mid-run: no rank is reported dead (each is watched by itself, not through the
    forkserver's pipe); a rank killed afterwards is reported with its own status (the orphan is
    waited for by the supervisor); the rank taken back later starts from a new forkserver,
    said in one line, and the run ends."""
    out = compiled(tmp_path, forward="20ms")  # --emulate: iterations of about 0.1 s, so the kill is mid-run
    proc, stdout, stderr = _train_in_background(
        tmp_path, out, "--emulate", "--iterations", "40", "--inject", "at iteration 15: fail gpu(dp=1, pp=1)",
        "--inject", "at iteration 22: recover gpu(dp=1, pp=1)")
    try:
        wait_until(lambda: "iteration    0" in stdout.read_text() or proc.poll() is not None,
                   "the first iteration's line", state=stderr.read_text)
        assert proc.poll() is None, stderr.read_text()
        (server,) = children_of(proc.pid, "multiprocessing.forkserver")
        (tracker,) = children_of(proc.pid, "multiprocessing.resource_tracker")
        os.kill(server, signal.SIGKILL)
        os.kill(tracker, signal.SIGKILL)
        assert "injected" not in stdout.read_text(), "the injections came before the kills: the test proves nothing"
        proc.wait(timeout=2 * WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out_text, err = stdout.read_text(), stderr.read_text()
    assert proc.returncode == 0, err
    assert _failed_lines(out_text) == ["rank 3 GPU (dp=1, pp=1) failed: killed by SIGKILL"], out_text
    assert "40 iterations done" in out_text and "taking GPU (dp=1, pp=1) (rank 3) back" in out_text
    notes = [ln for ln in err.splitlines() if ln.startswith("host 0: ")]
    assert notes == ["host 0: the multiprocessing resource tracker had ended; started a new one",
                     f"host 0: the forkserver (pid {server}) had ended; started a new one "
                     f"(pid {_new_pid(notes[-1])}) to start rank 3"], err


def _new_pid(line: str) -> str:
    return re.search(r"a new one \(pid (\d+)\)", line).group(1) if "a new one (pid" in line else "?"


def test_a_forkserver_killed_while_it_starts_is_replaced(tmp_path):
    """Killed while it imports torch, before any rank runs: the ranks start from a new one."""
    proc, stdout, stderr = _train_in_background(tmp_path, compiled(tmp_path), "--iterations", "3")
    try:
        server = wait_until(lambda: children_of(proc.pid, "multiprocessing.forkserver") or proc.poll() is not None,
                            "the forkserver to start", poll=0.002)
        assert proc.poll() is None and "generation 0" not in stdout.read_text()
        os.kill(server[0], signal.SIGKILL)
        proc.wait(timeout=2 * WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out_text, err = stdout.read_text(), stderr.read_text()
    assert proc.returncode == 0, err
    assert "3 iterations done" in out_text and _failed_lines(out_text) == [], out_text
    assert "error[" not in err and f"host 0: the forkserver (pid {server[0]}) had ended; started a new one" in err


@pytest.mark.parametrize("args", [["rejoin", "--store", "127.0.0.1:1", "recover gpu(dp=0, pp=0)", "--timeout", "1"],
                                  ["agent", "--store", "127.0.0.1:1", "--host", "1", "--timeout", "1"]])
def test_an_unreachable_store_is_the_diagnostic_alone(args):
    """torch's C++ logs each failed try with its whole C++ stack ("frame #0: c10::Error..."):
    only E557 and its hint are shown."""
    proc = _schedc(*args)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error[E557]: cannot reach the run's store at 127.0.0.1:1")
    assert lines[1].startswith("  = hint: "), proc.stderr


def test_the_command_e553_names_resumes_the_run(tmp_path):
    """A stage lost with no restart left: the hint's command, run as it is, resumes from the run's
    own checkpoint folder (it named `schedc train OUT --resume`, which found none there: E556)."""
    import shlex

    out = compiled(tmp_path, iterations=8)  # (the spec's count: the supervisor does not tell E553 an --iterations)
    with pytest.raises(TrainError) as exc:
        train(out, checkpoint_every=1, checkpoint_dir=str(tmp_path / "my checkpoints"),
              max_restarts=0, inject=["at iteration 3: fail gpu(dp=0, pp=0)", "at iteration 3: fail gpu(dp=1, pp=0)"])
    first = exc.value.diagnostics[0]
    assert first.code == "E553", exc.value.render()
    words = shlex.split(re.search(r"with `(schedc train [^`]*)`", first.hint).group(1))
    assert "--checkpoint-dir" in words, first.hint
    proc = _schedc(*words[1:])
    assert proc.returncode == 0, proc.stderr
    assert "8 iterations done" in proc.stdout, proc.stdout


@pytest.mark.parametrize("solver, loads", [("cpsat", True), ("greedy", False)])
def test_a_cpsat_plans_run_loads_or_tools_at_start_up_so_its_replans_can_use_it(tmp_path, solver, loads):
    """OR-Tools' import does not fit a replan's deadline; `train` loads it while the workers start
    (on a thread of its own), for plans whose replans use CP-SAT, and only for those."""
    out = tmp_path / "out"
    schedc.compile(spec_text().replace("solver = greedy", f"solver = {solver}")).write(out)
    code = ("import sys, threading\n"
            "from schedc.live import train\n"
            f"train({str(out)!r}, iterations=2, emulate=True)\n"
            "for t in threading.enumerate():\n"
            "    if t.name == 'schedc-ortools-warm-up':\n"
            f"        t.join({WAIT_S})\n"
            "from schedc.solvers import cpsat\n"
            "print('loaded', cpsat.loaded())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"loaded {loads}"
