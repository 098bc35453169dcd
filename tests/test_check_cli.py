"""`schedc check`: summaries (golden), exit codes, stdin, --json, junk input, missing files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SPECS = sorted((ROOT / "specs").glob("*.sched"))
GOLDEN = Path(__file__).parent / "golden" / "spec" / "check"
UPDATE = bool(os.environ.get("SCHEDC_UPDATE_GOLDEN"))


def _main():
    from schedc.cli import main

    return main


def run_check(argv, capsys, stdin: bytes | None = None, monkeypatch=None):
    main = _main()
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_summary_golden(path, capsys):
    code, out, err = run_check([f"specs/{path.name}"], capsys)
    assert code == 0 and err == ""
    golden = GOLDEN / f"{path.stem}.txt"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out, encoding="utf-8")
    assert out == golden.read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_invalid_spec_exits_1_with_diagnostics(capsys):
    code, out, err = run_check(["tests/bad_specs/unknown-key.sched"], capsys)
    assert code == 1 and out == "" and "error[E201]" in err and "did you mean `forward`?" in err


def test_json_output(capsys):
    code, out, _ = run_check(["specs/example.sched", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["spec"]["stages"][0]["forward"] == 1200
    assert [g["rank"] for g in data["spec"]["gpus"] if g["state"] == "failed"] == [6]
    code, out, _ = run_check(["tests/bad_specs/many-errors.sched", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and not data["ok"] and len(data["diagnostics"]) == 5
    assert all("line" in d for d in data["diagnostics"])


def test_stdin(capsys, monkeypatch):
    code, out, _ = run_check(["-"], capsys, stdin=(ROOT / "specs" / "small-2x2.sched").read_bytes(),
                             monkeypatch=monkeypatch)
    assert code == 0 and out.startswith("<stdin>: valid spec")


def test_binary_junk_and_missing_and_directory(capsys, monkeypatch, tmp_path):
    code, _, err = run_check(["-"], capsys, stdin=b"\x00\x01\xff\xfe" * 50, monkeypatch=monkeypatch)
    assert code == 1 and "error[E106]" in err and "byte offset 2" in err
    code, _, err = run_check([str(tmp_path / "nope.sched")], capsys)
    assert code == 1 and "error[E100]" in err and "no such file" in err
    code, _, err = run_check([str(tmp_path)], capsys)
    assert code == 1 and "error[E100]" in err and "directory" in err
    big = tmp_path / "big.sched"
    big.write_bytes(b"# " + b"x" * (1 << 20) + b"\n")
    code, _, err = run_check([str(big)], capsys)
    assert code == 1 and "error[E107]" in err


def _subprocess(*args, stdin: bytes | None = None):
    _main()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "schedc", "check", *args], input=stdin, capture_output=True,
                          cwd=ROOT, env=env, timeout=120)


def test_subprocess_valid_and_stdin_junk():
    ok = _subprocess("specs/small-2x2.sched")
    assert ok.returncode == 0 and b"valid spec" in ok.stdout
    bad = _subprocess("-", stdin=bytes(range(256)))
    assert bad.returncode == 1 and b"Traceback" not in bad.stderr and b"error[E" in bad.stderr
