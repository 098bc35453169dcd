"""`schedc train --recovery repartition`: when every GPU of a stage is killed, no replacement
process is started; the survivors are laid out as the same number of pipelines with fewer stages,
keep their processes (renamed as the new layout's ranks) and restore the latest checkpoint
re-sharded onto the new split (with `--shadow`, they move the layers among themselves instead:
tests/test_live_shadow.py), and training ends exactly where single-process training does."""

from __future__ import annotations

import re

import pytest

from live_support import check_exact, compiled
from schedc.live import train

LOSE_STAGE_1 = ["at iteration 2 during B: fail gpu(dp=0, pp=1)", "at iteration 2 during B: fail gpu(dp=1, pp=1)"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_killed_stage_is_re_partitioned_onto_the_survivors_exactly(tmp_path, optimizer):
    out = compiled(tmp_path, dp=2, pp=3, optimizer=optimizer)
    result = train(out, iterations=5, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1)
    check_exact(out, result, 5)
    (rec,) = result.recoveries
    assert rec.method == "repartition" and sorted(rec.failed) == [1, 4]
    note = next(e for e in result.events if e["kind"] == "repartition")
    assert "re-partitioning the 4 survivors as 2 x 2" in note["message"], note
    assert "they keep their processes and restore iter-" in note["message"], note
    assert note["restore"].endswith(("iter-000001", "iter-000002")), note  # the latest complete checkpoint
    last = result.generations[-1]
    assert len(last.members) == 4 and last.restore == note["restore"]  # 2 x 2: no replacement process
    at = result.events.index(note)  # ... and no process restarted: the 4 survivors kept theirs
    assert not [e for e in result.events[at:] if e["kind"] in ("started", "restart")], result.events[at:]


# Stage 0 and GPU (dp=1, pp=1) lost: one survivor, too few for the job's 2 pipelines. It trains
# the same global batch of 2 x 3 microbatches as 1 pipeline of 6 (the job's microbatch
# d * 3 + m as its microbatch; `Manifest.data_index`), so the weights stay exact.
LOSE_ALL_BUT_ONE = ["at iteration 2 during B: fail gpu(dp=0, pp=0)", "at iteration 2 during B: fail gpu(dp=1, pp=0)",
                    "at iteration 2 during B: fail gpu(dp=1, pp=1)"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("shadow", [False, True], ids=["restart", "in-place"])
def test_survivors_too_few_for_the_jobs_pipelines_train_the_same_batch_on_fewer(tmp_path, optimizer, shadow):
    out = compiled(tmp_path, dp=2, pp=2, microbatches=3, optimizer=optimizer)
    result = train(out, iterations=5, want_weights=True, recovery="repartition", checkpoint_every=1, shadow=shadow,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_ALL_BUT_ONE)
    check_exact(out, result, 5)
    notes = [e["message"] for e in result.events if e["kind"] in ("restart", "repartition")]
    assert any("re-partitioning the 1 survivors as 1 x 1 (6 microbatches each" in m for m in notes), notes
    assert len(result.generations[-1].members) == 1  # (GPU 1, rank 0 of the new layout)


def test_without_a_checkpoint_the_survivors_restore_the_initial_weights_in_place(tmp_path):
    out = compiled(tmp_path, dp=2, pp=3)
    result = train(out, iterations=4, want_weights=True, recovery="repartition", inject=LOSE_STAGE_1)
    check_exact(out, result, 4)
    # (without checkpoints a restore loses the whole run so far: the cost model may pick a layout of
    # fewer GPUs whose stages keep more replicas; the run goes on with the one it chose)
    (chosen,) = [e["layout"] for e in result.events if e["kind"] == "repartition"]
    assert result.generations[-1].restore == "initial"
    assert len(result.generations[-1].members) == chosen["dp"] * chosen["pp"]


def test_a_failure_after_the_re_partition_is_routed_around_in_the_new_plan(tmp_path):
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    # Rank 3 is GPU (dp=1, pp=0) of the first plan and GPU (dp=1, pp=1) of the re-partitioned 2 x 2.
    result = train(out, iterations=6, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=LOSE_STAGE_1 + ["at iteration 4 during B: fail rank 3"])
    check_exact(out, result, 6)
    # (under load the two deaths of stage 1 may come as two recoveries: a re-route, then the loss)
    methods = [r.method for r in result.recoveries]
    assert "repartition" in methods and methods[-1] in ("reroute", "drop-pipeline"), methods
    assert len(result.generations[-1].members) == 3  # 2 x 2 with one GPU routed around


def test_a_failure_while_the_survivors_restart_is_survived_exactly(tmp_path):
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=6, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1 + ["at recovery 1: fail rank 2"])
    check_exact(out, result, 6)
    # The two GPUs of stage 1 are killed as each reaches its backward, not at one instant: seen once
    # in CI (under load), the second death reached the supervisor after a re-route of the first had
    # started, so rank 2 was killed while that generation formed and the restart came after it,
    # with 3 survivors. Either way a failure hit a recovery and the run re-partitioned exactly.
    notes = [e["message"] for e in result.events if e["kind"] in ("restart", "repartition")]
    assert any(re.search(r"re-partitioning (the|\d of the) [34] survivors", m) for m in notes), \
        [(e["kind"], e["message"]) for e in result.events]
    assert any(e["kind"] == "injected" and "recovery 1" in e["message"] for e in result.events)
    assert len(result.generations[-1].members) == 3, [(e["kind"], e["message"]) for e in result.events]


def _later(lines: list[str], first: str, then: str) -> bool:
    """Whether a line holding `then` came after one holding `first` (generation numbers vary: the
    two GPUs of a stage may die in one generation or in two)."""
    at = next((i for i, ln in enumerate(lines) if first in ln), None)
    return at is not None and any(then in ln for ln in lines[at + 1:])


BOTH_BACK = ["at iteration 5: recover gpu(dp=0, pp=1)", "at iteration 5: recover gpu(dp=1, pp=1)"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_job_grows_back_onto_the_spec_once_every_lost_gpu_is_back(tmp_path, optimizer):
    # Stage 1 is lost, the survivors run as 2 x 2; both GPUs come back at iteration 5 (named as the
    # job named them at its start): at the next complete checkpoint the 4 running processes are
    # renamed as ranks of the spec's 2 x 3, processes start for the 2 GPUs back, and all 6 move
    # the layers among themselves (nothing restarts, nothing is trained again), exactly.
    # (12 iterations: the growth begins at a checkpoint a little after iteration 5, and on a busy
    # machine that can be iteration 7 or 8; the grown layout must still run some)
    out = compiled(tmp_path, dp=2, pp=3, optimizer=optimizer)
    result = train(out, iterations=12, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1 + BOTH_BACK)
    check_exact(out, result, 12)
    first, grow = result.recoveries
    assert first.method == "repartition" and grow.method == "grow-back" and grow.t_first is not None
    rejoins = [e["message"] for e in result.events if e["kind"] == "rejoin"]
    assert "1 of the 2 GPU(s) the job lost" in rejoins[0] and "every GPU the job lost is back" in rejoins[1]
    note = [e for e in result.events if e["kind"] == "repartition"][-1]
    assert note["message"].startswith("growing back onto the spec's 2 x 3: the 4 running processes keep theirs "
                                      "and move the layers among all 6"), note
    last = result.generations[-1]
    assert len(last.members) == 6 and last.restore is None and last.reason == "grow back (in place)"
    assert grow.moved_bytes > 0


def test_a_failure_while_the_job_grows_back_is_survived_exactly(tmp_path):
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=8, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"), inject=LOSE_STAGE_1 + BOTH_BACK + ["at recovery 2: fail rank 5"])
    check_exact(out, result, 8)
    assert any(e["message"].startswith("growing back onto the spec's 2 x 3") for e in result.events)
    # The failure extends the grow-back (as a failure during any recovery does), routed around it.
    assert [r.method for r in result.recoveries] == ["repartition", "reroute"]
    assert result.recoveries[1].failed == [5] and len(result.generations[-1].members) == 5


def test_without_checkpoints_a_gpu_asked_back_after_a_re_partition_is_refused_with_why(tmp_path):
    # The job grows back through a checkpoint; a run that writes none cannot: the request says so
    # (it used to take the name for the 2 x 2 layout's GPU (dp=0, pp=1) and say "runs already").
    out = compiled(tmp_path, dp=2, pp=3)
    result = train(out, iterations=6, want_weights=True, recovery="repartition", inject=LOSE_STAGE_1 + BOTH_BACK[:1])
    check_exact(out, result, 6)
    (warning,) = [e["message"] for e in result.events if e["kind"] == "warning"]
    (chosen,) = [e["layout"] for e in result.events if e["kind"] == "repartition"]
    onto = f"{chosen['dp'] * chosen['pp']} GPUs as {chosen['dp']} x {chosen['pp']}"
    assert warning.startswith("warning: cannot take GPU (dp=0, pp=1) back (injected `at iteration 5: recover "
                              f"gpu(dp=0, pp=1)`): the job was re-partitioned onto {onto}"), warning
    assert "--checkpoint-every" in warning and not [e for e in result.events if e["kind"] == "rejoin"]


#: Long enough for every `schedc rejoin` to be answered before the run ends: each is a new Python
#: process that imports torch, 6-8 s apiece on a loaded 2-core machine (three of them outlasted a
#: 150-iteration run there, about 25 s of training at 0.17 s an iteration).
RUN_ITERATIONS = 500


def _ask_back_while_running(tmp_path, inject: list[str], after: tuple[str, str], gpus: tuple[str, ...],
                            answered: str):
    """An emulated 2 x 3 run of RUN_ITERATIONS iterations through `inject`; once a line holding `after[1]`
    follows one holding `after[0]`, each GPU of `gpus` is asked back with `schedc rejoin --store`
    (in turn, each once a line holding `answered` (formatted with it) is seen). Its result."""
    import subprocess
    import sys
    import threading

    from live_support import wait_until

    out = compiled(tmp_path, dp=2, pp=3, forward="20ms")
    lines: list[str] = []
    box = {}

    def run():
        box["result"] = train(out, iterations=RUN_ITERATIONS, emulate=True, recovery="repartition", checkpoint_every=2,
                              checkpoint_dir=str(tmp_path / "ckpt"), on_line=lines.append, inject=inject)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until(lambda: _later(lines, *after), f"{after[1]!r} after {after[0]!r}", state=lambda: lines[-3:])
        (store,) = [ln.rsplit("store ", 1)[1].strip() for ln in lines if "running from iteration" in ln]
        for gpu in gpus:
            asked = subprocess.run([sys.executable, "-m", "schedc", "rejoin", "--store", store, f"recover gpu({gpu})"],
                                   capture_output=True, text=True, timeout=60)
            assert asked.returncode == 0, asked.stderr
            # (also ends when the run does: the lines say why no answer came)
            wait_until(lambda: any(answered.format(gpu=gpu) in ln for ln in lines) or not t.is_alive(),
                       f"the answer for {gpu}", state=lambda: lines[-3:])
            assert any(answered.format(gpu=gpu) in ln for ln in lines), \
                f"the run ended with no answer for {gpu}:\n" + "\n".join(ln for ln in lines if "GPU" in ln)
    finally:
        t.join(timeout=180)
    return box["result"]


def test_schedc_rejoin_after_a_re_partition_counts_only_the_gpus_the_job_lost(tmp_path):
    # GPUs are named as the job started: (dp=0, pp=0) never left (asking for it counts for nothing),
    # the two of stage 1 did; once both are asked back the job grows back onto 2 x 3.
    result = _ask_back_while_running(tmp_path, LOSE_STAGE_1, ("re-partitioning ", "reconfigured"),
                                     ("dp=0, pp=0", "dp=0, pp=1", "dp=1, pp=1"), "GPU ({gpu}) of the job")
    # (Only the answers to these asks: under two busy loops a rank was once declared failed by its
    # silence and taken back, a rejoin and a recovery of its own between them.)
    rejoins = [e["message"] for e in result.events
               if e["kind"] == "rejoin" and "of the job" in e["message"] and not e["message"].startswith("taking")]
    assert "GPU (dp=0, pp=0) of the job did not leave it" in rejoins[0], rejoins
    assert "1 of the 2 GPU(s) the job lost" in rejoins[1] and "every GPU the job lost is back" in rejoins[2], rejoins
    methods = [r.method for r in result.recoveries]
    # (one GPU back already makes 2 x 3 with a slot re-routed, faster: the job may grow onto that first)
    assert methods[0] == "repartition" and 1 <= methods.count("grow-back") <= 2, methods
    assert len(result.generations[-1].members) == 6 and len(result.iterations) == RUN_ITERATIONS


def test_a_gpu_lost_after_a_re_partition_is_named_as_the_job_named_it_and_taken_back(tmp_path):
    # After stage 1 is lost, the 4 survivors (GPUs 0, 2, 3, 5) run as 3 x 1 (the cheapest layout
    # at these costs: 139.5 ms per iteration against 2 x 2's 155.7), on the lowest three: its rank 2
    # runs on the job's GPU 3, (dp=1, pp=0). Killed there, it is asked back by that name (`schedc
    # rejoin`), and rejoins the layout as its rank 2 (catch-up, then a switch) instead of waiting
    # for a GPU nobody could name.
    result = _ask_back_while_running(tmp_path, LOSE_STAGE_1 + ["at iteration 5 during B: fail rank 2"],
                                     ("fail rank 2`", "reconfigured"), ("dp=1, pp=0",),
                                     "of the job (rank 2) back")
    (chosen,) = [e["layout"] for e in result.events if e["kind"] == "repartition"]
    assert chosen["gpus"] == [[0], [2], [3]], chosen
    rejoins = [e["message"] for e in result.events if e["kind"] == "rejoin"]
    assert any("taking GPU (dp=1, pp=0) of the job (rank 2) back" in m for m in rejoins), rejoins
    assert [s.kind for s in result.switches] == ["rejoin"], [(e["kind"], e["message"]) for e in result.events]
    assert result.generations[-1].members == [0, 1, 2] and len(result.iterations) == RUN_ITERATIONS


def test_the_job_grows_onto_part_of_the_returned_gpus_then_back_onto_the_spec(tmp_path):
    # 2 x 4 loses stages 1 and 2 (4 GPUs) and runs as 2 x 2. Two GPUs come back: 6 make a faster
    # layout, 6 x 1 (each GPU the whole model, a microbatch each: 16.5 ms per iteration by the
    # planner, against 2 x 3's 22.0), which it grows onto at the next checkpoint; the other two
    # come back: the spec's 2 x 4 (the user's shape once nothing is missing).
    out = compiled(tmp_path, dp=2, pp=4, optimizer="adam")
    result = train(out, iterations=16, want_weights=True, recovery="repartition", checkpoint_every=1,
                   checkpoint_dir=str(tmp_path / "ckpt"),
                   inject=[f"at iteration 2: fail gpu(dp={d}, pp={p})" for d in (0, 1) for p in (1, 2)]
                   + ["at iteration 5: recover gpu(dp=0, pp=1)", "at iteration 5: recover gpu(dp=1, pp=1)",
                      "at iteration 10: recover gpu(dp=0, pp=2)", "at iteration 10: recover gpu(dp=1, pp=2)"])
    check_exact(out, result, 16)
    story = [(e["kind"], e["message"]) for e in result.events]
    grows = [m for k, m in story if m.startswith("growing back")]
    # The path depends on the load: how the four deaths reached the supervisor (one loss of 4 GPUs,
    # or a re-route, then a loss) decides the survivors' layout (the cost model's choice), and so
    # which layout the GPUs back make first (6 x 1 on 6 GPUs when all 4 survivors run; seen under two
    # busy loops: 3 of them as 3 x 1, then 2 x 2 on 4; and a rank a loaded machine silenced for a
    # while is taken back by growing too). It grows in place onto a part of the GPUs first, and onto
    # the spec once all are back.
    assert len(grows) >= 2 and not grows[0].startswith("growing back onto the spec's"), story
    assert all("running processes keep theirs" in m for m in grows), story
    assert any(m.startswith("growing back onto the spec's 2 x 4: the ") for m in grows), story
    sizes = [len(g.members) for g in result.generations]
    assert sizes[0] == 8 and 8 in sizes[1:], (sizes, story)
    methods = [r.method for r in result.recoveries]
    assert "repartition" in methods and methods.count("grow-back") >= 2, story


# Without checkpoints a restore would lose the whole run so far: the 4 survivors of a lost stage
# run as 3 x 1 (3 replicas, the least restore risk; the cost model's choice), which leaves one GPU
# spare. Then all 3 GPUs of that layout fail.
LOSE_STAGE_THEN_EVERY_GPU_OF_THE_NEW_LAYOUT = LOSE_STAGE_1 + [f"at iteration 5 during B: fail rank {r}" for r in range(3)]


def test_a_layout_lost_on_every_gpu_goes_on_on_the_jobs_spare_gpu_exactly(tmp_path):
    # No survivor, but the spare GPU: it runs 1 x 1 in a fresh process from the initial weights
    # (no checkpoint), the same global batch, exactly. (Before spares were weighed: E553.)
    out = compiled(tmp_path, dp=2, pp=3, optimizer="adam")
    result = train(out, iterations=8, want_weights=True, recovery="repartition",
                   inject=LOSE_STAGE_THEN_EVERY_GPU_OF_THE_NEW_LAYOUT)
    check_exact(out, result, 8)
    first, second = [e for e in result.events if e["kind"] == "repartition"]
    assert "re-partitioning 3 of the 4 survivors as 3 x 1" in first["message"], first  # (one waits, spare)
    assert ("re-partitioning 1 spare GPU(s) of the job (GPU (dp=1, pp=2)) as 1 x 1 (6 microbatches each"
            in second["message"]), second
    assert "fresh processes start on them and restore the initial weights" in second["message"], second
    assert second["layout"]["spare"] == [5] and result.generations[-1].members == [0]
    at = result.events.index(second)
    # (rank 0 of the new layout, on the spare GPU: the job's rank 5)
    assert [(e["rank"], e["gpu"]) for e in result.events[at:] if e["kind"] == "started"] == [(0, 5)], result.events[at:]
