"""The rank processes of one host: started, signalled and watched in one place.

`schedc run` (`schedc.runtime.launcher`) and each host's agent of `schedc
train` (`schedc.live.agent`) start their ranks through `LocalProcesses`:
from one `multiprocessing` context (a forkserver that imported torch once, so
L ranks do not pay L torch imports; "spawn" where CUDA is used), watched so
an exit is seen within milliseconds, signalled by name, and stopped together
(a grace period to exit, then SIGKILL). Only processes started here are ever
signalled: the caller's own, through their pidfds (a pid can be reused; a pidfd cannot).

A rank's process is watched by itself, not through the forkserver: the
forkserver is the ranks' parent and passes on their exit statuses, so the
stdlib takes the end of its pipe (the forkserver killed) for the exit of
every rank it ever started. Here each rank is watched by a pidfd of its own
(Linux), which is readable when that process, and only it, has ended; its
status still comes from the forkserver, or, if the forkserver is gone, from
`waitpid` (while it has ranks, this process is the subreaper of its
descendants, so the orphaned ranks are its children then; not otherwise, or
it would adopt, and never reap, the orphans of every program it runs). A
dead forkserver is replaced the next time a rank is started, and said so in
one line; one that dies while a rank is being started, or does not answer
(`schedc.runtime.watched`), is replaced and the start retried.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import warnings
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import resource_tracker, util
from multiprocessing.connection import wait as wait_sentinels
from typing import Callable

from schedc.runtime.watched import ForkserverSilent, WatchedForkServerContext

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT, "term": signal.SIGTERM}

#: Tries at starting one rank while forkservers keep dying (each try after the first starts a new one).
START_TRIES = 3
#: Seconds `LocalProcesses.warm` waits for the forkserver's first fork (its torch import).
WARM_WAIT = 120.0
#: Seconds to wait for a forkserver that broke a start to be gone before starting a new one
#: (it has closed its sockets: it is exiting; this only bounds a wait that ends at once).
SERVER_EXIT_WAIT = 5.0

_CONTEXT = None
_STARTED: set[int] = set()  # pids of every rank any `LocalProcesses` of this process started
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_PR_GET_CHILD_SUBREAPER = 37


class StartError(Exception):
    """No rank process could be started: the forkserver ended at every try."""


def forkserver_context():
    """The `multiprocessing` context CPU rank processes are started from (`schedc run` and the
    agents of `schedc train`): a forkserver that imported torch and did a warm-up step once,
    whose ranks are watched by their own pidfds (see the module docstring)."""
    global _CONTEXT
    if _CONTEXT is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the forkserver and the ranks
        # gloo's C++ warnings repeat what the diagnostics say, once per rank and peer.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        _CONTEXT = WatchedForkServerContext()
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "schedc.runtime.warmup",
                                         "schedc.runtime.rank", "schedc.runtime.primitives",
                                         "schedc.runtime.transport", "schedc.live.member"])
    return _CONTEXT


def _prctl(option: int, arg) -> bool:
    """Linux's prctl(option, arg); whether it worked (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _set_subreaper(on: bool) -> bool:
    """While on, orphaned descendants (the ranks of a forkserver that died) become this process's
    children, so their exit statuses can be waited for. Linux only; whether it worked."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def is_subreaper() -> bool:
    """Whether this process adopts its orphaned descendants now (Linux; False elsewhere)."""
    import ctypes

    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and bool(flag.value)


_holders = 0  # `LocalProcesses` with ranks started and not stopped: while any, this process is a subreaper


def _hold() -> None:
    """A `LocalProcesses` starts ranks: adopt orphans from now on (see `_release`)."""
    global _holders
    _holders += 1
    if _holders == 1:
        _set_subreaper(True)


def _release() -> None:
    """A `LocalProcesses` stopped its ranks: once none holds any, stop adopting orphans. A process
    that stayed a subreaper would adopt the orphans of every other program it ever runs (a
    `subprocess` that exits before its own children), and nothing would reap them: zombies for
    the rest of a long-lived launcher's life."""
    global _holders
    _holders = max(0, _holders - 1)
    if _holders == 0:
        _set_subreaper(False)


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, None before it started (the stdlib keeps it)."""
    server = getattr(mp_forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


#: Seconds `stop_forkserver` waits for the SIGKILLed forkserver (and orphans it leaves) to be
#: gone: SIGKILL ends a process within milliseconds; this only bounds a wait that ends at once.
STOP_WAIT = 5.0


def stop_forkserver(timeout: float = STOP_WAIT) -> int | None:
    """End this process's forkserver now, by its pid, and wait (at most `timeout` seconds) until
    it is gone; its pid, or None when none ran. For the end of a command whose workers are all
    stopped (`LocalProcesses.stop_all`): left alone, the forkserver ends only once every holder
    of its "alive" pipe has (this process and every worker) and then tears down a torch import,
    seconds after the command; a rank forked but never known (`_end_strays`) would outlive it.

    SIGKILL, not the pipe: it cannot be blocked (the forkserver blocks Ctrl-C) and skips that
    teardown. Any process it forked that still runs is then this process's child (its
    subreaper) and is killed too. The stdlib's record of the forkserver is cleared, so a later
    worker starts a new one."""
    server = getattr(mp_forkserver, "_forkserver", None)
    pid = forkserver_pid()
    if server is None or pid is None:
        return None
    _hold()  # the forkserver's orphans must become this process's children, to be found and reaped
    try:
        _stop_server(server, pid, timeout)
    finally:
        _release()
    return pid


def _stop_server(server, pid: int, timeout: float) -> None:
    forked = _child_pids(str(pid))  # ended ones too: a zombie it did not reap yet becomes this process's
    with server._lock:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_gone([pid], timeout)
        _reap(pid)
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
        address = server._forkserver_address
        if address is not None and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    mine = set(_child_pids(str(os.getpid())))
    strays = sorted(set(_children("multiprocessing.forkserver")) | (set(forked) & mine))
    for stray in strays:
        try:
            os.kill(stray, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(strays, timeout)
    for stray in strays:
        _reap(stray)


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Until every process of `pids` has ended (its pidfd readable), at most `timeout` seconds."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except (AttributeError, OSError):  # ended and reaped already (or no pidfds: nothing to wait on)
            pass
    deadline = time.monotonic() + timeout
    try:
        while fds:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for fd in wait_sentinels(fds, left):
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _reap(pid: int) -> None:
    """Collect the exit status of child `pid` if it has ended (a zombie no longer)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _nothing() -> None:
    """What `LocalProcesses.warm` forks: nothing (the fork itself is the point)."""


