"""`schedc.load` and its diagnostics do work linear in the input, not quadratic.

No wall-clock time is asserted (bench/spec_load_scale.py prints the times): the count of
schedc's own source lines executed, which is the same on a quiet or a loaded machine, must
grow like the input. A scan of every GPU per stage, or of every diagnostic per diagnostic,
made `dp = 1  pp = 10000` with a failed GPU take 10 s to say E301; such a step doubles its
share of the count twice when the input doubles.
"""

from __future__ import annotations

import os
import sys

import pytest

import schedc
from schedc.diagnostics import NOTES_SHOWN, SpecError

_SCHEDC = os.path.dirname(schedc.__file__) + os.sep

STAGES = ("stages { all { forward = 1ms  backward_input = 1ms  backward_weight = 1ms  optimizer = 1ms\n"
          "  activation = 1MiB  stash = 1MiB  static = 1MiB  send = 1KiB } %s }\n")


def lost_stage_of_a_long_pipeline(n: int) -> str:
    """The fuzzed case: one pipeline of n stages, one GPU failed: E301."""
    return ("cluster { dp = 1  pp = %d  gpus_per_node = 8  gpu { memory = 80GiB } }\n" % n + STAGES % ""
            + "train { microbatches = 4 }\nfailures { fail gpu(dp=0, pp=5) }\n")


def every_replica_failed_on_one_line(n: int) -> str:
    """n replicas of one stage, each failed by its own `fail` line, all on one long line: E301
    with a note per line."""
    fails = " ".join(f"fail gpu(dp={d}, pp=0)" for d in range(n))
    return ("cluster { dp = %d  pp = 1  gpus_per_node = 8  gpu { memory = 80GiB } }\n" % n + STAGES % ""
            + "train { microbatches = 4 }\nfailures { " + fails + " }\n")


def a_bad_value_in_every_stage(n: int) -> str:
    """n `stage N { }` blocks, each with its own out-of-range value: n diagnostics to de-duplicate."""
    blocks = " ".join(f"stage {s} {{ forward = 0ms }}" for s in range(n))
    return ("cluster { dp = 1  pp = %d  gpus_per_node = 8  gpu { memory = 80GiB } }\n" % n + STAGES % blocks
            + "train { microbatches = 4 }\n")


def a_stash_too_large_for_every_stage(n: int) -> str:
    """`stash` > `activation` in `all`: E209 once, whatever pp is."""
    return ("cluster { dp = 1  pp = %d  gpus_per_node = 8  gpu { memory = 80GiB } }\n" % n
            + (STAGES % "").replace("stash = 1MiB", "stash = 2MiB") + "train { microbatches = 4 }\n")


def _schedc_lines_run(fn) -> int:
    """How many lines of schedc's own source `fn()` executes (every call, loop turn and
    generator step counts; lark, pydantic and the standard library do not)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(_SCHEDC) else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(before)
    return count


def _load_and_render(text: str) -> str:
    try:
        schedc.load(text)
    except SpecError as exc:
        return str(exc)  # rendered, as a traceback or the CLI shows it
    raise AssertionError("the spec loaded")


@pytest.mark.parametrize("make, code", [
    (lost_stage_of_a_long_pipeline, "E301"),
    (every_replica_failed_on_one_line, "E301"),
    (a_bad_value_in_every_stage, "E206"),
    (a_stash_too_large_for_every_stage, "E209"),
])
def test_loading_and_rendering_grow_linearly(make, code):
    small, large = 200, 800
    assert f"error[{code}]" in _load_and_render(make(small))
    lines = {n: _schedc_lines_run(lambda n=n: _load_and_render(make(n))) for n in (small, large)}
    # Linear: 4x the input, about 4x the lines (the fixed part makes it less); quadratic is 16x.
    assert lines[large] < 5 * lines[small], lines


def test_a_diagnostic_with_thousands_of_notes_shows_a_few():
    text = _load_and_render(every_replica_failed_on_one_line(2000))
    assert text.count(" --> ") == 1 + NOTES_SHOWN
    assert f"and {2000 - NOTES_SHOWN:,} more notes like these" in text
