"""The rank processes of one host: started, signalled and watched in one place.

`schedc run` (`schedc.runtime.launcher`) and each host's agent of `schedc
train` (`schedc.live.agent`) start their ranks through `LocalProcesses`:
from one `multiprocessing` context (a forkserver that imported torch once, so
L ranks do not pay L torch imports; "spawn" where CUDA is used), watched by
their sentinels so an exit is seen within milliseconds, signalled by name,
and stopped together (a grace period to exit, then SIGKILL). Only processes
started here are ever signalled: the caller's own, by id.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait as wait_sentinels
from typing import Callable

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT, "term": signal.SIGTERM}

_CONTEXT = None


def forkserver_context():
    """The `multiprocessing` context CPU rank processes are started from (`schedc run` and the
    agents of `schedc train`): a forkserver that imported torch and did a warm-up step once."""
    global _CONTEXT
    if _CONTEXT is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the forkserver and the ranks
        # gloo's C++ warnings repeat what the diagnostics say, once per rank and peer.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "schedc.runtime.warmup",
                                         "schedc.runtime.rank", "schedc.runtime.primitives",
                                         "schedc.runtime.transport", "schedc.live.member"])
    return _CONTEXT


class LocalProcesses:
    """Rank -> process on this host (see the module docstring)."""

    def __init__(self, context=None):
        self.context = context or forkserver_context()
        self.processes: dict[int, mp.Process] = {}
        self._reported: set[int] = set()  # pids whose exit `exits` returned

    def start(self, rank: int, target: Callable, args: tuple, name: str) -> bool:
        """Start `target(*args)` as rank `rank`'s process unless one runs; whether it started one."""
        old = self.processes.get(rank)
        if old is not None and old.exitcode is None:
            return False
        p = self.context.Process(target=target, name=name, args=args)
        p.start()
        self.processes[rank] = p
        return True

    def signal(self, ranks, name: str) -> list[int]:
        """Send signal `name` (kill, stop, cont, term) to the running processes of `ranks`; those signalled."""
        sig = SIGNALS[name]
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

    def wait(self, timeout: float) -> None:
        """Return when a process exits, or after `timeout` seconds."""
        running = [p.sentinel for p in self.processes.values() if p.exitcode is None]
        if running:
            wait_sentinels(running, timeout)
        elif timeout > 0:
            time.sleep(timeout)

    def exits(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every process that ended since the last call, each once."""
        out = []
        for rank, p in self.processes.items():
            if p.exitcode is not None and p.pid not in self._reported:
                self._reported.add(p.pid)
                p.join(0)
                out.append((rank, p.exitcode))
        return out

    def stop_all(self, grace: float = 2.0) -> None:
        """End every process started here: those still running after `grace` seconds (they were
        asked to exit by other means, or are stopped or stuck) are killed. Waits for all."""
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            wait_sentinels([self.processes[r].sentinel for r in self.alive()], 0.05)
        self.signal(self.alive(), "kill")
        for p in self.processes.values():
            p.join(5.0)
