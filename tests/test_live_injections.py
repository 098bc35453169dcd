"""What a live run says about its injections: every one that fired, slowdowns included, and
every one that never did, with the reason (a user who asked for a fault must not be left to
guess whether it happened)."""

from __future__ import annotations

from live_support import compiled
from schedc.live import train


def test_injections_that_never_fire_are_named_with_why_and_slowdowns_say_when_they_begin(tmp_path):
    out = compiled(tmp_path, forward="5ms")
    result = train(out, iterations=6, emulate=True, fail_slow="off",
                   inject=["at 300s: fail gpu(dp=0, pp=0)", "at recovery 1: fail gpu(dp=1, pp=1)",
                           "at iteration 2: slow gpu(dp=1, pp=0) speed = 0.5 until iteration 4"])
    assert [r.iteration for r in result.iterations] == list(range(6)) and not result.recoveries
    warnings = [e["message"] for e in result.events if e["kind"] == "warning"]
    assert any("`at 300s: fail gpu(dp=0, pp=0)` never fired: training ended" in w and "before 300 s" in w
               for w in warnings), warnings
    assert any("`at recovery 1: fail gpu(dp=1, pp=1)` never fired: there was no generation 1" in w
               for w in warnings), warnings
    assert not any("slow gpu" in w for w in warnings)  # it did begin
    (slow,) = [e for e in result.events if e["kind"] == "injected"]
    assert slow["message"].endswith("rank(s) [2] runs at speed 0.5 from iteration 2 until iteration 4")
    finished = next(i for i, e in enumerate(result.events) if e["kind"] == "finished")
    assert all(i > finished for i, e in enumerate(result.events) if e["kind"] == "warning")
