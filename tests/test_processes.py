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
