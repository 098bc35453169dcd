"""A forkserver child watched through its own pidfd (what `schedc.runtime.processes` starts).

The stdlib watches a forkserver's children through the forkserver's pipe, so
it takes the end of that pipe (the forkserver killed) for the exit of every
child it ever started. `WatchedPopen` watches each child by a pidfd of its
own (Linux), readable when that process, and only it, has ended; its exit
status still comes from the forkserver, or, if the forkserver is gone, from
`waitpid` (the orphan is re-parented to the subreaper, `schedc.runtime.processes`).

A start asks the forkserver for a process and reads back its pid: a
forkserver that does not answer (stopped, wedged) would hold that read
forever, so it is bounded (`ANSWER_WAIT`, or `FIRST_ANSWER_WAIT` for a
forkserver's first answer, then `ForkserverSilent`).
"""

from __future__ import annotations

import os
import time
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import popen_forkserver, util
from multiprocessing.connection import wait as wait_sentinels

#: Seconds an ended rank's exit status may take to arrive (from the forkserver that reaps it, or,
#: with the forkserver gone, until the orphan is re-parented to this process) before it is read
#: from /proc, or reported as UNKNOWN_STATUS. It arrives within milliseconds unless the forkserver
#: is stopped or this process could not become a subreaper (not Linux).
STATUS_WAIT = 2.0
#: The exit status reported for a rank whose real status could not be learnt (as the stdlib does).
UNKNOWN_STATUS = 255
#: Seconds a forkserver that answered before has to say the pid of a process it was asked for
#: (it answers in milliseconds: one silent this long is stopped or wedged).
ANSWER_WAIT = 30.0
#: The same for a forkserver's first answer, which waits for its torch import (seconds; a minute
#: on a loaded machine): as generous as the warm-up's bound (`processes.WARM_WAIT`).
FIRST_ANSWER_WAIT = 120.0

_answered: int | None = None  # the pid of the forkserver that answered last


def _server_pid() -> int | None:
    return getattr(getattr(mp_forkserver, "_forkserver", None), "_forkserver_pid", None)


class ForkserverSilent(OSError):
    """The forkserver did not say the pid of the process it was asked for within `ANSWER_WAIT`."""


class _Answering:
    """`multiprocessing.forkserver` as `popen_forkserver` sees it during one start: the same
    module, except that reading the new process's pid waits a bounded time (`ANSWER_WAIT`)."""

    def __getattr__(self, name):
        return getattr(mp_forkserver, name)

    @staticmethod
    def read_signed(fd):
        global _answered
        server = _server_pid()
        wait = ANSWER_WAIT if server is not None and server == _answered else FIRST_ANSWER_WAIT
        if not wait_sentinels([fd], wait):
            raise ForkserverSilent(f"the forkserver did not answer within {wait:g} s (stopped or wedged)")
        pid = mp_forkserver.read_signed(fd)
        _answered = server
        return pid


def _zombie_status(pid: int) -> int | None:
    """The exit status of `pid` if it is a zombie nobody reaped yet (/proc/PID/stat, field 52)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != "Z":
        return None
    try:
        return os.waitstatus_to_exitcode(int(fields[49]))
    except ValueError:
        return None


class WatchedPopen(popen_forkserver.Popen):
    """A forkserver child whose end is seen by its own pidfd (`sentinel`), never inferred
    from the forkserver's pipe; its status is read from that pipe or, when the forkserver is
    gone, waited for here (see the module docstring)."""

    def _launch(self, process_obj):
        # The stdlib's start, with its read of the new pid bounded (`_Answering`). Starts happen on
        # one thread (a host's agent loop, the launcher), so the swap is seen by this start only.
        popen_forkserver.forkserver = _Answering()
        try:
            super()._launch(process_obj)
        finally:
            popen_forkserver.forkserver = mp_forkserver
        self._status_fd = self.sentinel  # the forkserver's pipe: the pid, later the exit status
        self._server_gone = False
        self._ended_at: float | None = None
        self._pidfd: int | None = None
        self._pidfd_closer = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfds here, or it has ended and been reaped already:
            return  # the forkserver's pipe says when (the stdlib's way)
        self.sentinel = self._pidfd
        self._pidfd_closer = util.Finalize(self, os.close, (self._pidfd,))

    def poll(self, flag=os.WNOHANG):
        if self.returncode is not None or getattr(self, "_pidfd", None) is None:
            return super().poll(flag)
        block = flag != os.WNOHANG
        if not wait_sentinels([self._pidfd], None if block else 0):
            return None  # still running, whatever became of the forkserver
        self.returncode = self._exit_status(block)
        return self.returncode

    def _exit_status(self, block: bool) -> int | None:
        """The status of this ended process: None while it may still arrive (not `block`)."""
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        deadline = self._ended_at + STATUS_WAIT
        while True:
            code = self._reported_status()
            if code is not None:
                return code
            now = time.monotonic()
            if now >= deadline:
                code = _zombie_status(self.pid)
                return UNKNOWN_STATUS if code is None else code
            if not block:
                return None
            wait_sentinels([self._status_fd], min(0.01, deadline - now))
            if self._server_gone:
                time.sleep(0.005)  # (the pipe at EOF is always ready: do not spin)

    def _reported_status(self) -> int | None:
        if not self._server_gone and wait_sentinels([self._status_fd], 0):
            try:
                return mp_forkserver.read_signed(self._status_fd)
            except (OSError, EOFError):  # the forkserver ended before it reaped this process
                self._server_gone = True
        if self._server_gone:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) re-parented to this process
                return None
            if pid:
                return os.waitstatus_to_exitcode(status)
        return None

    def close(self):
        super().close()
        if getattr(self, "_pidfd_closer", None) is not None:
            self._pidfd_closer()


class WatchedForkServerProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return WatchedPopen(process_obj)


class WatchedForkServerContext(mp_context.ForkServerContext):
    Process = WatchedForkServerProcess
