"""A live run ships each generation's programs as `schedc compile -o` writes them, rendered once:
a plan by classes travels as class programs, bound to each rank by the loader `schedc run` uses."""

from __future__ import annotations

import json

import pytest

import schedc
from live_support import check_exact, spec_text
from schedc.live import train
from schedc.symmetry import SymmetricSchedule

pytestmark = pytest.mark.e2e


def test_a_plan_by_classes_trains_live_through_a_failure_exactly(tmp_path):
    out = tmp_path / "out"
    plan = schedc.compile(spec_text(dp=4, pp=2, microbatches=2), symmetric=True)
    assert isinstance(plan.schedule, SymmetricSchedule)
    plan.write(out)
    manifest = json.loads((out / "programs.json").read_text())
    assert manifest["copy_of"] and len(set(manifest["programs"].values())) < len(manifest["programs"])
    result = train(out, iterations=4, want_weights=True,
                   inject=["at iteration 2 during B: fail gpu(dp=3, pp=0)"])
    assert [r.failed for r in result.recoveries] == [[6]]
    check_exact(out, result, 4)
    # The new generation's plan is written from the very files its members ran.
    gen1 = out / "live" / "gen-0001"
    assert json.loads((gen1 / "programs.json").read_text())["live_ranks"] == [0, 1, 2, 3, 4, 5, 7]
