"""`schedc train --shadow`: every GPU of stage s + 1 keeps an exact copy of stage s, stepped with
the gradient stage s streams to it. When every GPU of a stage is killed, the survivors save what
they hold (their stages, the lost stage's shadow) as a checkpoint and every process restarts from
it: nothing trained since the last periodic checkpoint is lost, and training ends exactly where
single-process training does."""

from __future__ import annotations

import pytest

from live_support import check_exact, compiled
from schedc.live import train
from schedc.live.shadow import ShadowLink, assignment, shadowed_stage
from schedc.runtime.manifest import Manifest

LOSE_STAGE_1 = ["at iteration 3 during B: fail gpu(dp=0, pp=1)", "at iteration 3 during B: fail gpu(dp=1, pp=1)"]


def _events(result, kind: str) -> list[str]:
    return [e["message"] for e in result.events if e["kind"] == kind]


def _story(result) -> list[tuple[str, str]]:
    return [(e["kind"], e["message"]) for e in result.events]


def _no_work_lost(result, recovery: str, steps: int) -> None:
    """The survivors went on from `steps` steps, what the lost stage's shadows held: with
    --recovery repartition, keeping their processes and moving the layers in place (no restore,
    no new process); with auto (replacement processes for the lost stage), through a dump
    generation that saved the state first, which every process then restores."""
    story = _story(result)
    if recovery == "repartition":
        assert any(k == "repartition" and "move the layers among themselves" in m for k, m in story), story
        assert not any("survivors save" in m for m in _events(result, "shadow")), story
        assert result.generations[-1].restore is None, story
        at = next(i for i, (k, _) in enumerate(story) if k == "repartition")
        assert not [m for k, m in story[at:] if k == "started"], story  # no process started since
        assert result.recoveries[-1].method == "repartition" and result.recoveries[-1].resumed_at == steps, story
    else:
        assert any(f"saved the state after {steps} steps" in m for m in _events(result, "shadow")), story
        assert result.generations[-1].restore.endswith(f"iter-{steps:06d}"), story


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("recovery", ["repartition", "auto"])
def test_a_killed_stage_comes_back_from_its_shadows_with_no_work_lost(tmp_path, optimizer, recovery):
    # No periodic checkpoint: without shadows the survivors would restart from the initial weights
    # (iterations 0-2 trained again); with them, from the state after 3 steps.
    out = compiled(tmp_path, dp=2, pp=3, optimizer=optimizer)
    result = train(out, iterations=6, want_weights=True, recovery=recovery, shadow=True,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1)
    check_exact(out, result, 6)
    _no_work_lost(result, recovery, 3)
    if recovery == "repartition":  # 2 x 3 -> 2 x 2 on the 4 survivors, renamed in place (the two deaths
        # may reach the supervisor in one tick or two: a re-route around the first may come between)
        assert len(result.generations[-1].members) == 4, _story(result)
        return
    (saving,) = [m for m in _events(result, "shadow") if "survivors save" in m]
    assert "stage 1 from its shadow on rank(s) [2, 5]" in saving, _story(result)
    dump, last = result.generations[-2:]
    assert sorted(dump.members) == [0, 2, 3, 5] and dump.restore is None
    assert len(last.members) == 6, _story(result)  # (replacement processes for stage 1)


@pytest.mark.parametrize("recovery", ["repartition", "auto"])
def test_the_gradient_a_holder_received_but_had_not_applied_is_not_lost(tmp_path, recovery):
    # Without staggered optimizer steps every rank waits for every other before its step, so the
    # holders (stage 2) cannot step in iteration 3 once stage 1 is killed: their shadows lag one
    # step, and the gradient of step 3, received in iteration 3 but applied only at its step,
    # must bring them to 3 steps when the generation ends (gloo reports a receive complete only
    # once waited for: a look that did not wait missed it, and the run fell back to the start).
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam", stagger=False)
    result = train(out, iterations=6, want_weights=True, recovery=recovery, shadow=True,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1)
    check_exact(out, result, 6)
    _no_work_lost(result, recovery, 3)


