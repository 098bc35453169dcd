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


def test_after_a_re_partition_an_injected_node_and_gpu_are_the_jobs(tmp_path):
    """2 x 3 placed stage by stage (node n holds stage n). Node 2 is killed: stage 2 is lost on
    every GPU and the 4 survivors are laid out anew, renumbered. `fail gpu(dp=0, pp=1)` then
    names the job's GPU, so it kills the rank that runs that GPU in the new layout, whatever
    its number there (before, it killed whichever rank had the number the first plan gave it)."""
    import schedc
    from live_support import check_exact, spec_text

    out = tmp_path / "out"
    text = spec_text(dp=2, pp=3, optimizer="adam").replace("gpus_per_node = 3",
                                                             "gpus_per_node = 2  placement = stage_major")
    schedc.compile(text).write(out)
    job = schedc.load(text)
    target = next(g.rank for g in job.gpus if (g.dp, g.pp) == (0, 1))
    result = train(out, iterations=7, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 2 during B: fail node 2", "at iteration 5: fail gpu(dp=0, pp=1)"])
    check_exact(out, result, 7)
    relaid = [e for e in result.events if e["kind"] == "repartition"]
    gpus = [g for row in relaid[0]["layout"]["gpus"] for g in row]  # the first new layout's ranks -> job GPUs
    later = result.events[result.events.index(relaid[0]):]
    (hit,) = [e for e in later if e["kind"] == "injected" and "fail gpu(dp=0, pp=1)" in e["message"]]
    assert [gpus[r] for r in hit["ranks"]] == [target], (hit, gpus)
    assert not [e for e in result.events if e["kind"] == "warning" and "never fired" in e["message"]], result.events
