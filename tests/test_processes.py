"""The rank processes of one host (`schedc.runtime.processes`): this process adopts orphaned
descendants only while it has ranks, so a long-lived launcher does not collect zombies."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from live_support import WAIT_S
from schedc.runtime.processes import LocalProcesses, is_subreaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers and pidfds are Linux's")

# A program that starts a grandchild holding our pipe as its stdin and exits before it: the
# grandchild is an orphan, ending when we close the pipe.
ORPHAN_MAKER = ("import subprocess, sys\n"
                "p = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.buffer.read()'], stdin=0,\n"
                "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                "print(p.pid, flush=True)\n")


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone (reaped)


def test_orphans_are_adopted_while_ranks_run_and_not_after():
    local = LocalProcesses()
    local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
    try:
        # While a rank runs, its orphans (the forkserver killed) must become this process's children.
        assert is_subreaper()
    finally:
        local.stop_all(grace=0)
    assert not local.alive() and not is_subreaper()

    read, write = os.pipe()
    try:
        maker = subprocess.run([sys.executable, "-c", ORPHAN_MAKER], stdin=read, capture_output=True, text=True,
                               timeout=WAIT_S)
        assert maker.returncode == 0, maker.stderr
        orphan = int(maker.stdout.split()[0])
        pidfd = os.pidfd_open(orphan)
    finally:
        os.close(read)
        os.close(write)  # the orphan reads EOF and exits
    try:
        from multiprocessing.connection import wait

        assert wait([pidfd], WAIT_S), "the orphan did not exit"
    finally:
        os.close(pidfd)
    parent = _parent_of(orphan)
    if parent == os.getpid():
        os.waitpid(orphan, 0)  # (reaped, so the failure leaves no zombie behind)
    assert parent != os.getpid(), "this process adopted another program's orphan, and nothing reaps it"


def test_a_replacement_for_a_killed_rank_whose_process_has_not_exited_starts_now_and_the_old_exit_is_not_the_ranks(
        monkeypatch):
    """A replacement is asked for a rank whose process was killed but has not exited yet (an
    uninterruptible sleep: a hung driver call; here SIGKILL is withheld instead): it starts at
    once, beside the old process, which is sent SIGKILL again; the old one's exit is never reported
    as the rank's (the new process would be taken for dead), and a line says so. A process that
    was never killed (a standby process a plan now names) is kept: nothing is started."""
    import signal as signals

    from schedc.runtime import processes

    real_send = processes._send
    said: list[str] = []
    local = LocalProcesses(say=said.append)
    try:
        local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
        old = local.processes[0]
        local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
        assert local.processes[0] is old and said == []  # (never killed: kept)
        monkeypatch.setattr(processes, "_send", lambda p, sig: None if sig == signals.SIGKILL else real_send(p, sig))
        assert local.signal([0], "kill") == [0] and old.exitcode is None
        local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
        new = local.processes[0]
        assert new.pid != old.pid and new.exitcode is None
        assert any(f"rank 0's previous process (pid {old.pid}) has not exited since it was killed" in line
                   for line in said), said
        monkeypatch.undo()
        real_send(old, signals.SIGKILL)  # (it wakes from its sleep)
        old.join(WAIT_S)
        assert old.exitcode == -9
        assert local.exits() == [] and local.alive() == [0]
    finally:
        monkeypatch.undo()
        local.stop_all(grace=0)
    assert local.exits() == [(0, -9)] and not local.alive()


def test_a_process_that_outlives_sigkill_is_left_behind_said_and_not_joined_at_exit(monkeypatch):
    """A process in an uninterruptible sleep ignores SIGKILL until it wakes: `stop_all` waits for
    it a bounded time, says so, and drops it from multiprocessing's children (whose join at
    interpreter exit would else wait for it forever). Here SIGKILL is withheld instead."""
    import multiprocessing
    import signal as signals

    from schedc.runtime import processes

    real_send, real_kill = processes._send, os.kill
    monkeypatch.setattr(processes, "KILL_WAIT", 0.2)
    monkeypatch.setattr(processes, "_send", lambda p, sig: None if sig == signals.SIGKILL else real_send(p, sig))
    said: list[str] = []
    local = LocalProcesses(say=said.append)
    local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
    p = local.processes[0]
    try:
        local.stop_all(grace=0)
        assert p.exitcode is None and p not in multiprocessing.active_children()
        assert any(f"rank 0's process (pid {p.pid}) has not exited" in line for line in said), said
        assert not local.alive() and not is_subreaper()  # (left behind: no longer one of its ranks)
    finally:
        monkeypatch.undo()
        real_kill(p.pid, signals.SIGKILL)
        p.join(WAIT_S)
    assert p.exitcode == -9


def test_a_start_through_a_forkserver_that_does_not_answer_ends_it_and_starts_from_a_new_one(monkeypatch):
    """A stopped (or wedged) forkserver never says the pid of the process it was asked for: the
    start waits a bounded time, ends that forkserver and starts the rank from a new one, said in
    one line (without the bound, the agent's loop and the whole run would wait forever)."""
    import signal as signals
    import threading

    from schedc.runtime import watched
    from schedc.runtime.processes import forkserver_pid

    said: list[str] = []
    local = LocalProcesses(say=said.append)
    local.warm()  # (its torch import first: then it answers in milliseconds)
    monkeypatch.setattr(watched, "ANSWER_WAIT", 0.5)
    server = forkserver_pid()
    assert server is not None
    os.kill(server, signals.SIGSTOP)
    starting = threading.Thread(target=local.start, args=(0, time.sleep, (WAIT_S,), "schedc-test-rank-0"),
                                daemon=True)
    try:
        starting.start()
        starting.join(WAIT_S)
        assert not starting.is_alive(), "the start still waits for the stopped forkserver"
        assert local.alive() == [0] and forkserver_pid() not in (None, server)
        assert any("did not answer within 0.5 s" in line for line in said), said
    finally:
        try:
            os.kill(server, signals.SIGCONT)  # (if it was never ended: the start above then returns)
        except ProcessLookupError:
            pass
        starting.join(WAIT_S)
        local.stop_all(grace=0)


def test_ranks_are_signalled_through_their_pidfd_never_by_a_pid_that_may_be_reused(monkeypatch):
    """Once a rank's process has ended and been reaped its pid may be another program's: a signal
    goes through the process's own pidfd (Linux), never `os.kill` of a number."""
    import signal as signals

    if not hasattr(os, "pidfd_open") or not hasattr(signals, "pidfd_send_signal"):
        pytest.skip("no pidfds here: signals go by pid")

    from schedc.runtime import processes

    local = LocalProcesses()
    local.start(0, time.sleep, (WAIT_S,), name="schedc-test-rank-0")
    p = local.processes[0]
    try:
        def no_kill(pid, sig):
            raise AssertionError(f"signal {sig} sent to pid {pid} by number")

        monkeypatch.setattr(processes.os, "kill", no_kill)
        assert local.signal([0], "kill") == [0]
        p.join(WAIT_S)
        assert p.exitcode == -signals.SIGKILL
        assert local.signal([0], "kill") == []  # (ended: nothing is signalled)
    finally:
        monkeypatch.undo()
        local.stop_all(grace=0)