@pytest.mark.parametrize("recovery", ["repartition", "auto"])
def test_a_stage_killed_in_its_optimizer_step_is_restored_exactly(tmp_path, recovery):
    # Killed in O, before its all-reduce: stage 1 never takes step 4, while the other stages may
    # (the holders too: a shadow lags its holder by a step). The survivors go on from the steps
    # the lost stage's shadows hold, 3, those that stepped going back one.
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=6, want_weights=True, recovery=recovery, shadow=True,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 3 during O: fail gpu(dp=0, pp=1)",
                           "at iteration 3 during O: fail gpu(dp=1, pp=1)"])
    check_exact(out, result, 6)
    _no_work_lost(result, recovery, 3)  # (stage 1 never took step 4)


def test_a_holder_lost_while_the_survivors_save_leaves_the_other_holder(tmp_path):
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=6, want_weights=True, recovery="auto", shadow=True,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1 + ["at recovery 1: fail rank 2"])
    check_exact(out, result, 6)
    assert any(e["kind"] == "injected" and "recovery 1" in e["message"] for e in result.events), _story(result)
    last = result.generations[-1]
    assert last.restore.endswith("iter-000003"), _story(result)


def test_a_failure_while_the_layers_move_moves_them_again_from_what_the_survivors_held(tmp_path):
    """A survivor killed while the layers move in place (the generation that moves them never
    becomes ready): each member still holds what it ran before the move, and the three left hold
    every stage of the 2 x 3 layout (stage 1 in its shadows), so the next generation moves the
    layers again from there: nothing restored, nothing trained again, exactly."""
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=6, want_weights=True, recovery="repartition", shadow=True, checkpoint_every=2,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1 + ["at recovery 1: fail rank 2"])
    check_exact(out, result, 6)
    story = _story(result)
    assert any(k == "repartition" and "move the layers among themselves" in m for k, m in story), story
    assert any(e["kind"] == "injected" and "recovery 1" in e["message"] for e in result.events), story
    moved = next(g for g in result.generations if "move the layers in place" in g.reason)
    assert moved.t_ready is None, story  # (the move never completed)
    assert any(k == "repartition" and "moves the layers again" in m for k, m in story), story
    assert all(g.restore is None for g in result.generations), story
    assert result.recoveries[-1].resumed_at == 3 and not [m for k, m in story if k == "restart"], story


@pytest.mark.parametrize("recovery", ["repartition", "auto"])
def test_a_gpu_caught_up_from_a_donor_holds_no_shadow_to_save(tmp_path, recovery):
    # Rank 2 (a holder of stage 1) fails and is taken back: it catches up its own stage from a
    # donor, not its shadow, so only rank 5's shadow of stage 1 is used when stage 1 is lost.
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=30, want_weights=True, recovery=recovery, shadow=True,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 1 during B: fail gpu(dp=0, pp=2)", "at iteration 2: recover gpu(dp=0, pp=2)",
                           "at iteration 25 during B: fail gpu(dp=0, pp=1)",
                           "at iteration 25 during B: fail gpu(dp=1, pp=1)"])
    check_exact(out, result, 30)
    _no_work_lost(result, recovery, 25)
    if recovery == "auto":
        (saving,) = [m for m in _events(result, "shadow") if "survivors save" in m]
        assert "stage 1 from its shadow on rank(s) [5])" in saving, _story(result)
    else:
        assert result.generations[-1].restore is None and result.recoveries[-1].resumed_at == 25, _story(result)


def test_a_stage_lost_with_every_holder_falls_back_to_the_checkpoint(tmp_path):
    # Stage 1 and every holder of its shadow (stage 2) are lost at once: nothing holds stage 1 any
    # more, so no dump generation is tried; the survivors restore the latest periodic checkpoint.
    # (At the iteration's start: killed during an op, one stage's death would keep the other's
    # GPUs from ever reaching theirs.)
    out = compiled(tmp_path, dp=2, pp=3)
    result = train(out, iterations=6, want_weights=True, recovery="repartition", shadow=True, checkpoint_every=2,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=[f"at iteration 3: fail gpu(dp={d}, pp={p})" for d in (0, 1) for p in (1, 2)])
    check_exact(out, result, 6)
    assert not [m for m in _events(result, "shadow") if "survivors save" in m], _story(result)
    assert result.generations[-1].restore.endswith("iter-000002"), _story(result)


