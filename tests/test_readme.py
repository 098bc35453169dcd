"""The README's console blocks print what the commands print now.

A block fenced as ```console is a session: each line that starts with `$ ` is a command, and the
lines up to the next command are what it prints (stdout and stderr together). The test runs the
sessions in README order, each command by bash in one temporary folder (beside it the checkout's
`specs/` and `bench/`; `schedc` is this interpreter's `python -m schedc` on this checkout), and
compares the output with the block, run-dependent figures masked on both sides (`MASKS`). Before
the first block it runs the set-up section's compile of `out/mlp`, which the README's first
session uses.

`$ cat FILE` of a file that is not there yet writes the lines shown to FILE: the README shows a
file, then runs a command on it. A console block that cannot run here is preceded by the line
`<!-- not run: REASON -->` (the reason is required). Any other fenced block with a `$ ` line
fails the test: a session is either checked or says why not.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: What differs from run to run, masked in the output and in the README alike. Each rule is as
#: narrow as the lines it is for.
MASKS = [
    # durations in seconds: wall times, timestamps of the live log, solver wall times
    (re.compile(r"\b\d+\.\d+ s\b"), "<s>"),
    # `schedc run`'s measured steady iteration time (the schedule's own figure is kept)
    (re.compile(r"steady iteration time \d+\.\d+ ms"), "steady iteration time <ms>"),
    # the live run's rendezvous store listens on a free port
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    # how many ranks had stepped their optimizer when the kill landed depends on timing
    (re.compile(r" \(\d+ rank\(s\) undid their last step\)"), ""),
]

#: A bound on each command's wait (a loaded 2-core machine); no test asserts how long one takes.
COMMAND_TIMEOUT = 300

#: The set-up section's compile that the first session (training through a failure) relies on.
PRELUDE = "schedc compile specs/mlp-2x2.sched -o out/mlp > /dev/null"


@dataclass(frozen=True)
class Command:
    text: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    line: int  # where the fence opens, 1-based
    info: str  # the fence's info string
    lines: tuple[str, ...]
    not_run: str | None  # the reason given in `<!-- not run: ... -->`, if any

    @property
    def commands(self) -> list[Command]:
        out: list[Command] = []
        text, expected = None, []
        for ln in self.lines:
            if ln.startswith("$ "):
                if text is not None:
                    out.append(Command(text, tuple(expected)))
                text, expected = ln[2:], []
            elif text is not None:
                expected.append(ln)
        if text is not None:
            out.append(Command(text, tuple(expected)))
        return out


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, with the `not run` reason given before it."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(```+)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        before = lines[start - 1].strip() if start else ""
        reason = re.fullmatch(r"<!-- not run: (.*) -->", before)
        out.append(Block(start + 1, info, tuple(lines[start + 1:j]), reason.group(1).strip() if reason else None))
        i = j + 1
    return out


def mask(lines) -> list[str]:
    out = []
    for ln in lines:
        for pattern, repl in MASKS:
            ln = pattern.sub(repl, ln)
        out.append(" ".join(ln.split()))  # column widths follow the masked numbers' widths
    while out and not out[-1]:
        out.pop()
    return out


SESSIONS = [b for b in blocks(README.read_text()) if b.info == "console"]


def test_every_session_in_the_readme_is_a_console_block():
    """A block that shows `$ command` lines is checked below, or says why it is not."""
    for b in blocks(README.read_text()):
        if any(ln.startswith("$ ") for ln in b.lines):
            assert b.info == "console", f"README.md:{b.line}: a session in a ```{b.info} block, not ```console"
    assert SESSIONS and all(b.commands for b in SESSIONS)
    for b in SESSIONS:
        if b.not_run is not None:
            assert b.not_run, f"README.md:{b.line}: `not run` needs a reason"


def test_the_masks_leave_what_does_not_vary():
    assert mask(["iteration 0: 0.0186 s  loss 1.089195", "store 127.0.0.1:40837", "horizon 900 s"]) == [
        "iteration 0: <s> loss 1.089195", "store 127.0.0.1:<port>", "horizon 900 s"]
    assert mask(["rolled back to iteration 2 (2 rank(s) undid their last step)"]) == ["rolled back to iteration 2"]
    assert mask(["40.50 ms per iteration (was 21.73)"]) == ["40.50 ms per iteration (was 21.73)"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    for name in ("specs", "bench"):
        (d / name).symlink_to(ROOT / name)
    run(d, PRELUDE, check=True)
    return d


def run(cwd: Path, command: str, check: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    script = f'schedc() {{ {shlex.quote(sys.executable)} -m schedc "$@"; }}\n{command}\n'
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT)
    if check:
        assert proc.returncode == 0, proc.stdout
    return proc.stdout


@pytest.mark.parametrize("block", SESSIONS, ids=[f"line{b.line}" for b in SESSIONS])
def test_a_console_block_shows_what_its_commands_print(block, workdir):
    if block.not_run is not None:
        pytest.skip(f"README.md:{block.line} is not run: {block.not_run}")
    for cmd in block.commands:
        m = re.fullmatch(r"cat (\S+)", cmd.text)
        if m and not (workdir / m.group(1)).exists():
            (workdir / m.group(1)).write_text("\n".join(cmd.expected) + "\n")
        got, want = mask(run(workdir, cmd.text).splitlines()), mask(cmd.expected)
        assert got == want, (f"README.md:{block.line}: `$ {cmd.text}` prints (masked):\n"
                             + "\n".join(difflib.unified_diff(want, got, "README", "now", lineterm="")))
