"""Ctrl-C ends every command with one line on stderr and exit status 130, whatever it is doing:
loading its modules, solving (CP-SAT's threads), starting workers (the forkserver importing
torch), training. SIGTERM to `schedc train` takes the same way out and says SIGTERM.

Each test starts the command in a session of its own and signals its whole process group, as a
terminal's Ctrl-C does, once the command is in the state named (a condition, never a delay)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from live_support import WAIT_S, children_of, compiled, wait_until

TESTS = Path(__file__).parent
SPECS = TESTS.parent / "specs"


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _sigint_default() -> None:
    """Ctrl-C's default action in the child, even when this test runs as a shell's background
    job (which starts with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Command:
    """A `schedc` command running in its own session, its output in files (no pipe to fill)."""

    def __init__(self, tmp_path: Path, *args, program=None):
        self.stdout, self.stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with self.stdout.open("w") as o, self.stderr.open("w") as e:
            self.proc = subprocess.Popen([*(program or [sys.executable, "-m", "schedc"]), *map(str, args)],
                                         stdout=o, stderr=e, env=_env(), start_new_session=True,
                                         preexec_fn=_sigint_default)

    def running(self) -> bool:
        return self.proc.poll() is None

    def proc_file(self, name: str) -> str:
        return _read(f"/proc/{self.proc.pid}/{name}")

    def threads(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return 0

    def children(self, word: str) -> list[int]:
        return children_of(self.proc.pid, word)

    def signal_when(self, condition, what: str, sig=signal.SIGINT, group: bool = True) -> None:
        """Send `sig` once `condition()` holds (failing if the command ended first), then wait for the end."""
        try:
            wait_until(lambda: condition() or not self.running(), what, poll=0.002, state=self.stderr.read_text)
            assert self.running(), f"the command ended before {what}: {self.stderr.read_text()}"
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            self.proc.wait(timeout=WAIT_S)
        finally:
            if self.running():
                os.killpg(self.proc.pid, signal.SIGKILL)

    def session(self) -> list[int]:
        """Live processes of the command's session (its forkserver and workers, which write to the
        same stderr: what they print after the command's end counts too)."""
        found = []
        for entry in Path("/proc").iterdir():
            stat = _read(f"{entry}/stat").rsplit(")", 1)[-1].split()
            if len(stat) > 3 and stat[3] == str(self.proc.pid) and stat[0] != "Z":
                found.append(int(entry.name))
        return found

    def assert_one_line(self, line: str = "interrupted") -> None:
        wait_until(lambda: not self.session(), "every process of the command to end", state=self.session)
        err = self.stderr.read_text()
        assert self.proc.returncode == 130, err
        assert "Traceback" not in err and "terminate called" not in err, err
        assert err.splitlines() == [line], err


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _console_script() -> Path | None:
    script = Path(sys.executable).parent / "schedc"
    return script if script.is_file() else None


@pytest.mark.parametrize("how", ["python -m schedc", "console script"])
def test_ctrl_c_while_the_package_loads(tmp_path, how):
    """Once pydantic's native module is mapped, the package is still importing (schedc.validate)."""
    program = None
    if how == "console script":
        script = _console_script()
        if script is None:
            pytest.skip("no `schedc` console script beside this interpreter")
        program = [sys.executable, str(script)]
    cmd = Command(tmp_path, "compile", SPECS / "tight-memory.sched", "-o", tmp_path / "out", program=program)
    cmd.signal_when(lambda: "pydantic_core" in cmd.proc_file("maps"), "pydantic to be loading")
    cmd.assert_one_line()
    assert not (tmp_path / "out").exists()


def test_ctrl_c_during_a_cp_sat_solve_leaves_an_existing_out_unchanged(tmp_path):
    """CP-SAT searches in a child process of the command (solvers/sandbox.py); Ctrl-C, which
    reaches both, once it runs: one line, exit 130, and the solving process is gone too."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("an earlier run's\n")
    cmd = Command(tmp_path, "compile", SPECS / "tight-memory.sched", "-o", out)
    solving: list[int] = []
    cmd.signal_when(lambda: solving.extend(cmd.children("compile")) or solving, "CP-SAT's solving process")
    cmd.assert_one_line()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in solving), "the solving process to end")
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("stdout.txt", "stderr.txt")] == ["out"]
    assert [p.name for p in out.iterdir()] == ["kept.txt"] and (out / "kept.txt").read_text() == "an earlier run's\n"


def test_two_quick_ctrl_cs_end_with_one_line(tmp_path):
    """A second Ctrl-C ~10 ms after the first, while the command ends, printed a traceback from
    the interpreter's own shutdown (threading's) after `interrupted`: it is ignored now."""
    # A long single-threaded command that ends through the interpreter's own shutdown: a replay of
    # 100,000 rows (it was `simulate --iterations 30000000`, refused now: E206, past 10,000).
    trace = tmp_path / "long.csv"
    trace.write_text("0,4\n" + "".join(f"{60 * i},{3 + i % 2}\n" for i in range(1, 100_001)))
    cmd = Command(tmp_path, "replay", SPECS / "mlp-2x2.sched", trace, "--policy", "reroute")

    def cpu_seconds() -> float:  # (utime + stime of /proc/PID/stat, in clock ticks)
        fields = cmd.proc_file("stat").rsplit(")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else 0.0

    try:
        wait_until(lambda: cpu_seconds() > 1.5 or not cmd.running(), "the simulation to be under way")
        assert cmd.running(), cmd.stderr.read_text()
        os.killpg(cmd.proc.pid, signal.SIGINT)
        wait_until(lambda: "interrupted" in cmd.stderr.read_text() or not cmd.running(), "the first Ctrl-C's line",
                   poll=0.001)
        if cmd.running():
            os.killpg(cmd.proc.pid, signal.SIGINT)
        cmd.proc.wait(timeout=WAIT_S)
    finally:
        if cmd.running():
            os.killpg(cmd.proc.pid, signal.SIGKILL)
    cmd.assert_one_line()


@pytest.mark.e2e
def test_ctrl_c_while_the_forkserver_imports_torch(tmp_path):
    """The terminal's Ctrl-C reaches the whole process group: the forkserver, mid-import, must
    not print a traceback of its own (it starts with Ctrl-C blocked; the supervisor stops it)."""
    cmd = Command(tmp_path, "train", compiled(tmp_path), "--iterations", "1000")

    def importing_torch() -> bool:  # torch's native library is mapped: its import has begun
        return any("libtorch_cpu" in _read(f"/proc/{pid}/maps") for pid in cmd.children("multiprocessing.forkserver"))

    cmd.signal_when(importing_torch, "the forkserver to import torch")
    cmd.assert_one_line()


@pytest.mark.e2e
def test_ctrl_c_and_sigterm_mid_run(tmp_path):
    out = compiled(tmp_path)
    for sig, line, group, how in ((signal.SIGINT, "interrupted", True, "Ctrl-C"),
                                  (signal.SIGTERM, "terminated (SIGTERM)", False, "SIGTERM")):
        cmd = Command(tmp_path, "train", out, "--iterations", "1000")
        cmd.signal_when(lambda: "iteration    1" in cmd.stdout.read_text(), "iteration 1's line", sig=sig,
                        group=group)
        cmd.assert_one_line(line)
        assert f"interrupted ({how}): stopping every worker" in cmd.stdout.read_text()  # the run's own note


def _forked(cmd: Command) -> dict[int, str]:
    """The command's forkserver and workers (every process of its session whose command line is
    the forkserver's: the workers are forked from it), pid -> start time (/proc/PID/stat field
    22: a pid used again later is another process)."""
    found = {}
    for pid in cmd.session():
        if "multiprocessing.forkserver" in _read(f"/proc/{pid}/cmdline").replace("\0", " "):
            stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
            if len(stat) > 19:
                found[pid] = stat[19]
    return found


def _still_running(started: dict[int, str]) -> list[int]:
    """Those of `started` that still run (a zombie has ended: only its exit status is left)."""
    left = []
    for pid, start in started.items():
        stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
        if len(stat) > 19 and stat[19] == start and stat[0] != "Z":
            left.append(pid)
    return left


# (command, its line for iteration 1, its last line of a run of 30 iterations)
COMMANDS = {"train": ("iteration    1", "30 iterations done"), "run": ("iteration 1:", "iteration 29:")}


@pytest.mark.e2e
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("how", ["to the end", "Ctrl-C mid-run"])
def test_train_and_run_leave_no_forkserver_or_worker_behind(tmp_path, command, how):
    """`schedc train` and `schedc run` start a forkserver and their workers: when the command has
    exited, none of them runs any more, at a normal end (exit 0) as after a real Ctrl-C mid-run
    (exit 130). (The forkserver used to end by itself once the command and every worker had
    closed its pipe, then tear down its torch import: an orphan for seconds.)"""
    out = compiled(tmp_path)
    first, last = COMMANDS[command]
    seen: dict[int, str] = {}

    def workers_run() -> bool:  # the forkserver and its 4 workers, recorded while they run
        seen.update(_forked(cmd))
        return len(seen) >= 5

    if how == "to the end":
        cmd = Command(tmp_path, command, out, "--iterations", "30")
        try:
            wait_until(lambda: workers_run() or not cmd.running(), "the workers to run", poll=0.002,
                       state=cmd.stderr.read_text)
            cmd.proc.wait(timeout=WAIT_S)
        finally:
            if cmd.running():
                os.killpg(cmd.proc.pid, signal.SIGKILL)
        assert cmd.proc.returncode == 0, cmd.stderr.read_text()
        assert last in cmd.stdout.read_text()
    else:
        cmd = Command(tmp_path, command, out, "--iterations", "1000")
        cmd.signal_when(lambda: workers_run() and first in cmd.stdout.read_text(), "iteration 1's line")
        assert cmd.proc.returncode == 130, cmd.stderr.read_text()
    assert len(seen) >= 5, f"the test saw {sorted(seen)}, not a forkserver and 4 workers: it proves nothing"
    # The command has exited: what it started has ended before it (no wait here).
    assert _still_running(seen) == [], f"still running after the command exited: {_still_running(seen)}"
    if how == "to the end":
        wait_until(lambda: not cmd.session(), "every process of the command to end", state=cmd.session)
        assert cmd.stderr.read_text() == ""
    else:
        cmd.assert_one_line()


ORPHAN_LINE = re.compile(r"schedc run: torch rank (\d+): its launcher is gone; the rank stops")


@pytest.mark.e2e
@pytest.mark.parametrize("when", ["the ranks meet", "the ranks train"])
def test_ranks_whose_launcher_is_killed_stop_with_one_line_each(tmp_path, when):
    """SIGKILL to `schedc run`'s launcher (the OOM killer's way): nobody reads the ranks' reports
    any more, nor serves the store they meet at. Each rank ends by itself, with one line at most
    and no traceback (a `BrokenPipeError` from its report, or a lost store, was one), whether it
    was still meeting its peers or training."""
    cmd = Command(tmp_path, "run", compiled(tmp_path), "--iterations", "100000")

    def ranks() -> list[int]:
        return [r for server in cmd.children("multiprocessing.forkserver") for r in children_of(server, "")]

    seen: list[int] = []  # the ranks at the kill

    def ready() -> bool:
        seen[:] = ranks()
        return len(seen) == 4 and (when == "the ranks meet" or "iteration 0:" in cmd.stdout.read_text())

    cmd.signal_when(ready, when, sig=signal.SIGKILL, group=False)
    assert cmd.proc.returncode == -signal.SIGKILL and len(seen) == 4, seen
    wait_until(lambda: not cmd.session(), "every rank (and the forkserver) to end", state=cmd.session)
    err = cmd.stderr.read_text()
    assert "Traceback" not in err and "Error" not in err, err
    lines = err.splitlines()
    assert all(ORPHAN_LINE.fullmatch(line) for line in lines), err
    ranks_said = [ORPHAN_LINE.fullmatch(line).group(1) for line in lines]
    assert len(ranks_said) == len(set(ranks_said)) <= 4, err