def test_a_restart_with_a_replacement_restores_the_survivors_state(tmp_path):
    # --recovery restart restarts every process from a checkpoint; with shadows the survivors
    # save a newer one first (here every stage still has a GPU of its own: no shadow is needed).
    out = compiled(tmp_path, dp=2, pp=2, optimizer="adam")
    result = train(out, iterations=6, want_weights=True, recovery="restart", shadow=True, checkpoint_every=2,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=["at iteration 3 during F: fail gpu(dp=1, pp=0)"])
    check_exact(out, result, 6)
    assert result.generations[-1].restore.endswith("iter-000003"), _story(result)
    assert len(result.generations[-1].members) == 4


# -- the assignment of holders and sources -----------------------------------------------------------


def _manifest(stage_groups, coords) -> Manifest:
    return Manifest(spec="s.sched", schedc_version="0", dp=2, pp=len(stage_groups), microbatches=2,
                    live_ranks=tuple(sorted(coords)), coords=coords,
                    stage_groups=tuple(tuple(g) for g in stage_groups), programs={}, source="m.py", data=None,
                    partition=None, optimizer="sgd", lr=0.1, iterations=1, decouple_backward=True,
                    stagger_optimizer=True)


def test_every_gpu_of_the_next_stage_holds_a_stage_and_sources_take_turns():
    # 2 x 3 with rank 1 (dp=0, pp=1) routed around: stage 1's one live GPU (4) sends to both holders.
    coords = {0: (0, 0), 2: (0, 2), 3: (1, 0), 4: (1, 1), 5: (1, 2)}
    m = _manifest([(0, 3), (4,), (2, 5)], coords)
    plan = assignment(m)
    assert plan == {4: (0, 0), 2: (1, 4), 5: (1, 4), 0: (2, 2), 3: (2, 5)}
    assert ShadowLink.of(m, 4) == ShadowLink(sends_to=(2, 5), source=0)
    assert ShadowLink.of(m, 3) == ShadowLink(sends_to=(), source=5)
    assert ShadowLink.of(m, 0) == ShadowLink(sends_to=(4,), source=2)


def test_a_shadow_of_a_stage_the_new_plan_does_not_give_the_rank_is_another_one():
    # Rank 0 of a 2 x 3 job (stage 0, its own layers 0-1) holds stage 2's shadow (layers 2-3). The
    # survivors restore in place as 2 x 2, stages 0 | 1-2: rank 0 keeps its number and layers, so
    # nothing rebuilt it, and its old shadow stood for the new stage 1 (layers 1-3): a restore of
    # the initial weights crashed on it, and its copy was reported exact though it copied nothing
    # the new plan has. `_other_shadow` says so, and the rank rebuilds (or drops) it.
    from types import SimpleNamespace

    from schedc.live.member import LiveWorker

    old = SimpleNamespace(pp=3, partition=[[0, 1], [1, 2], [2, 3]], stage_groups=[[0, 3], [1, 4], [2, 5]])
    new = SimpleNamespace(pp=2, partition=[[0, 1], [1, 3]], stage_groups=[[0, 2], [1, 3]])
    copy = SimpleNamespace(stage=2, layers=(2, 3), partition=((0, 1), (1, 2), (2, 3)))
    worker = SimpleNamespace(shadow=copy, rank=0, config=SimpleNamespace(shadow=True))
    assert not LiveWorker._other_shadow(worker, old)
    assert LiveWorker._other_shadow(worker, new)  # it holds stage 1 there
    same_stage_other_layers = SimpleNamespace(pp=3, partition=[[0, 1], [1, 3], [3, 4]], stage_groups=old.stage_groups)
    assert LiveWorker._other_shadow(worker, same_stage_other_layers)
    emulated = SimpleNamespace(stage=2, layers=None, partition=None)
    assert not LiveWorker._other_shadow(SimpleNamespace(shadow=emulated, rank=0, config=worker.config), old)


def test_a_single_stage_has_no_shadows():
    assert shadowed_stage(0, 1) is None and shadowed_stage(0, 3) == 2 and shadowed_stage(2, 3) == 1
    m = _manifest([(0, 1)], {0: (0, 0), 1: (1, 0)})
    assert assignment(m) == {} and ShadowLink.of(m, 0) == ShadowLink((), None)


# -- refused before anything starts ------------------------------------------------------------------


