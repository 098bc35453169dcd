"""Option values out of range: a coded diagnostic and exit status 1 before anything runs, never a
run with the value ignored, a traceback, or argparse's usage error (exit 2, which is for options
and values that are not numbers at all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedc.cli import main

QUICK = ["--quick", "--no-scale", "--no-ablation"]  # (what the old code ran with them was seconds)


def _schedc(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args, words", [
    (["--time-limit", "nan"], "--time-limit must be a positive number of seconds (at most 1e+06), got nan"),
    (["--time-limit", "0"], "--time-limit must be a positive number of seconds (at most 1e+06), got 0"),
    (["--scale-time-limit", "-1"], "--scale-time-limit must be a positive number of seconds"),
    (["--limit", "-1"], "--limit must be at least 1, got -1"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--seeds", "0"], "--seeds must be a whole number from 1 to 1000, got 0"),
    (["--seeds", "100000000"], "--seeds must be a whole number from 1 to 1000, got 100000000"),
])
def test_bench_refuses_values_out_of_range_before_it_runs(tmp_path, capsys, args, words):
    out = tmp_path / "bench"
    code, stdout, err = _schedc(capsys, "bench", *QUICK, "-o", str(out), *args)
    assert code == 1 and err.startswith("error[E206]: ") and words in err, err
    assert stdout == "" and "Traceback" not in err
    assert not out.exists()  # nothing ran


SCHEDULE = str(Path(__file__).parent / "data" / "reordered_3x3.schedule.json")


@pytest.mark.parametrize("value, shown", [("1e8", "1e+08"), ("100000000", "100000000"), ("0", "0"), ("-3", "-3"),
                                          ("2.5", "2.5"), ("nan", "nan"), ("10001", "10001")])
def test_simulate_iterations_are_bounded(capsys, value, shown):
    code, stdout, err = _schedc(capsys, "simulate", SCHEDULE, "--iterations", value)
    assert code == 1 and stdout == "", err
    assert err.startswith(f"error[E206]: --iterations must be a whole number from 1 to 10,000, got {shown}\n"), err


def test_simulate_takes_the_bound_and_a_non_number_is_a_usage_error(capsys):
    code, stdout, _ = _schedc(capsys, "simulate", SCHEDULE, "--iterations", "10000")
    assert code == 0 and stdout.startswith("iteration time ")
    code, _, err = _schedc(capsys, "simulate", SCHEDULE, "--iterations", "many")
    assert code == 2 and "argument --iterations: expected a whole number, not 'many'" in err
