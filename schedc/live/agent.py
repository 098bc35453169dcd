"""Agents: one per host; they start, signal and watch the rank workers of that host.

As torchrun's elastic agent does for its local workers, an agent owns the
processes of its host and reports their deaths at once (it waits on the
processes' sentinels, so an exit is seen within milliseconds). Unlike
torchrun it never restarts the survivors: the supervisor decides, and the
survivors reconfigure in place. Everything an agent learns or is told goes
through the job's store (`schedc.live.membership`):

* commands on ``agent/H/cmd``: ``start`` (ranks), ``signal`` (ranks, signal
  name), ``inject`` (an injection a worker reached: signal its targets now),
  ``stop`` (end every worker, then the agent);
* events on ``events``: ``agent`` (registered), ``exit`` (rank, status),
  ``injected`` (which injection, ranks, signal, time).

The supervisor's host runs its agent inside the supervisor process
(`Agent.step` from the supervisor's loop); every other host runs
``schedc agent --store HOST:PORT --host H`` (`serve`). Workers are forked
from a forkserver that has imported torch once (`schedc.runtime.launcher`).
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import wait as wait_sentinels

from schedc.live.inject import Injection
from schedc.live.membership import JobStore

_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT, "term": signal.SIGTERM}


class Agent:
    """The workers of one host (see the module docstring)."""

    def __init__(self, job: JobStore, host: int):
        self.job = job
        self.host = host
        self.processes: dict[int, object] = {}  # rank -> multiprocessing.Process
        self._reported: set[int] = set()  # pids whose exit was reported
        self._fired: set[int] = set()
        self._injections: dict[int, Injection] | None = None
        self.stopping = False

    def register(self) -> None:
        self.job.event({"kind": "agent", "host": self.host, "pid": os.getpid(), "t": time.time()})

    # -- processes -------------------------------------------------------------------

    def start(self, ranks) -> None:
        from schedc.live.worker import worker_main
        from schedc.runtime.launcher import forkserver_context

        ctx = forkserver_context()
        for rank in ranks:
            old = self.processes.get(rank)
            if old is not None and old.exitcode is None:
                continue  # already running
            p = ctx.Process(target=worker_main, name=f"schedc-train-rank-{rank}",
                            args=(self.job.host, self.job.port, rank, self.host))
            p.start()
            self.processes[rank] = p

    def signal(self, ranks, name: str) -> list[int]:
        """Send a signal to the live workers of `ranks` on this host; returns the ranks signalled."""
        sig = _SIGNALS[name]
        done = []
        for rank in ranks:
            p = self.processes.get(rank)
            if p is not None and p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, sig)
                    done.append(rank)
                except ProcessLookupError:
                    pass
        return done

    def alive(self) -> list[int]:
        return [r for r, p in self.processes.items() if p.exitcode is None]

    # -- the loop ------------------------------------------------------------------------

    def step(self, timeout: float) -> None:
        """Wait up to `timeout` for a worker to exit; report exits; carry out commands."""
        running = [p.sentinel for p in self.processes.values() if p.exitcode is None]
        if running:
            wait_sentinels(running, timeout)
        elif timeout > 0:
            time.sleep(timeout)
        for cmd in self.job.commands(self.host):
            self._command(cmd)
        for rank, p in self.processes.items():
            if p.exitcode is not None and p.pid not in self._reported:
                self._reported.add(p.pid)
                p.join(0)
                self.job.event({"kind": "exit", "rank": rank, "code": p.exitcode, "host": self.host,
                                "t": time.time()})

    def _command(self, cmd: dict) -> None:
        op = cmd.get("op")
        if op == "start":
            self.start(cmd["ranks"])
        elif op == "signal":
            self.signal(cmd["ranks"], cmd["signal"])
        elif op == "inject":
            self._inject(cmd)
        elif op == "stop":
            self.stopping = True

    def _inject(self, cmd: dict) -> None:
        """A worker reached an injection's moment (or the supervisor's clock did): signal its targets."""
        index = cmd["id"]
        if index in self._fired:
            return
        inj = self.injections().get(index)
        if inj is None:
            return
        self._fired.add(index)
        done = self.signal(inj.ranks, inj.action)
        self.job.event({"kind": "injected", "id": index, "ranks": done, "signal": inj.signal_name,
                        "by": cmd.get("rank"), "iteration": cmd.get("iteration"), "host": self.host,
                        "t": time.time()})

    def injections(self) -> dict[int, Injection]:
        if self._injections is None:
            config = self.job.config()
            self._injections = {j["index"]: Injection.from_json(j) for j in config.get("injections", [])}
        return self._injections

    def stop_all(self, grace: float = 2.0) -> None:
        """End every worker this agent started: they exit by themselves once the run is stopped;
        those that have not after `grace` seconds (stopped, stuck) are killed. Waits for all."""
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            wait_sentinels([self.processes[r].sentinel for r in self.alive()], 0.05)
        for rank in self.alive():
            self.signal([rank], "kill")
        for p in self.processes.values():
            p.join(5.0)

    def serve(self, poll: float = 0.005) -> None:
        """Run as a host's agent process until the supervisor stops the run (or goes away)."""
        self.register()
        try:
            while not self.stopping and not self.job.stopped():
                self.step(poll)
        except RuntimeError:  # the store is gone: so is the supervisor; stop this host's workers
            pass
        finally:
            self.stop_all()
            try:
                self.step(0)  # report the last exits
            except RuntimeError:
                pass
