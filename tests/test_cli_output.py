"""`schedc.cli.output`: an output file is checked by creating one where it goes, and written
whole or not at all."""

from __future__ import annotations

import os

import pytest

import schedc
from schedc.cli.output import check_writable, write_atomic


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_where_no_file_can_be_created_is_refused_even_as_root():
    # os.access says "writable" for /proc as root; only creating a file tells.
    with pytest.raises(schedc.RunError) as exc:
        check_writable("/proc/x.json", "--log")
    assert exc.value.codes == ["E558"] and "no file can be created in `/proc`" in exc.value.render()


def test_a_writable_folder_passes_and_is_left_as_it_was(tmp_path):
    check_writable(tmp_path / "log.json", "--log")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_half_way_leaves_neither_a_file_nor_a_temporary_one(tmp_path):
    target = tmp_path / "log.json"
    target.write_text("the previous log\n")

    def half(tmp):
        tmp.write_text("{\"half\": ")
        raise OSError(28, "No space left on device")

    with pytest.raises(schedc.RunError) as exc:
        write_atomic(target, "--log", half)
    assert exc.value.codes == ["E558"] and "No space left on device" in exc.value.render()
    assert [p.name for p in tmp_path.iterdir()] == ["log.json"]
    assert target.read_text() == "the previous log\n"


def test_a_write_replaces_the_file_whole(tmp_path):
    target = tmp_path / "log.json"
    write_atomic(target, "--log", lambda tmp: tmp.write_text("new\n"))
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["log.json"]


def test_a_failed_command_whose_reader_left_still_exits_1(tmp_path):
    """`schedc compile BAD --json | head -c 0`: the reader is gone when the diagnostics are printed.
    Saying nothing more is right, but the exit status is still the command's (it was 0)."""
    import os
    import subprocess
    import sys

    bad = tmp_path / "bad.sched"
    bad.write_text("cluster { dp = 2 }\n")
    read, write = os.pipe()
    os.close(read)  # (every write to the pipe now fails: EPIPE)
    try:
        proc = subprocess.run([sys.executable, "-m", "schedc", "compile", str(bad), "--json", "-o",
                               str(tmp_path / "o")], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