def _start_server() -> None:
    """Start the forkserver (and the stdlib's resource tracker) unless it runs, with Ctrl-C
    blocked, so that it never gets one: the terminal sends Ctrl-C to the whole process group,
    and the forkserver, which starts as a new interpreter that imports torch, would end with a
    traceback (or "Fatal Python error: init_import_site"); the ranks forked from it inherit the
    blocked signal. The caller's Ctrl-C stays pending here and arrives right after.

    The resource tracker is started first: starting it unblocks SIGINT in this thread (it
    blocks SIGINT and SIGTERM for its own start and unblocks them after)."""
    resource_tracker.ensure_running()
    if not hasattr(signal, "pthread_sigmask"):
        mp_forkserver.ensure_running()
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        mp_forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _proc_stats():
    """(pid, its /proc/PID/stat fields after the command name) of every process (Linux's /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1:
            yield int(name), fields


def _children(word: str) -> list[int]:
    """This process's live children whose command line contains `word` (Linux's /proc)."""
    me, found = str(os.getpid()), []
    for pid, fields in _proc_stats():
        if fields[1] != me or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in cmdline:
            found.append(pid)
    return found


def _child_pids(parent: str) -> list[int]:
    """Every child process of pid `parent`, ended ones not yet reaped included (Linux's /proc)."""
    return [pid for pid, fields in _proc_stats() if fields[1] == parent]


#: Seconds `LocalProcesses.stop_all` waits for killed processes to exit before it leaves them behind.
KILL_WAIT = 5.0


def _children_of_multiprocessing() -> set:
    """The processes multiprocessing joins at interpreter exit (`multiprocessing.process._children`,
    private but unchanged since Python 3.4), or an empty set if a later Python renames it."""
    children = getattr(mp.process, "_children", None)
    return children if isinstance(children, set) else set()


def _pidfd(p: mp.Process) -> int | None:
    """`p`'s own pidfd (`schedc.runtime.watched.WatchedPopen`), None where it has none."""
    return getattr(getattr(p, "_popen", None), "_pidfd", None)


def _ended(p: mp.Process) -> bool:
    """Whether `p` has ended, by its pidfd (readable once it has), its status maybe not read yet."""
    fd = _pidfd(p)
    return p.exitcode is not None or (fd is not None and bool(wait_sentinels([fd], 0)))


def _send(p: mp.Process, sig: int) -> None:
    """Signal `p` through its pidfd where it has one: once `p` has ended and been reaped, its pid
    may be another process's, its pidfd never is. ProcessLookupError if it has ended."""
    fd = _pidfd(p)
    if fd is not None and hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal(fd, sig)
    else:
        os.kill(p.pid, sig)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class LocalProcesses:
    """Rank -> process on this host (see the module docstring). `say` gets the one line that
    tells of a forkserver replaced."""

    def __init__(self, context=None, say: Callable[[str], None] = _say):
        self.context = context or forkserver_context()
        self.say = say
        self.processes: dict[int, mp.Process] = {}
        self._reported: set[int] = set()  # pids whose exit `exits` returned
        self._set_aside: list[mp.Process] = []  # replaced before they exited (`start`): killed, never reported
        self._killed: set[int] = set()  # pids this object sent SIGKILL (`signal`)
        self._server: int | None = None  # the forkserver the last rank was started from
        self._holding = False  # this process is a subreaper on its behalf (`_hold`)

    def start(self, rank: int, target: Callable, args: tuple, name: str) -> None:
        """Start `target(*args)` as rank `rank`'s process. `StartError` if it could not (the
        forkserver ended at every try).

        A rank whose process runs and was never killed keeps it (a standby process that a plan now
        names: nothing is started). One that was killed but has not exited yet (an uninterruptible
        sleep: a hung driver call, an unreachable file server) is not waited for: it is sent SIGKILL
        again and set aside, its exit never reported as the rank's, and the replacement starts
        now, said in one line."""
        old = self.processes.get(rank)
        if old is not None and old.exitcode is None:
            if old.pid not in self._killed:
                return
            self._set_aside.append(old)
            del self.processes[rank]
            if not _ended(old):  # (one that has ended, its status on its way, is set aside in silence)
                try:
                    _send(old, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.say(f"rank {rank}'s previous process (pid {old.pid}) has not exited since it was killed: "
                         "sent SIGKILL again, and its replacement starts beside it")
        watched = isinstance(self.context, WatchedForkServerContext)
        if watched and not self._holding:
            self._holding = True
            _hold()
        broke: list[str] = []  # how each failed try ended
        seen = [self._server]  # the forkservers this start went through
        for _ in range(START_TRIES if watched else 1):
            p = self.context.Process(target=target, name=name, args=args)
            try:
                if watched:
                    self._start_server()
                    seen.append(forkserver_pid())
                p.start()
            except (EOFError, OSError) as exc:
                if not watched:
                    raise
                broke.append(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
                if isinstance(exc, ForkserverSilent):  # alive but mute: ended, so the next try starts a new one
                    self._abandon_start()
                else:
                    self._end_strays(forkserver_pid())  # (it may have forked the rank before it died)
                continue
            except BaseException:  # Ctrl-C while the forkserver was asked for this process
                if watched:
                    self._abandon_start()
                raise
            if watched:
                seen.append(forkserver_pid())
                self._note_server(rank, seen, broke)
            self.processes[rank] = p
            _STARTED.add(p.pid)
            return
        raise StartError(f"could not start rank {rank}'s process: its forkserver ended or went silent at each "
                         f"of {len(broke)} tries ({'; '.join(broke)})")

    def _start_server(self) -> None:
        with warnings.catch_warnings(record=True) as caught:  # the stdlib's would be a UserWarning and its source line
            warnings.simplefilter("always")
            _start_server()
        if any("resource_tracker" in str(w.message) for w in caught):
            self.say("the multiprocessing resource tracker had ended; started a new one")

    def _note_server(self, rank: int, seen: list[int | None], broke: list[str]) -> None:
        """One line when the forkserver that started rank `rank` is not the one before it."""
        pids = list(dict.fromkeys(pid for pid in seen if pid is not None))
        self._server = pids[-1] if pids else None
        if len(pids) < 2 and not broke:
            return
        ended = ", ".join(map(str, pids[:-1])) or "unknown"
        how = f" (it ended while rank {rank} was being started: {broke[-1]})" if broke else ""
        self.say(f"the forkserver (pid {ended}) had ended; started a new one (pid {self._server}) "
                 f"to start rank {rank}{how}")

    def _abandon_start(self) -> None:
        """A start was interrupted after the forkserver was asked for a process, before it said
        which (it may still be importing torch, and would fork the rank once done, with nobody
        to stop it): end the forkserver, and what it forked for the start."""
        server = forkserver_pid()
        if server is not None:
            try:
                os.kill(server, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._end_strays(server)

    def _end_strays(self, server: int | None) -> None:
        """Once forkserver `server` has ended, kill every process it forked that is not one of
        ours: a rank forked for a start that never learnt its pid. (Its orphans are this
        process's children then, as their subreaper; elsewhere none is found.)"""
        if server is None:
            return
        self._await_server_exit(server)
        known = _STARTED | {p.pid for p in self.processes.values()} | {server}
        for pid in _children("multiprocessing.forkserver"):
            if pid not in known:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _await_server_exit(pid: int | None) -> None:
        """Until forkserver `pid` has ended (not reaped: the stdlib does that, then starts a new one)."""
        if pid is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        try:
            wait_sentinels([fd], SERVER_EXIT_WAIT)
        finally:
            os.close(fd)

    def signal(self, ranks, name: str) -> list[int]:
        """Send signal `name` (kill, stop, cont, term) to the running processes of `ranks`; those signalled."""
        sig = SIGNALS[name]
        done = []
        for rank in ranks:
            p = self.processes.get(rank)
            if p is not None and p.exitcode is None and p.pid is not None:
                try:
                    _send(p, sig)
                    done.append(rank)
                    if sig == signal.SIGKILL:
                        self._killed.add(p.pid)
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

    def warm(self, timeout: float = WARM_WAIT) -> None:
        """Start the forkserver now and wait until it forks (it imports torch and warms it up
        first, `schedc.runtime.warmup`): a host's agent does it before it registers, so its
        workers start as soon as host 0's, whose forkserver is warm already. Bounded by `timeout`."""
        if not isinstance(self.context, WatchedForkServerContext):
            return
        if not self._holding:
            self._holding = True
            _hold()
        self._start_server()
        p = self.context.Process(target=_nothing, name="schedc-warm-up")
        try:
            p.start()
        except ForkserverSilent as exc:  # (a warm-up only: the first start tries again, from a new one)
            self.say(f"the forkserver did not warm up: {exc}; ended it")
            self._abandon_start()
            return
        _STARTED.add(p.pid)
        p.join(timeout)

    def rename(self, renamed: dict[int, int]) -> None:
        """The process of rank r is rank `renamed[r]` from now on (a live run's survivors renamed
        in place); a process not named has ended (its exit was reported) and is forgotten."""
        self.processes = {renamed[r]: p for r, p in self.processes.items() if r in renamed}

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
        asked to exit by other means, or are stopped or stuck) are killed, and waited for up to
        `KILL_WAIT` seconds. One that has not exited by then (an uninterruptible sleep) is left
        behind, said in one line, and dropped from multiprocessing's children, whose join at
        interpreter exit would else wait for it without bound."""
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            wait_sentinels([self.processes[r].sentinel for r in self.alive()], 0.05)
        self.signal(self.alive(), "kill")
        deadline = time.monotonic() + KILL_WAIT
        for p in self.processes.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for rank, p in sorted(self.processes.items()):
            if p.exitcode is None:  # set aside: no longer one of this host's ranks
                del self.processes[rank]
                self._set_aside.append(p)
                if not _ended(p):
                    self.say(f"rank {rank}'s process (pid {p.pid}) has not exited {KILL_WAIT:g} s after SIGKILL "
                             "(an uninterruptible sleep: a hung driver call or file system?): left behind")
        for p in self._set_aside:  # (killed when set aside: reaped if they ended, never waited for long)
            p.join(0.1)
        self._set_aside = [p for p in self._set_aside if p.exitcode is None]
        for p in self._set_aside:
            _children_of_multiprocessing().discard(p)
        if self._holding and not self.alive():
            self._holding = False
            _release()
