"""`schedc train --hosts 2` when hosts go: a re-partitioned layout's ranks start on their GPUs'
hosts, and a host taken back with every GPU of a stage (its agent, forkserver and workers killed
at once, as when a spot instance is reclaimed) is re-partitioned around by `--recovery auto`,
with `--shadow` losing no work. Each run is checked against single-process training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import schedc
from live_support import WAIT_S, spec_text, wait_until
from schedc.runtime import load_manifest, reference_train
from test_runtime_support import max_weight_diff

pytestmark = pytest.mark.e2e
TESTS = Path(__file__).parent
#: A heartbeat silence this long, not the default 3 s, counts as a hang, so that a loaded machine's
#: pauses (seen: 3.1 s on a host-1 worker beside two busy loops) do not change the scenario: for the
#: runs whose GPUs die by injection (their agent reports each exit at once), and for the host taken
#: away (found by the silence and the survivors' lost connections), where a false hang of a host-1
#: worker before the kill once started a fifth process, a rejoin of that GPU.
PATIENT = ["--detect-timeout", "15"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _two_hosts(tmp_path: Path, out: Path, args: list[str], *, kill_host_after: str | None = None,
               replace_agent_after: str | None = None):
    """`schedc train OUT --hosts 2 ARGS` with `schedc agent --host 1` beside it, in its own session.
    With `kill_host_after`, host 1 is taken away (SIGKILL to every process of the agent's session)
    once that text is printed; with `replace_agent_after`, only its agent is killed then and another
    started (output in agent-2.txt). Returns (supervisor's returncode, stdout, stderr, the run log)."""
    from schedc.runtime.launcher import free_port

    port = free_port()
    stdout, stderr, log = tmp_path / "stdout.txt", tmp_path / "stderr.txt", tmp_path / "log.json"
    with stdout.open("w") as o, stderr.open("w") as e:
        sup = subprocess.Popen([sys.executable, "-m", "schedc", "train", str(out), "--hosts", "2", "--store-port",
                                str(port), "--log", str(log), *args], stdout=o, stderr=e, text=True, env=_env())
    agent = second = None
    try:
        wait_until(lambda: "schedc agent --store" in stdout.read_text() or sup.poll() is not None,
                   "the supervisor to wait for agents", state=stderr.read_text)
        with (tmp_path / "agent.txt").open("w") as e:
            agent = subprocess.Popen([sys.executable, "-m", "schedc", "agent", "--store", f"127.0.0.1:{port}",
                                      "--host", "1"], stdout=e, stderr=e, env=_env(), start_new_session=True)
        if kill_host_after is not None:
            wait_until(lambda: kill_host_after in stdout.read_text() or sup.poll() is not None,
                       f"`{kill_host_after}` to be printed", state=stdout.read_text)
            os.killpg(agent.pid, signal.SIGKILL)  # the host is gone: its agent, forkserver and workers
        if replace_agent_after is not None:
            wait_until(lambda: replace_agent_after in stdout.read_text() or sup.poll() is not None,
                       f"`{replace_agent_after}` to be printed", state=stdout.read_text)
            os.kill(agent.pid, signal.SIGKILL)  # the agent alone: its workers live on
            agent.wait(timeout=WAIT_S)
            with (tmp_path / "agent-2.txt").open("w") as e:
                second = subprocess.Popen([sys.executable, "-m", "schedc", "agent", "--store", f"127.0.0.1:{port}",
                                           "--host", "1"], stdout=e, stderr=e, env=_env(), start_new_session=True)
        sup.wait(timeout=WAIT_S * 2)
    finally:
        if sup.poll() is None:
            sup.kill()
        for a in (agent, second):
            if a is None:
                continue
            try:
                os.killpg(a.pid, signal.SIGKILL)  # (what is left of the agent's session)
            except ProcessLookupError:
                pass
            a.wait(timeout=WAIT_S)
    return sup.returncode, stdout.read_text(), stderr.read_text(), json.loads(log.read_text())


def _exact(out: Path, weights: Path, iterations: int) -> None:
    ref, _ = reference_train(load_manifest(out), iterations)
    import torch

    diff = max_weight_diff(torch.load(weights, weights_only=True), ref)
    assert diff <= 1e-5, f"max abs weight difference {diff:.3g}"


def test_survivors_on_both_hosts_move_their_layers_in_place_and_keep_their_processes(tmp_path):
    """2 x 3, a pipeline per host, `--shadow`: both GPUs of stage 1 (one per host) are killed. The
    four survivors, two on each host, keep their processes: renamed as the 2 x 2 layout's ranks
    (host 1's agent renames its two), they move the layers among themselves over gloo; a GPU of
    host 1 killed afterwards is found by its new rank (its agent reports the exit so)."""
    out = tmp_path / "out"
    schedc.compile(spec_text(dp=2, pp=3, optimizer="adam")).write(out)
    code, stdout, stderr, run_log = _two_hosts(tmp_path, out, PATIENT + [
        "--iterations", "7", "--recovery", "repartition", "--shadow", "--save-weights", str(tmp_path / "w.pt"),
        "--inject", "at iteration 2 during B: fail gpu(dp=0, pp=1)",
        "--inject", "at iteration 2 during B: fail gpu(dp=1, pp=1)",
        "--inject", "at iteration 5 during F: fail rank 3"])
    assert code == 0, stderr + stdout
    _exact(out, tmp_path / "w.pt", 7)
    kinds = [(e["kind"], e["message"]) for e in run_log["events"]]
    assert any(k == "repartition" and "move the layers among themselves" in m for k, m in kinds), kinds
    assert len([e for e in run_log["events"] if e["kind"] == "started"]) == 6, kinds  # none restarted
    # After the move, rank 3 (an injection names a rank of the layout that runs) is GPU (dp=1, pp=1)
    # of the 2 x 2 layout, a survivor of host 1 (GPUs 3-5 are host 1's): its agent, renamed, kills it.
    (layout,) = [e["layout"] for e in run_log["events"] if e["kind"] == "repartition"]
    assert [g for row in layout["gpus"] for g in row][3] >= 3, layout
    failures = [e for e in run_log["events"] if e["kind"] == "failure"]
    assert failures[-1]["rank"] == 3 and "SIGKILL" in failures[-1]["message"], failures
    assert len(run_log["generations"][-1]["members"]) == 3, run_log["generations"][-1]


def test_a_re_partitioned_job_restores_in_place_on_both_hosts_and_grows_back_onto_each_gpus_host(tmp_path):
    """2 x 3, a pipeline per host; both GPUs of stage 1 (one per host) are killed. Without shadows
    the four survivors, two on each host, keep their processes (renamed as the 2 x 2 layout's
    ranks; host 1's agent renames its two) and restore the latest checkpoint re-sharded. Both GPUs
    are asked back: the job grows onto 2 x 3 in place, and the process of each GPU back starts on
    that GPU's host (GPU 1 on host 0, GPU 4 on host 1: GPUs 0-2 are host 0's, 3-5 host 1's)."""
    out = tmp_path / "out"
    schedc.compile(spec_text(dp=2, pp=3, optimizer="adam")).write(out)
    code, stdout, stderr, run_log = _two_hosts(tmp_path, out, PATIENT + [
        "--iterations", "8", "--recovery", "repartition", "--checkpoint-every", "1", "--save-weights",
        str(tmp_path / "w.pt"), "--inject", "at iteration 2 during B: fail gpu(dp=0, pp=1)",
        "--inject", "at iteration 2 during B: fail gpu(dp=1, pp=1)",
        "--inject", "at iteration 5: recover gpu(dp=0, pp=1)", "--inject", "at iteration 5: recover gpu(dp=1, pp=1)"])
    assert code == 0, stderr + stdout
    assert "re-partitioning the 4 survivors as 2 x 2" in stdout and "keep their processes and restore iter-" in stdout, \
        stdout
    _exact(out, tmp_path / "w.pt", 8)
    kinds = [(e["kind"], e["message"]) for e in run_log["events"]]
    assert not [m for k, m in kinds if k == "restart"], kinds
    started = [e for e in run_log["events"] if e["kind"] == "started"]
    assert len(started) == 6 + 2, [(e["rank"], e["host"]) for e in started]  # the first plan's, then the 2 back
    assert sorted((e["gpu"], e["host"]) for e in started[6:]) == [(1, 0), (4, 1)], started[6:]
    last = run_log["generations"][-1]
    assert len(last["members"]) == 6 and last["reason"] == "grow back (in place)", last


def test_a_host_taken_back_with_a_whole_stage_is_re_partitioned_around_with_no_work_lost(tmp_path):
    """2 x 2 placed stage by stage: host 1 holds both GPUs of stage 1. It is taken away at once
    (agent, forkserver and workers SIGKILLed) mid-run. `--recovery auto` cannot start replacement
    processes there, so it lays the survivors out anew (2 x 1 on host 0), from what they hold:
    with `--shadow`, stage 0's GPUs hold stage 1's state, so nothing trained is lost. (Placed stage by
    stage, stage 1 is ranks 2 and 3.)"""
    out = tmp_path / "out"
    text = spec_text(dp=2, pp=2, optimizer="adam").replace("gpus_per_node = 2", "gpus_per_node = 2  "
                                                                                 "placement = stage_major")
    schedc.compile(text).write(out)
    iterations = 40
    code, stdout, stderr, run_log = _two_hosts(tmp_path, out, PATIENT + [
        "--iterations", str(iterations), "--shadow", "--save-weights", str(tmp_path / "w.pt")],
        kill_host_after="iteration    2 ")
    assert code == 0, stderr + stdout
    _exact(out, tmp_path / "w.pt", iterations)
    kinds = [(e["kind"], e["message"]) for e in run_log["events"]]
    assert any(k == "host" and "host 1 is gone" in m for k, m in kinds), kinds
    (moving,) = [m for k, m in kinds if k == "repartition"]
    assert "host 1 (rank(s) [2, 3]) is gone, so no replacement process can start" in moving, moving
    assert "re-partitioning the 2 survivors" in moving and "move the layers among themselves" in moving, moving
    assert not [m for k, m in kinds if k == "restart"], kinds
    # (2 x 1 is one stage: no room for shadows there, which the run says)
    assert any(k == "shadow" and "no room for shadows" in m and "single stage" in m for k, m in kinds), kinds
    # The two survivors on host 0 kept their processes (no process started after the first four),
    # renamed as ranks 0 and 1 of the 2 x 1 layout.
    assert len([e for e in run_log["events"] if e["kind"] == "started"]) == 4, kinds
    assert sorted(run_log["generations"][-1]["members"]) == [0, 1], run_log["generations"][-1]
    # Nothing trained was lost: every iteration ran once, but for the one the loss interrupted and
    # the step a shadow lags its holder (without shadows: every iteration before the loss, again).
    runs = [r["runs"] for r in run_log["iterations"]]
    assert len(runs) == iterations and sum(runs) - iterations <= 2, runs


def test_a_host_lost_with_its_pipeline_is_routed_around_and_its_gpus_are_not_taken_back_there(tmp_path):
    """2 x 2, a pipeline per host: host 1 (agent, forkserver and workers) is taken away mid-run, with
    the default stall bound (10 s) below the silence one (15 s). Its ranks are found by their
    silence (not called stuck), fenced (their exits never come), and routed around; since silence
    may be load, each would get one fresh process, but their host is gone: that is said, and no
    catch-up waits for a process that cannot start."""
    out = tmp_path / "out"
    schedc.compile(spec_text(dp=2, pp=2, optimizer="adam")).write(out)
    iterations = 30
    code, stdout, stderr, run_log = _two_hosts(tmp_path, out, PATIENT + [
        "--iterations", str(iterations), "--save-weights", str(tmp_path / "w.pt")], kill_host_after="iteration    2 ")
    assert code == 0, stderr + stdout
    _exact(out, tmp_path / "w.pt", iterations)
    messages = [e["message"] for e in run_log["events"]]
    story = "\n".join(messages)
    assert "host 1 is gone" in story and "every rank waits" not in story, story
    # (Beside two busy loops a host-1 rank was once declared failed by its silence before the kill,
    # and taken back while its host still ran: only what follows the host's loss is asserted.)
    after = messages[min(i for i, m in enumerate(messages) if "host 1 is gone" in m):]
    refused = [m for m in after if m.startswith("cannot take GPU (dp=1, pp=")]
    assert refused and all("its host 1 is gone" in m for m in refused), story
    assert not [m for m in after if "catches up" in m], story
    assert sorted(run_log["generations"][-1]["members"]) == [0, 1], run_log["generations"][-1]


def test_a_host_whose_agent_is_restarted_has_its_old_workers_stop_and_its_gpus_recovered(tmp_path):
    """2 x 2, a pipeline per host: host 1's agent alone is SIGKILLed mid-run (its workers live on)
    and another `schedc agent --host 1` started, which takes the host over once the first's lease
    goes stale. Nobody could signal the old workers or report their exits any more: each stops by
    itself (one line on the old agent's stderr) and the supervisor counts them lost at the new
    agent's registration, not after their silence; the run recovers, asks their GPUs back through
    the new agent, and ends exact. (A slow link from rank 0 keeps the run going while the new
    agent starts.)"""
    out = tmp_path / "out"
    schedc.compile(spec_text(dp=2, pp=2, optimizer="adam")).write(out)
    iterations = 120  # (about 38 s: the new agent imports torch twice and waits out the lease, loaded)
    code, stdout, stderr, run_log = _two_hosts(tmp_path, out, PATIENT + [
        "--iterations", str(iterations), "--fail-slow", "off", "--save-weights", str(tmp_path / "w.pt"),
        "--inject", f"at iteration 1: slow link gpu(dp=0, pp=0) delay = 300ms until iteration {iterations}"],
        replace_agent_after="iteration    2 ")
    assert code == 0, stderr + stdout
    _exact(out, tmp_path / "w.pt", iterations)
    events = run_log["events"]
    story = "\n".join(e["message"] for e in events)
    (new_agent,) = [e for e in events if e["kind"] == "host" and "host 1 has a new agent" in e["message"]]
    assert new_agent["ranks"] == [2, 3], story
    lost = [e for e in events if e["kind"] == "failure" and "lost with host 1's old agent" in e["message"]]
    assert sorted(e["rank"] for e in lost) == [2, 3], story
    # Found at the registration, not by their silence first. (Beside two busy loops, the new agent and
    # its two fresh workers once all went silent for 15 s after they had switched in, and the run
    # routed around them again and ended exact: the unexplained stall of a host-1 process tree under
    # load listed in the notes, not this test's path; only what comes before that is asserted.)
    before = events[:events.index(new_agent)]
    assert not [e for e in before if e["kind"] == "failure"], story
    assert all("old agent" in e["message"] for e in events if e["kind"] == "failure" and e["rank"] in (2, 3)
               and e["t"] <= new_agent["t"] + 1.0), story
    # Their GPUs may well be healthy (the new agent runs there): each gets one fresh process.
    assert "taking GPU (dp=1, pp=0) (rank 2) back: its process was lost with host 1's old agent; the GPU may " \
           "be healthy" in story, story
    # The old workers stopped by themselves while the run went on (the test kills what is left of
    # the old agent's session only after the run), each with one line on the old agent's stderr.
    said = (tmp_path / "agent.txt").read_text()
    assert said.count("host 1 has a new agent") == 2 and "so it stops" in said, said
    # ... and the new agent started a fresh process for each GPU.
    again = {e["rank"] for e in events if e["kind"] == "started" and e["host"] == 1 and e["t"] > new_agent["t"]}
    assert again == {2, 3}, story
    assert len(run_log["iterations"]) == iterations
