"""`schedc agent` never ends in silence: a store that goes away before the run said stop, a
second agent given the same `--host`, and an agent that another took its host from each end
with E557 (exit 1); an agent that saw the stop says so (`AgentLeft`) and exits 0.

The store is hosted by a stand-in for the supervisor (a small process this test starts and kills
by its pid), so the agents run for real (`schedc agent`, its forkserver warmed) without a
training job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from live_support import WAIT_S, wait_until
from schedc.live.membership import JobStore
from schedc.live.protocol import AgentLeft, AgentUp

pytestmark = pytest.mark.e2e

_STORE = ("from schedc.live.membership import JobStore; import sys; j = JobStore.serve(); "
          "print(j.port, flush=True); sys.stdin.read()")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


class _Job:
    """The stand-in supervisor's store and this test's client of it; every process started here
    is ended by its pid at `close`."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.holder = subprocess.Popen([sys.executable, "-c", _STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=_env())
        self.port = int(self.holder.stdout.readline())
        self.client = JobStore.connect("127.0.0.1", self.port, timeout=WAIT_S)
        self.agents: list[subprocess.Popen] = []
        self.seen: list = []

    def agent(self, name: str) -> subprocess.Popen:
        err = (self.tmp / f"{name}.txt").open("w")
        p = subprocess.Popen([sys.executable, "-m", "schedc", "agent", "--store", f"127.0.0.1:{self.port}",
                              "--host", "1", "--timeout", "10"], stdout=err, stderr=err, env=_env(),
                             start_new_session=True)
        err.close()
        self.agents.append(p)
        return p

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.txt").read_text()

    def events(self) -> list:
        self.seen += self.client.events()
        return self.seen

    def registered(self, pid: int) -> bool:
        return any(isinstance(ev, AgentUp) and ev.pid == pid for ev in self.events())

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=WAIT_S)
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(timeout=WAIT_S)


@pytest.fixture
def job(tmp_path):
    j = _Job(tmp_path)
    yield j
    j.close()


def test_an_agent_whose_store_goes_before_the_stop_says_so_and_exits_1(job):
    agent = job.agent("agent")
    wait_until(lambda: job.registered(agent.pid) or agent.poll() is not None, "the agent to register",
               state=lambda: job.output("agent"))
    job.holder.kill()  # the supervisor's process is gone, and its store with it
    agent.wait(timeout=WAIT_S)
    text = job.output("agent")
    assert agent.returncode == 1, text
    assert "error[E557]" in text and "lost the run's store" in text and "stopped this host's 0 worker(s)" in text
    assert "Traceback" not in text and "frame #" not in text


def test_a_second_agent_of_one_host_is_refused_and_the_first_says_it_left_at_the_stop(job):
    first = job.agent("first")
    wait_until(lambda: job.registered(first.pid) or first.poll() is not None, "the first agent to register",
               state=lambda: job.output("first"))
    second = job.agent("second")
    second.wait(timeout=WAIT_S)
    text = job.output("second")
    assert second.returncode == 1, text
    assert "error[E557]" in text and f"host 1 already has an agent (pid {first.pid} on" in text
    assert first.poll() is None, job.output("first")  # (the one that holds the host goes on)
    job.client.stop("finished")
    first.wait(timeout=WAIT_S)
    assert first.returncode == 0, job.output("first")
    wait_until(lambda: any(isinstance(ev, AgentLeft) and ev.host == 1 for ev in job.events()),
               "the first agent's AgentLeft", state=lambda: job.seen)


def test_an_agent_that_stopped_beating_loses_its_host_to_the_next_and_says_so_when_it_wakes(job):
    first = job.agent("first")
    wait_until(lambda: job.registered(first.pid) or first.poll() is not None, "the first agent to register",
               state=lambda: job.output("first"))
    os.kill(first.pid, signal.SIGSTOP)  # paused: it does not beat
    try:
        second = job.agent("second")
        wait_until(lambda: "took over from an agent that stopped beating" in job.output("second")
                   or second.poll() is not None, "the second agent to take the host over",
                   state=lambda: job.output("second"))
        assert f"(pid {first.pid} on" in job.output("second")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    first.wait(timeout=WAIT_S)
    text = job.output("first")
    assert first.returncode == 1, text
    assert "error[E557]" in text and "took this host over" in text and f"pid {second.pid} on" in text
    assert second.poll() is None, job.output("second")
    job.client.stop("finished")
    second.wait(timeout=WAIT_S)
    assert second.returncode == 0, job.output("second")