def test_shadows_that_do_not_fit_a_gpu_s_memory_are_refused_with_the_numbers(tmp_path):
    import schedc
    from live_support import spec_text
    from schedc.diagnostics import RunError

    # 40 MiB of static state per stage: the plan peaks at 46-52 MiB per GPU, which 80 MiB GPUs
    # hold, but not with the previous stage's 40 MiB on top.
    text = spec_text(dp=2, pp=2).replace("memory = 1GiB", "memory = 80MiB").replace("static = 16MiB", "static = 40MiB")
    out = tmp_path / "out"
    schedc.compile(text).write(out)
    with pytest.raises(RunError) as err:
        train(out, iterations=2, shadow=True)
    (d,) = err.value.diagnostics
    assert d.code == "E555" and d.message.startswith("--shadow needs ") and "over the GPUs' 80" in d.message, d
    assert "leave out --shadow" in d.hint


def test_a_single_stage_job_is_told_that_shadows_need_two_stages(tmp_path):
    from schedc.diagnostics import RunError

    out = compiled(tmp_path, dp=2, pp=1)
    with pytest.raises(RunError) as err:
        train(out, iterations=2, shadow=True)
    assert err.value.codes == ["E555"] and "single stage" in err.value.diagnostics[0].message


def _tight(tmp_path):
    """2 x 3 at 48 MiB a GPU: the job's plan peaks at 28 MiB, room for a 16 MiB shadow; re-routed
    around GPU (dp=1, pp=0), rank 0 peaks at 40 MiB: the plan fits, a shadow beside it does not."""
    import schedc
    from live_support import spec_text

    out = tmp_path / "out"
    schedc.compile(spec_text(dp=2, pp=3, optimizer="adam").replace("memory = 1GiB", "memory = 48MiB")).write(out)
    return out


def test_room_for_shadows_is_judged_per_plan():
    import schedc
    from live_support import spec_text
    from schedc.live.shadow import room_problem

    text = spec_text(dp=2, pp=3, optimizer="adam").replace("memory = 1GiB", "memory = 48MiB")
    plan = schedc.compile(text)
    assert room_problem(plan) is None
    rerouted = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    message, hint = room_problem(rerouted)
    assert message.startswith("--shadow needs") and "rank 0 (stage 0)" in message and "48MiB" in message, message
    assert room_problem(schedc.compile(spec_text(dp=2, pp=1)))[0].endswith("this job has a single stage")


def test_a_plan_without_room_drops_the_shadows_and_a_stage_lost_later_restores_the_checkpoint(tmp_path):
    """The re-routed plan has no room for shadows: every worker drops its own, nothing streams, and
    when stage 1 is then lost on every GPU there is nothing to save: the latest checkpoint is
    restored (with replacement processes), exactly."""
    out = _tight(tmp_path)
    result = train(out, iterations=7, want_weights=True, recovery="reroute", shadow=True, checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=["at iteration 2 during B: fail gpu(dp=1, pp=0)",
                           "at iteration 4 during B: fail gpu(dp=0, pp=1)",
                           "at iteration 4 during B: fail gpu(dp=1, pp=1)"])
    check_exact(out, result, 7)
    (off,) = [m for m in _events(result, "shadow") if "no room for shadows" in m]
    assert "rank 0 (stage 0)" in off, _story(result)
    assert not any("survivors save" in m for m in _events(result, "shadow")), _story(result)
    assert [g.shadow for g in result.generations][:2] == [True, False], _story(result)
    assert any("restoring iter-" in m for m in _events(result, "restart")), _story(result)


def test_after_an_in_place_re_partition_the_job_grows_back_onto_the_spec(tmp_path):
    """Stage 1 lost: the survivors move the layers in place (epoch 1). Both GPUs asked back by the
    job's names: at the next complete checkpoint the job grows onto the spec's 2 x 3 in place as
    well (epoch 2: the 4 survivors renamed, 2 processes started for the GPUs back), and the run
    ends exactly."""
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=9, want_weights=True, recovery="repartition", shadow=True, checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=LOSE_STAGE_1 + ["at iteration 6: recover gpu(dp=0, pp=1)",
                                          "at iteration 6: recover gpu(dp=1, pp=1)"])
    check_exact(out, result, 9)
    story = _story(result)
    assert any(k == "repartition" and "move the layers among themselves" in m for k, m in story), story
    assert [r.method for r in result.recoveries][-1] == "grow-back", story
    last = result.generations[-1]
    assert len(last.members) == 6 and last.reason == "grow back (in place)" and last.restore is None, story
