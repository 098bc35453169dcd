"""`print_spec`: valid text that loads back to an equal Spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedc.load import load
from schedc.printer import format_flops, format_rate, format_size, format_time, print_spec

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.sched"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_round_trip(path):
    spec = load(path)
    text = print_spec(spec)
    again = load(text, name=str(path))
    assert again == spec
    assert print_spec(again) == text  # canonical: printing is a fixed point


def test_derived_prints_model_and_partition_not_stages():
    text = print_spec(load(Path(__file__).parent.parent / "specs" / "gpt-1.3b.sched"))
    assert 'model "gpt-1.3b" {' in text and "stage 0 = layers[0:7]" in text
    assert "stages {" not in text and "fail node 1" in text


@pytest.mark.parametrize("fn,value,text", [
    (format_time, 1200, "1.2ms"), (format_time, 20, "20us"), (format_time, 5_000_000, "5s"),
    (format_time, 1_234_567, "1234.567ms"), (format_size, 40 * 2**30, "40GiB"), (format_size, 0, "0B"),
    (format_size, 1000, "1000B"), (format_rate, 25 * 10**9, "25GB/s"), (format_rate, 7, "7B/s"),
    (format_flops, 312e12, "312TFLOPS"), (format_flops, 1.5e9, "1.5GFLOPS"),
])
def test_value_formats(fn, value, text):
    assert fn(value) == text
