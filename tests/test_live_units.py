"""The live runtime's parts on their own: the injection language, the detector (fed numbers,
no clocks), the rollback copy, checkpoints and the store protocol."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import schedc
from live_support import spec_text, wait_until
from schedc.diagnostics import RunError, SpecError
from schedc.live import checkpoint
from schedc.live.detect import Beat, Detector, exit_cause
from schedc.live.inject import Injection, Injections, Moment, Trigger, parse_injections
from schedc.live.membership import Generation, Heartbeat, JobStore
from schedc.live.protocol import IterationDone, StartRanks
from schedc.live.rollback import RollbackError, StepSnapshot, roll_back, rollback_target


@pytest.fixture(scope="module")
def spec():
    # 2x3, GPU (1, 2) failed in the plan, gpus_per_node = 3 (node n = pipeline n)
    text = spec_text(dp=2, pp=3) + "failures { fail gpu(dp=1, pp=2) }\n"
    return schedc.load(text)


# -- injection ------------------------------------------------------------------------

@pytest.mark.parametrize("text, moment, action, ranks", [
    ("at iteration 3: fail gpu(dp=0, pp=1)", Moment("iteration", 3), "kill", (1,)),
    ("at iteration 2 during B: fail rank 4", Moment("iteration", 2, "during", "B"), "kill", (4,)),
    ("at iteration 2 after O: hang gpu(dp=1, pp=0)", Moment("iteration", 2, "after", "O"), "stop", (3,)),
    ("at iteration 0 during W 2: fail rank 0", Moment("iteration", 0, "during", "W", 2), "kill", (0,)),
    ("at iteration 1 during backward_weight: fail rank 0", Moment("iteration", 1, "during", "W"), "kill", (0,)),
    ("at recovery 2: fail gpu(dp=0, pp=2)", Moment("recovery", generation=2), "kill", (2,)),
    ("at 1.5s: hang rank 1", Moment("time", seconds=1.5), "stop", (1,)),
    ("at 250 ms: fail rank 1", Moment("time", seconds=0.25), "kill", (1,)),
    # A node's failed GPU has no process: only its live ranks are signalled.
    ("at iteration 1: fail node 1", Moment("iteration", 1), "kill", (3, 4)),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed = 0.5 until iteration 3", Moment("iteration", 1), "slow", (0,)),
    ("at iteration 1: slow link rank 1 delay = 20ms", Moment("iteration", 1), "slow_link", (1,)),
    ("at iteration 2: recover gpu(dp=1, pp=2)", Moment("iteration", 2), "rejoin", (5,)),
])
def test_injections_parse_to_their_moment_and_targets(spec, text, moment, action, ranks):
    (inj,) = parse_injections([text], spec, iterations=5)
    assert (inj.moment, inj.action, inj.ranks) == (moment, action, ranks)
    assert Injection.from_json(inj.to_json()) == inj
    (again,) = parse_injections([str(inj)], spec, iterations=5)  # printed back, parsed again
    assert (again.moment, again.action, again.ranks) == (inj.moment, inj.action, inj.ranks)


@pytest.mark.parametrize("text, code, where, words", [
    ("at iteraton 3: fail rank 1", "E560", 4, "did you mean `iteration`"),
    ("iteration 3: fail rank 1", "E560", 1, "starts with `at`"),
    ("at iteration 3 fail rank 1", "E560", 16, "missing `:`"),  # at the event the `:` should precede
    ("at iteration x: fail rank 1", "E560", 14, "whole number"),
    ("at iteration 3 during X: fail rank 1", "E560", 23, "unknown op kind"),
    ("at iteration 3 during O 1: fail rank 1", "E560", 25, "no microbatch"),
    ("at 3: fail rank 1", "E560", 4, "needs a unit"),
    ("at iteration 3: kill rank 1", "E560", 17, "cannot inject `kill`"),
    ("at iteration 3: freeze gpu(dp=0, pp=0)", "E560", 17, "cannot inject `freeze`"),
    ("at iteration 3: fail gpu(dp=1 pp=0)", "E102", 31, "unexpected `pp`"),
    ("at iteration 3: fail gpu(dp=5, pp=0)", "E207", 17, "no GPU (dp=5, pp=0)"),
    ("at iteration 3: fail node 9", "E207", 17, "no node 9"),
    ("at iteration 3: fail gpu(dp=1, pp=2)", "E561", 17, "already failed in the plan"),
    ("at iteration 5: fail rank 0", "E562", 14, "never reached"),
    ("at iteration 1 during B 3: fail rank 0", "E562", 25, "no microbatch 3"),
    ("at recovery 0: fail rank 0", "E560", 13, "from 1 to 999,999,999"),
    ("at recovery 1: recover gpu(dp=1, pp=2)", "E560", 16, "`recover` starts at the start of an iteration"),
    ("at iteration 0: recover gpu(dp=1, pp=2)", "E560", 17, "after the first, or at a time"),
    ("at iteration 3: recover gpu(dp=0, pp=0)", "E561", 17, "never fails in this run"),
    ("at iteration 3: slow gpu(dp=0, pp=0) speed = 0.5 until iteration 2", "E562", 66, "is not after iteration 3"),
    ("at iteration 2 during B: slow gpu(dp=0, pp=0) speed = 0.5", "E560", 16, "not during an op"),
    ("at iteration 1: slow gpu(dp=0, pp=0) speed = 0", "E206", 46, "must be in (0, 1]"),
])
def test_bad_injections_point_at_the_mistake(spec, text, code, where, words):
    with pytest.raises(SpecError) as exc:
        parse_injections([text], spec, iterations=5)
    (d,) = exc.value.diagnostics
    assert d.code == code and d.span.file == "<inject 1>" and d.span.column == where, d
    rendered = exc.value.render()
    assert words in rendered and text in rendered  # the line as written, with a caret under it


def test_every_bad_injection_is_reported_at_once(spec):
    with pytest.raises(SpecError) as exc:
        parse_injections(["at iteration 1: fail rank 0", "at iteraton 1: fail rank 0", "at 1s: fail rank 99"],
                         spec, iterations=5)
    assert [d.span.file for d in exc.value.diagnostics] == ["<inject 2>", "<inject 3>"]


def test_w_moments_need_decoupled_backward():
    spec = schedc.load(spec_text(decouple=False))
    with pytest.raises(SpecError, match="no W op"):
        parse_injections(["at iteration 1 during W: fail rank 0"], spec, iterations=3)


def test_a_trigger_fires_each_injection_once_at_its_op(spec):
    injections = parse_injections(["at iteration 2 during B 1: fail rank 1", "at iteration 2 after O: fail rank 1",
                                   "at iteration 1: fail rank 1", "at recovery 1: fail rank 1"], spec, iterations=5)
    t = Trigger(injections)
    assert t.at_op(2, "during", "B", 0) is None  # another microbatch
    assert t.at_op(1, "during", "B", 1) is None  # another iteration
    assert t.at_op(2, "during", "B", 1).index == 0
    assert t.at_op(2, "during", "B", 1) is None  # once
    assert t.at_op(2, "after", "O", None).index == 1
    assert t.at_iteration_start(1).index == 2 and t.at_iteration_start(1) is None
    assert t.at_recovery(2) is None and t.at_recovery(1).index == 3
    assert not Trigger(())


def test_after_a_re_partition_a_gpu_or_node_target_hits_the_ranks_that_run_its_gpus(spec):
    # The job's GPUs 0, 1, 3 and 4 run as ranks 0-3 of a re-partitioned layout (1 -> rank 2, ...):
    # a GPU or a node names the job's GPUs, so it hits the ranks running them now; `rank R` names a
    # rank of the layout that runs, and a rejoin the job's GPU, as written. A target whose GPUs left
    # the layout signals nobody and is said never to have fired, with why.
    texts = ["at iteration 3: fail gpu(dp=0, pp=1)", "at iteration 3: fail node 1", "at iteration 3: fail rank 1",
             "at iteration 3: slow gpu(dp=0, pp=0) speed = 0.5", "at iteration 2: recover gpu(dp=0, pp=2)",
             "at 1s: hang gpu(dp=0, pp=2)", "at 1s: hang gpu(dp=1, pp=1)"]
    injections = Injections(parse_injections(texts, spec, iterations=5))
    assert [tuple(j["ranks"]) for j in injections.armed()] == [(1,), (3, 4), (1,), (0,), (2,), (2,), (4,)]
    injections.place({0: 0, 1: 3, 2: 1, 3: 4})
    assert [tuple(j["ranks"]) for j in injections.armed()] == [(2,), (1, 3), (1,), (0,), (2,), (), (3,)]
    assert [(i.index, i.ranks) for i in injections.due_at(1.5)] == [(6, (3,))]  # GPU 4 as rank 3; GPU 2 is gone
    assert injections.due_at(2.0) == []  # each once
    (why,) = [line for inj, line in injections.never_fired_lines(3.0, 1) if inj.index == 5]
    assert "never fired: no rank of the layout that ran then held its GPU(s) (the job's GPU(s) [2]" in why, why


# -- detection -------------------------------------------------------------------------

def _detector(**kw):
    return Detector(**{"heartbeat_timeout": 3.0, "stall_timeout": 10.0, "startup_timeout": 60.0, **kw})


def test_an_exit_is_a_failure_once():
    d = _detector()
    d.watch(1, 0.0)
    s = d.exited(1, -signal.SIGKILL, 5.0)
    assert (s.rank, s.cause, s.fence, s.at) == (1, "killed by SIGKILL", False, 5.0)
    assert d.exited(1, -9, 6.0) is None
    assert d.exited(7, 1, 6.0) is None  # not watched
    assert exit_cause(3) == "exited with status 3" and exit_cause(-200) == "killed by signal 200"


POLL = 0.05  # the supervisor reads heartbeats and checks every 50 ms (the default heartbeat interval)


def _run(d, gaps_of, until: float, start: float = 0.0, running=True):
    """Drive `d` from `start` to `until` in POLL steps: rank r beats whenever its next gap (from
    the iterator `gaps_of[r]`, None: it stopped for good) has passed. The suspects with when."""
    seq = {r: 0 for r in gaps_of}
    due = {r: start for r in gaps_of}
    found = []
    for step in range(int(round((until - start) / POLL)) + 1):
        now = start + step * POLL
        for r, gaps in gaps_of.items():
            if due[r] is not None and now >= due[r] - 1e-9:
                seq[r] += 1
                d.beat(r, f"{seq[r]} 0 1 {seq[r]} run", now)
                gap = next(gaps, None)
                due[r] = None if gap is None else now + gap
        found += [(s.rank, now, s) for s in d.check(now, running=running)]
    return found


def _watched(ranks, now=0.0, **kw):
    d = _detector(**kw)
    for r in ranks:
        d.watch(r, now)
    return d


def _regular(n=None, gap=POLL):
    return iter([gap] * n) if n is not None else iter(lambda: gap, None)


def test_silence_is_declared_at_the_bound():
    # Regular beats, then rank 1 stops at t=10 (its last beat): declared at the floor, 3 s later.
    d = _watched([0, 1])
    found = _run(d, {0: _regular(), 1: _regular(200)}, until=20.0)
    ((rank, at, s),) = found
    # (one poll more than the floor: the peers' own gap between two beats is silence they share)
    assert rank == 1 and 13.0 < at <= 13.0 + 3 * POLL and s.fence and "no heartbeat for 3." in s.cause
    assert d.check(25.0, running=True) == []  # declared once


def test_time_the_supervisor_did_not_look_is_not_held_against_the_workers():
    d = _watched([0, 1])
    assert _run(d, {0: _regular(), 1: _regular()}, until=1.0) == []
    # The supervisor's loop (or the store) stalled for 5 s: no beat could be read meanwhile. Then
    # rank 0 beats on and rank 1 does not: only the 3 s of silence the supervisor saw count.
    found = _run(d, {0: _regular(), 1: iter(())}, start=6.0, until=12.0)
    ((rank, at, s),) = found
    assert rank == 1 and 9.0 < at <= 9.0 + 3 * POLL and "no heartbeat for 3." in s.cause


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 2.5), st.integers(0, 2**32 - 1))
def test_beats_with_jitter_under_the_floor_are_never_suspected(jitter, seed):
    import random

    rnd = random.Random(seed)
    d = _watched([0, 1, 2])
    gaps = {r: iter(lambda: POLL + rnd.uniform(0, jitter), None) for r in (0, 1, 2)}
    assert _run(d, gaps, until=60.0) == []


def _stop_delay(history_gaps, detector=None):
    """Seconds from a rank's last beat to its suspicion, after beats spaced by `history_gaps`
    (its peers beat every POLL all along)."""
    d = detector or _watched([0, 1, 2])
    gaps = list(history_gaps)
    last = sum(gaps)
    found = _run(d, {0: iter(gaps), 1: _regular(), 2: _regular()}, until=last + 60.0)
    ((rank, at, _),) = found
    assert rank == 0
    return at - last, d


def test_a_stopped_rank_is_found_within_a_bound_that_grows_with_its_jitter():
    calm, _ = _stop_delay([POLL] * 300)
    assert 3.0 < calm <= 3.0 + 3 * POLL  # regular beats: the floor
    # Beats that came in bursts with pauses of 2.9 s (a loaded host): a 3 s silence is no news.
    bursty = [POLL] * 10 + ([2.9] + [POLL] * 9) * 19
    slow, _ = _stop_delay(bursty)
    import statistics

    mean, std = statistics.fmean(bursty[-200:]), statistics.pstdev(bursty[-200:])
    assert slow > calm + 1.0
    assert slow <= mean + 6 * std + 2 * POLL  # phi 8 is about 5.6 standard deviations past the mean


def test_phi_grows_with_silence_and_shrinks_with_jitter():
    from schedc.live.detect import phi

    assert phi(1.0, [0.05] * 5) == float("inf")  # too few gaps: the floor decides
    steady, jittery = [0.05] * 100, [0.05, 0.5] * 50
    assert phi(0.5, steady) < phi(1.0, steady) < phi(5.0, steady) < phi(50.0, steady)
    assert phi(2.0, jittery) < phi(2.0, steady)
    assert phi(0.0, steady) < 1.0


def test_a_pause_of_every_rank_is_blamed_on_none():
    # The supervisor keeps looking, but every rank goes silent for 5 s together (the host or the
    # store stalled), and they come back a little apart: nobody is declared.
    d = _watched([0, 1, 2, 3])
    gaps = {r: iter([POLL] * 100 + [5.0 + 0.1 * r] + [POLL] * 300) for r in range(4)}
    assert _run(d, gaps, until=30.0) == []


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 25.0), st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4), st.integers(2, 6))
def test_pauses_of_every_rank_together_are_never_blamed(pause, late, ranks):
    # Every rank silent for `pause` s together, each back up to 1 s after the others; 5 s of beats
    # after the last is back (past the floor): nobody is declared.
    d = _watched(range(ranks))
    gaps = {r: iter([POLL] * 60 + [pause + late[r % 4]] + [POLL] * 140) for r in range(ranks)}
    assert _run(d, gaps, until=3.0 + pause + 6.0, running=False) == []


def test_a_rank_that_stops_during_a_shared_pause_is_found_after_it():
    d = _watched([0, 1, 2, 3])
    gaps = {r: iter([POLL] * 100 + [5.0] + [POLL] * 300) for r in range(3)}
    gaps[3] = iter([POLL] * 100)  # stops as the pause begins and never beats again
    ((rank, at, s),) = _run(d, gaps, until=30.0)
    pause_end = 100 * POLL + 5.0
    assert rank == 3 and pause_end + 3.0 - POLL < at <= pause_end + 3.0 + 3 * POLL
    assert "shared by its peers" in s.cause


def test_a_silence_past_the_ceiling_is_found_even_if_every_rank_was_silent():
    d = _watched([0, 1])
    found = _run(d, {0: _regular(20), 1: _regular(20)}, until=40.0, running=False)
    assert sorted(r for r, _, _ in found) == [0, 1] and all(at > 1.0 + 30.0 for _, at, _ in found)


def test_a_worker_that_never_beats_is_judged_against_its_peers_start_up():
    d = _watched([0, 1, 2, 3], now=100.0, startup_timeout=600.0)
    # Ranks 0-2 start in 5 to 20 s (a loaded host); rank 3 never beats.
    starts = {0: 5.0, 1: 12.0, 2: 20.0}
    found = []
    t = 100.0
    while t < 200.0 and not found:
        for r, after in starts.items():
            if t >= 100.0 + after:
                d.beat(r, f"{int(t * 100)} 0 0 0 idle", t)
        found = d.check(t, running=False)
        t += 1.0
    (s,) = found
    assert s.rank == 3 and s.at == pytest.approx(100.0 + 61.0)  # 3 x the slowest (20 s), from its start
    assert "no heartbeat in 61.0 s" in s.cause and "the slowest in 20.0 s" in s.cause


def test_start_ups_get_at_least_the_floor_and_nobody_is_declared_while_nobody_started():
    d = _watched([0, 1, 2], startup_timeout=600.0)
    for t in range(0, 1000):
        assert d.check(float(t), running=False) == []  # a host too slow to start anyone: no blame
    assert d.nobody_started  # ... past the ceiling, said once so the run can give up
    d = _watched([0, 1, 2], startup_timeout=600.0)
    d = _watched([0, 1, 2], startup_timeout=600.0)
    found = _run(d, {0: _regular(), 1: _regular()}, start=1.0, until=40.0, running=False)
    ((rank, at, _),) = found
    # the floor, 30 s, though its peers started at once
    assert rank == 2 and 30.0 < at <= 30.0 + 2 * POLL and not d.nobody_started
    alone = _watched([4], startup_timeout=20.0)
    ((rank, at, s),) = _run(alone, {}, until=25.0)  # no peers at all: the ceiling
    assert rank == 4 and 20.0 < at <= 20.0 + 2 * POLL and "no heartbeat in 20." in s.cause


def test_beat_rates_count_sequence_numbers_not_polls():
    d = _watched([0, 1])
    # Rank 1's sequence advances half as fast (its process runs half the time), though the
    # supervisor sees both change at every poll.
    for step in range(100):
        now = step * POLL
        d.beat(0, f"{2 * step} 0 1 0 run", now)
        d.beat(1, f"{step} 0 1 0 run", now)
    rates = d.beat_rates(99 * POLL)
    assert rates[0] == pytest.approx(2 / POLL, rel=0.05) and rates[1] == pytest.approx(1 / POLL, rel=0.05)


def test_a_stall_blames_the_rank_in_compute_not_those_waiting_for_it():
    d = _detector(stall_timeout=5.0)
    for r in (0, 1, 2):
        d.watch(r, 0.0)
    for t in range(0, 12):
        d.beat(0, f"{t} 0 3 17 wait", float(t))
        d.beat(1, f"{t} 0 3 40 run", float(t))  # beats, but its op count stopped: stuck computing
        d.beat(2, f"{t} 0 3 22 wait", float(t))
        found = d.check(float(t), running=True)
        if found:
            break
    assert [s.rank for s in found] == [1] and t == 6 and "stuck in an op" in found[0].cause
    assert not d.stalled_waiting


def test_a_rank_writing_the_runs_last_checkpoint_is_not_stuck_until_its_own_bound():
    # The run's last iteration is done: rank 1 waits for its side thread to write its stage's last
    # checkpoint (state "finish", no ops counted) while rank 0 is done. The stall rule's 10 s would
    # kill it mid-write; a finishing rank is stuck only after `finish_timeout` (120 s here).
    d = _detector(stall_timeout=10.0)
    assert d.finish_timeout == 120.0
    for r in (0, 1):
        d.watch(r, 0.0)
    t = 0.0
    while t <= d.finish_timeout:
        d.beat(0, f"{int(t)} 0 3 40 idle", t)
        d.beat(1, f"{int(t)} 0 3 40 finish", t)
        assert d.check(t, running=True) == [], t
        t += 1.0  # (a check at least every heartbeat_timeout / 2: longer is the detector's own blindness)
    d.beat(0, f"{int(t)} 0 3 40 idle", t)
    d.beat(1, f"{int(t)} 0 3 40 finish", t)
    (found,) = d.check(t, running=True)
    assert found.rank == 1 and found.cause.startswith("stuck finishing (its last checkpoint or weights) for")


def test_no_stall_while_reconfiguring_or_idle_and_no_blame_when_all_wait():
    d = _detector(stall_timeout=5.0)
    for r in (0, 1):
        d.watch(r, 0.0)
        d.beat(r, "1 0 3 5 idle", 0.0)
    for t in range(1, 20):
        for r in (0, 1):
            d.beat(r, f"{t} 0 3 5 idle", float(t))
        assert d.check(float(t), running=True) == []  # finished workers are not stalled
    d.restart_progress(20.0)
    for t in range(21, 40):
        for r in (0, 1):
            d.beat(r, f"{t} 0 4 9 wait", float(t))
        assert d.check(float(t), running=False) == []  # not while the supervisor reconfigures
    assert d.check(40.0, running=True) == [] and d.stalled_waiting  # everyone waits: nobody to blame


def test_beats_parse_and_print():
    assert Beat.parse("3 1 7 42 run") == Beat(3, 1, 7, 42, "run")
    assert str(Beat(3, 1, 7, 42, "run")) == "3 1 7 42 run"
    assert Beat.parse("junk") is None and Beat.parse("a b c d e") is None
    # with the stall clock's milliseconds (schedc.live.stall)
    assert Beat.parse("3 1 7 42 run 250") == Beat(3, 1, 7, 42, "run", 250)
    assert str(Beat(3, 1, 7, 42, "run", 250)) == "3 1 7 42 run 250" and Beat.parse("3 1 7 42 run x") is None


# -- rollback -----------------------------------------------------------------------------

def _stage(optimizer: str):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    params = list(module.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1), "adam": lambda: torch.optim.Adam(params, lr=0.01),
           "adamw": lambda: torch.optim.AdamW(params, lr=0.01)}[optimizer]()
    return module, opt


def _step(module, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    module(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
    opt.step()


def _state(module, opt):
    return ({k: v.clone() for k, v in module.state_dict().items()},
            {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()})


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_restoring_the_copy_undoes_a_step_exactly_and_the_redo_is_bitwise_equal(optimizer):
    module, opt = _stage(optimizer)
    snap = StepSnapshot(module, opt)
    for k in range(3):  # the first take: no optimizer state yet (Adam's appears at the first step)
        before = _state(module, opt)
        snap.take(k)
        _step(module, opt, seed=k)
        after = _state(module, opt)
        assert roll_back(k + 1, k, snap)
        assert _state(module, opt)[0].keys() == before[0].keys()
        for key in before[0]:
            assert torch.equal(module.state_dict()[key], before[0][key])
        assert len(opt.state) == len(before[1])
        for p, s in before[1].items():
            for key, v in s.items():
                assert torch.equal(opt.state[p][key], v) if torch.is_tensor(v) else opt.state[p][key] == v
        _step(module, opt, seed=k)  # running the iteration again gives the same state, bit for bit
        for key, v in after[0].items():
            assert torch.equal(module.state_dict()[key], v)


def test_the_copy_is_taken_into_the_same_buffers_and_its_size_is_known():
    module, opt = _stage("adam")
    snap = StepSnapshot(module, opt)
    snap.take(0)
    _step(module, opt, 0)
    snap.take(1)
    buffers = [b.data_ptr() for b in snap.buffers()]
    _step(module, opt, 1)
    snap.take(2)
    assert [b.data_ptr() for b in snap.buffers()] == buffers
    n_params = sum(p.numel() for p in module.parameters())
    assert snap.nbytes == 4 * n_params * 3 + 4 * len(list(module.parameters()))  # weights, m, v (+ step)
    assert snap.host_bytes == snap.nbytes and snap.device_bytes == 0  # one copy on a CPU unless overlapped


def test_emulated_ranks_keep_no_copy():
    snap = StepSnapshot(None, None)
    snap.take(4)
    assert snap.nbytes == 0 and roll_back(5, 4, snap)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.booleans())
def test_the_target_is_the_fewest_steps_when_they_differ_by_at_most_one(base, spread):
    steps = [base[0] + (x % 2 if spread else 0) for x in base]
    assert rollback_target(steps) == min(steps)


def test_states_more_than_one_step_apart_are_a_bug_not_a_rollback():
    with pytest.raises(RollbackError):
        rollback_target([3, 5])
    snap = StepSnapshot(None, None)
    snap.take(2)
    with pytest.raises(RollbackError):
        roll_back(5, 3, snap)  # two steps ahead
    with pytest.raises(RollbackError):
        roll_back(4, 3, snap)  # the copy is from before another step


# -- checkpoints ----------------------------------------------------------------------------

def test_a_checkpoint_appears_whole_or_not_at_all(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint.write_stage(root, 4, 0, {"steps": 4, "model": {"w": torch.ones(2)}, "optimizer": None})
    assert checkpoint.latest(root) is None  # one stage of two: nothing complete yet
    with pytest.raises(schedc.RunError, match="lacks stages"):
        checkpoint.complete(root, 4, 2, {})
    checkpoint.write_stage(root, 4, 1, {"steps": 4, "model": {}, "optimizer": None})
    done = checkpoint.complete(root, 4, 2, {"spec": "x"})
    assert done.path.name == "iter-000004" and checkpoint.latest(root) == done
    assert (root / "latest").read_text().strip() == "iter-000004"
    assert torch.equal(checkpoint.load_stage(done, 0)["model"]["w"], torch.ones(2))
    assert checkpoint.read(done.path).iteration == 4


def test_a_run_killed_while_it_seals_a_step_again_keeps_that_step(tmp_path, monkeypatch):
    # Step 4 sealed, rolled back, written and sealed again: killed between moving the old iter-4
    # aside and renaming the new one into place, the run leaves both copies and no iter-4. The next
    # start puts the newer back (it removed both: the newest checkpoint was gone).
    root = tmp_path / "ckpt"
    for steps in (2, 4, 4):
        for stage in (0, 1):
            checkpoint.write_stage(root, steps, stage, {"steps": steps, "model": {"w": torch.full((2,), steps)},
                                                        "optimizer": None})
        if (root / "iter-000004").exists():
            real = os.replace

            def killed_as_it_moves_the_new_one_in(src, dst):
                if Path(dst).name == "iter-000004" and (root / ".replaced-000004").exists():
                    raise KeyboardInterrupt("killed")  # (the old iter-4 is aside, the new one not yet in)
                real(src, dst)

            monkeypatch.setattr(checkpoint.os, "replace", killed_as_it_moves_the_new_one_in)
            with pytest.raises(KeyboardInterrupt):
                checkpoint.complete(root, steps, 2, {})
            monkeypatch.setattr(checkpoint.os, "replace", real)
        else:
            checkpoint.complete(root, steps, 2, {})
    left = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert left == [".partial-000004", ".replaced-000004", "iter-000002"], left
    checkpoint.clean_partials(root)
    assert [c.iteration for c in checkpoint.complete_checkpoints(root)] == [2, 4]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter-000002", "iter-000004"]


def _sealed(root: Path, *steps: int) -> None:
    for k in steps:
        checkpoint.write_stage(root, k, 0, {"steps": k, "model": {}, "optimizer": None})
        checkpoint.complete(root, k, 1, {"emulate": True}, keep=len(steps))


_PLAN = dict(emulate=True, optimizer="sgd", iterations=10)


def test_resuming_past_a_damaged_checkpoint_says_which_and_why(tmp_path):
    """A corrupt meta.json made --resume take the checkpoint before it without a word."""
    root = tmp_path / "ckpt"
    _sealed(root, 2, 4, 6)
    (root / "iter-000006" / "meta.json").write_text('{"format": "schedc.checkpoint/v1", "iter')
    (root / "iter-000004" / "meta.json").unlink()
    found, notes = checkpoint.RunCheckpoints(root, stages=1, keep=2).prepare(resume=True, every=0, **_PLAN)
    assert found.iteration == 2
    assert len(notes) == 2 and notes[0] == (f"warning: skipped checkpoint `{root / 'iter-000004'}`: it has no "
                                            "meta.json; resuming from the older `iter-000002`")
    assert notes[1].startswith(f"warning: skipped checkpoint `{root / 'iter-000006'}`: its meta.json is not valid "
                               "JSON (Unterminated string")
    assert notes[1].endswith("resuming from the older `iter-000002`")
    (root / "iter-000002" / "meta.json").write_text("[]")  # JSON, but no checkpoint's (it was E000)
    with pytest.raises(schedc.RunError) as exc:
        checkpoint.RunCheckpoints(root, stages=1, keep=2).prepare(resume=True, every=0, **_PLAN)
    (d,) = exc.value.diagnostics
    assert d.code == "E570"
    assert d.message == f"no checkpoint in `{root}` can be resumed: 3 damaged one(s), none complete"
    assert d.detail.splitlines()[0] == "  = note: skipped `iter-000002`: its meta.json is not a schedc.checkpoint/v1 " \
                                       "checkpoint's"


def test_older_checkpoints_are_pruned_and_leftovers_cleaned(tmp_path):
    root = tmp_path / "ckpt"
    for k in (2, 4, 6):
        checkpoint.write_stage(root, k, 0, {"steps": k, "model": {}, "optimizer": None})
        checkpoint.complete(root, k, 1, {}, keep=2)
    assert [c.iteration for c in checkpoint.complete_checkpoints(root)] == [4, 6]
    checkpoint.write_stage(root, 8, 0, {"steps": 8, "model": {}, "optimizer": None})  # a run killed here
    (root / ".latest.tmp").write_text("junk")
    assert checkpoint.latest(root).iteration == 6
    removed = checkpoint.clean_partials(root)
    assert sorted(p.name for p in removed) == [".latest.tmp", ".partial-000008"]
    assert sorted(p.name for p in root.iterdir()) == ["iter-000004", "iter-000006", "latest"]


def test_a_prune_cut_short_leaves_no_checkpoint_without_its_meta(tmp_path, monkeypatch):
    """A run killed while it removes an old checkpoint: the old one is renamed away first, so
    every `iter-` folder left is whole, and the next start removes the rest."""
    root = tmp_path / "ckpt"
    for k in (2, 4):
        checkpoint.write_stage(root, k, 0, {"steps": k, "model": {}, "optimizer": None})
        checkpoint.complete(root, k, 1, {}, keep=2)
    real = checkpoint.shutil.rmtree

    def dies_half_way(path, ignore_errors=False):
        path = Path(path)
        if (path.name.startswith(".replaced-") or path.name.startswith("iter-")) and (path / "meta.json").exists():
            (path / "meta.json").unlink()  # what rmtree removed before the kill
            raise KeyboardInterrupt
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dies_half_way)
    checkpoint.write_stage(root, 6, 0, {"steps": 6, "model": {}, "optimizer": None})
    with pytest.raises(KeyboardInterrupt):
        checkpoint.complete(root, 6, 1, {}, keep=2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    assert all((p / "meta.json").is_file() for p in root.iterdir() if p.name.startswith("iter-"))
    assert [c.iteration for c in checkpoint.complete_checkpoints(root)] == [4, 6]
    checkpoint.clean_partials(root)
    assert sorted(p.name for p in root.iterdir()) == ["iter-000004", "iter-000006", "latest"]


def test_a_damaged_checkpoint_is_a_diagnostic(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint.write_stage(root, 2, 0, {"steps": 2, "model": {}, "optimizer": None})
    done = checkpoint.complete(root, 2, 1, {})
    done.stage_file(0).write_bytes(b"not a checkpoint")
    with pytest.raises(schedc.RunError, match="cannot read stage 0"):
        checkpoint.load_stage(done, 0)
    done.stage_file(0).write_bytes(b"\x80\x04garbage" * 10)  # (a pickle's start: torch advised loading it unsafely)
    with pytest.raises(schedc.RunError) as exc:
        checkpoint.load_stage(done, 0)
    text = exc.value.render()
    assert "it is damaged, or not a file schedc wrote" in text and "weights_only" not in text
    with pytest.raises(schedc.RunError, match="E570|not a complete"):
        checkpoint.read(tmp_path)


# -- the store protocol ----------------------------------------------------------------------

def test_generations_queues_and_heartbeats_over_a_real_store():
    job = JobStore.serve()
    worker = JobStore.connect(job.host, job.port)
    gen = Generation(3, (0, 2), {"dp": 2, "programs": {"0": "rank_0.py", "2": "rank_2.py"}}, restore=None,
                     injections=({"index": 0},), reason="fail rank 1")
    job.announce(gen, {"rank_0.py": "def iteration(rt): pass\n", "rank_2.py": "x = 2\n", "main.py": "no"})
    assert worker.latest_generation() == 3 and worker.generation(3) == gen
    assert worker.program_file(3, "rank_2.py") == "x = 2\n"
    assert not worker.store.check(["gen/3/file/main.py"])  # only the files the manifest names travel
    worker.report(IterationDone(rank=0, it=1, t0=0.0, t1=1.0))
    worker.report(IterationDone(rank=2, it=2, t0=0.0, t1=1.0, loss=0.5))
    assert [(m.rank, m.it, m.loss) for m in job.reports()] == [(0, 1, None), (2, 2, 0.5)] and job.reports() == []
    job.command(1, StartRanks((4,)))
    assert worker.commands(1) == [StartRanks((4,))] and worker.commands(0) == []
    worker.join(3, 0)
    assert not job.all_joined(3, (0, 2))
    worker.join(3, 2)
    # A store `set` is not acknowledged: another connection sees it a moment later, not at once.
    wait_until(lambda: job.all_joined(3, (0, 2)), "rank 2's join in the store")
    assert job.aborted() == -1 and not worker.stopped()
    assert worker.progress_of() == (-1, -1)
    job.set_progress(20, 2)  # (iteration 20, done by generation 2: a later one may run older iterations again)
    beats = []
    hb = Heartbeat(worker.clone(), 2, 0.01, lambda: f"{len(beats)} 3 0 0 run").start()
    wait_until(lambda: 2 in job.heartbeats([0, 2]), "rank 2's first heartbeat in the store")
    assert list(job.heartbeats([0, 2])) == [2]
    job.abort(3)
    job.stop("done")
    try:
        wait_until(lambda: hb.aborted == 3 and hb.stopped, "the heartbeat thread to read abort 3 and stop",
                   state=lambda: (hb.aborted, hb.stopped))
        assert (hb.progress, hb.progress_generation) == (20, 2) and worker.progress() == 20
    finally:
        hb.halt()


def test_a_worker_whose_supervisor_is_gone_leaves(monkeypatch):
    import schedc.live.membership as m

    monkeypatch.setattr(m, "ORPHAN_TIMEOUT", 0.2)
    job = JobStore.serve()
    worker = JobStore.connect(job.host, job.port, timeout=1.0)
    orphaned = []
    hb = Heartbeat(worker, 0, 0.02, lambda: "1 0 0 0 idle", on_orphaned=lambda: orphaned.append(os.getpid()))
    worker.store.set_timeout(__import__("datetime").timedelta(seconds=0.1))
    hb.start()
    try:
        # The worker was connected and beating before its supervisor went: its beat is in the store.
        wait_until(lambda: 0 in job.heartbeats([0]), "the worker's first heartbeat in the store")
        assert not orphaned
        del job  # the supervisor's store goes away
        import gc

        gc.collect()
        wait_until(lambda: orphaned, "the heartbeat thread to call on_orphaned")
    finally:
        hb.halt()



def test_a_worker_whose_host_has_a_new_agent_stops_before_it_joins_another_generation():
    # Host 1's agent died and a new one took its lease (a restarted `schedc agent`): the old one's
    # workers can no longer be signalled, and their exits would never be reported. The supervisor
    # counts them lost at the new agent's registration; each stops by itself: at its next beat
    # (before it beats), or before it takes part in a generation it found (`check_agent`). A worker
    # knows its starter's lease from its start, so one that starts late does not take the new one's.
    job = JobStore.serve()
    worker = JobStore.connect(job.host, job.port, timeout=1.0)
    assert job.claim_agent(1, "", "pid 11 on a #1") == "pid 11 on a #1"
    replaced, untouched = [], []
    hb = Heartbeat(worker.clone(), 4, 0.02, lambda: "1 0 0 0 idle", (1, "pid 11 on a #1"),
                   on_replaced=replaced.append)
    host0 = Heartbeat(worker.clone(), 0, 0.02, lambda: "1 0 0 0 idle", on_replaced=untouched.append)
    hb.check_agent(worker)
    assert not replaced  # (its own agent holds the lease)
    job.claim_agent(1, "pid 11 on a #1", "pid 12 on a #2")
    hb.check_agent(worker)  # (the main thread, before its heartbeat thread ever ran)
    assert replaced == ["schedc train: rank 4: host 1 has a new agent (pid 12 on a); the one that started this "
                        "process is gone, so it stops\n"]
    hb.start()  # (its first turn finds the new agent before it beats: no beat of it ever reaches the store)
    host0.start()  # (host 0's agent runs in the supervisor: no lease is read)
    try:
        wait_until(lambda: len(replaced) == 2 and 0 in job.heartbeats([0]), "the heartbeat thread to see the "
                   "new agent", state=lambda: replaced)
        assert 4 not in job.heartbeats([4]) and not untouched
    finally:
        hb.halt()
        host0.halt()



class _HostsSup:
    """A supervisor's host bookkeeping alone (`schedc.live.hosts.Hosts`) over fakes: rank r runs on
    host r // 2; what it starts, notes and suspects is recorded."""

    def __new__(cls):
        from types import SimpleNamespace

        from schedc.live.hosts import Hosts
        from schedc.live.protocol import Phase

        class Sup(Hosts):
            pass

        sup = Sup()
        sup.started, sup.notes, sup.suspects = [], [], []
        sup.fleet = SimpleNamespace(up=set(), left=set(), leases={1: "old"}, retired=set(), host_of=lambda r: r // 3,
                                    start=sup.started.extend)
        sup.alive, sup._started_by, sup.hosts_gone = set(), {}, set()
        sup.epoch, sup.phase, sup.physical = 0, Phase.RUNNING, {}
        sup.detector = Detector(heartbeat_timeout=3.0, stall_timeout=10.0, startup_timeout=60.0)
        sup._note = lambda kind, message, **details: sup.notes.append(message)
        sup._suspect = sup.suspects.append
        sup.rejoins = sup.slowness = SimpleNamespace(lost=lambda r: None)
        return sup


def test_a_new_agent_fails_only_its_old_agents_processes_and_starts_again_those_that_never_said_they_run():
    # Host 1 runs ranks 3, 4 and 5 (host of rank r: r // 3): rank 3 said it runs under the old agent
    # ("old"); rank 4's process was commanded and never said it runs (lost with the old agent, or
    # to be started by the new one, which carries out the host's queued commands); rank 5's
    # replacement, started by the new agent ("new"), said so before the new agent's registration
    # was read (reports and events are two queues). A late `Started` of an old agent's process
    # after the new agent registered is not the rank's.
    from schedc.live.protocol import AgentUp, Started

    sup = _HostsSup()
    sup.alive = {0, 1, 3, 4, 5, 6}
    for r in sup.alive:
        sup.detector.watch(r, 0.0)
    for r, agent in ((0, ""), (1, ""), (3, "old"), (5, "new"), (6, "other")):  # (rank 6: host 2's)
        sup._on_started(Started(r, 100 + r, r // 3, agent=agent), 1.0)
    assert sup._started_by == {0: "", 1: "", 3: "old", 5: "new", 6: "other"}
    sup._on_agent_up(AgentUp(host=1, pid=7, t=0.0, agent="new"), 2.0)
    assert sup.started == [4]  # (the new agent starts it unless it runs it already)
    assert sup.alive == {0, 1, 4, 5, 6} and sup.fleet.leases[1] == "new" and sup.fleet.retired == {"old"}
    assert [(s.rank, s.maybe_healthy) for s in sup.suspects] == [(3, "its process was lost with host 1's old agent")]
    assert "the process(es) of rank(s) [3] that its old agent ran are lost with it" in sup.notes[-1]
    sup._on_started(Started(4, 104, 1, agent="old"), 3.0)  # (late, from the old agent: it stops by itself)
    assert 4 not in sup._started_by
    sup._on_started(Started(4, 204, 1, agent="new"), 3.1)
    assert sup._started_by[4] == "new"
    # The new agent's processes survive its registration read again; host 0's never registers anew.
    sup.suspects.clear()
    sup._on_agent_up(AgentUp(host=1, pid=7, t=0.0, agent="new"), 4.0)
    sup._on_agent_up(AgentUp(host=0, pid=1, t=0.0), 4.0)
    assert sup.suspects == [] and sup.alive == {0, 1, 4, 5, 6} and sup.started == [4]

# -- review regressions --------------------------------------------------------------------

class _Transport:
    """A stand-in transport whose n-th stage all-reduce is interrupted (None: never)."""

    def __init__(self, interrupt_at: int | None):
        self.calls, self.interrupt_at = 0, interrupt_at

    def all_reduce_stage(self, stage, tensor):
        self.calls += 1
        if self.calls == self.interrupt_at:
            from schedc.runtime.transport import Interrupted

            raise Interrupted("test")

    def barrier(self, what):
        pass


@pytest.mark.parametrize("interrupt_at, stepped", [(1, False), (2, False), (None, True)])
def test_a_step_is_counted_exactly_when_it_is_applied(tmp_path, interrupt_at, stepped):
    """The last stage reduces its loss (call 1) and gradients (call 2) before stepping; an interruption
    at either leaves weights and count as they were, and nothing can interrupt between step and count."""
    from live_support import compiled
    from schedc.runtime import load_manifest
    from schedc.runtime.primitives import Runtime
    from schedc.runtime.transport import Interrupted

    out = compiled(tmp_path, dp=2, pp=2)
    manifest = load_manifest(out)
    rank = manifest.stage_groups[-1][0]
    rt = Runtime(manifest, rank, _Transport(interrupt_at), reduce_loss=True)
    for p in rt.params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in rt.params]
    if interrupt_at:
        with pytest.raises(Interrupted):
            rt.optimizer_step()
    else:
        rt.optimizer_step()
    changed = any(not torch.equal(a, p) for a, p in zip(before, rt.params))
    assert (rt.steps_done, changed) == ((1, True) if stepped else (0, False))


def test_a_replacement_does_not_inherit_its_predecessors_heartbeat():
    job = JobStore.serve()
    job.beat(3, "7 1 4 20 run")
    assert list(job.heartbeats([3])) == [3]
    job.forget_heartbeat(3)
    assert job.heartbeats([3]) == {}


def test_sealing_a_boundary_again_keeps_the_old_checkpoint_until_the_new_one_is_in(tmp_path):
    root = tmp_path / "ckpt"
    for value in (1.0, 2.0):  # the same boundary, written again after a rollback
        checkpoint.write_stage(root, 4, 0, {"steps": 4, "model": {"w": torch.full((1,), value)}, "optimizer": None})
        done = checkpoint.complete(root, 4, 1, {})
    assert float(checkpoint.load_stage(done, 0)["model"]["w"]) == 2.0
    assert sorted(p.name for p in root.iterdir()) == ["iter-000004", "latest"]
    (root / ".replaced-000004").mkdir()  # a run killed between the two renames
    assert [p.name for p in checkpoint.clean_partials(root)] == [".replaced-000004"]


def test_checkpoint_reports_of_a_generation_rolled_back_past_them_do_not_count(tmp_path):
    asm = checkpoint.RunCheckpoints(tmp_path, stages=2, keep=2)
    asm.resumed(0, 0)
    asm.resumed(1, 3)  # generation 1 resumed at 3: steps 4 and later were undone
    for stage in (0, 1):
        checkpoint.write_stage(tmp_path, 4, stage, {"steps": 4, "model": {}, "optimizer": None}, 0)
        assert asm.stage_written(0, 4, stage, {}) is None  # written by generation 0, then undone
    assert asm.written == {}
    for stage in (0, 1):
        checkpoint.write_stage(tmp_path, 4, stage, {"steps": 4, "model": {}, "optimizer": None}, 1)
    assert asm.stage_written(1, 4, 0, {}) is None  # one stage of two
    done = asm.stage_written(1, 4, 1, {"generation": 1})
    assert done is not None and done.path.name == "iter-000004" and done.iteration == 4
    assert asm.paths == [str(done.path)] and asm.latest_own() == done


def test_checkpoint_reports_of_the_layout_before_a_re_partition_do_not_count(tmp_path):
    # 3 stages re-partitioned as 2 from generation 1 on: stage files 1 and 2 of the old layout's
    # step 8 arriving late must not fill (or crash) the 2-stage checkpoint of step 8.
    asm = checkpoint.RunCheckpoints(tmp_path, stages=3, keep=2)
    asm.resumed(0, 0)
    for stage in (0, 1):
        checkpoint.write_stage(tmp_path, 8, stage, {"steps": 8, "model": {}, "optimizer": None}, 0)
        assert asm.stage_written(0, 8, stage, {}) is None
    asm.relayout(2, 1)
    assert asm.stages == 2 and asm.written == {}
    checkpoint.write_stage(tmp_path, 8, 2, {"steps": 8, "model": {}, "optimizer": None}, 0)
    assert asm.stage_written(0, 8, 2, {}) is None and asm.written == {}
    asm.resumed(1, 7)
    for stage in (0, 1):
        checkpoint.write_stage(tmp_path, 8, stage, {"steps": 8, "model": {}, "optimizer": None}, 1)
    assert asm.stage_written(1, 8, 0, {}) is None  # the new layout writes step 8 again
    done = asm.stage_written(1, 8, 1, {"generation": 1})
    assert done is not None and done.meta["stages"] == 2


def test_a_late_stage_file_of_the_layout_before_never_replaces_the_new_layouts(tmp_path):
    # Generation 0 (3 stages) queued its stage 1 of step 8 on its side thread; the job is
    # re-partitioned into 2 stages from generation 1, which writes its stage 1 of step 8 first.
    # The old writer's file lands after it: the sealed checkpoint holds the new layout's file.
    asm = checkpoint.RunCheckpoints(tmp_path, stages=3, keep=2)
    asm.resumed(0, 0)
    asm.relayout(2, 1)
    asm.resumed(1, 7)
    for stage in (0, 1):
        checkpoint.write_stage(tmp_path, 8, stage, {"steps": 8, "model": {"w": torch.full((1,), 1.0)},
                                                    "optimizer": None}, 1)
    checkpoint.write_stage(tmp_path, 8, 1, {"steps": 8, "model": {"w": torch.full((1,), 0.0)}, "optimizer": None}, 0)
    assert asm.stage_written(0, 8, 1, {}) is None
    assert asm.stage_written(1, 8, 0, {}) is None
    done = asm.stage_written(1, 8, 1, {})
    assert [float(checkpoint.load_stage(done, s)["model"]["w"]) for s in (0, 1)] == [1.0, 1.0]
    assert sorted(p.name for p in done.path.iterdir()) == ["meta.json", "stage-0.pt", "stage-1.pt"]


def test_a_late_seal_neither_prunes_nor_replaces_the_checkpoint_a_generation_restores(tmp_path):
    # keep 1: generation 2 restores iter-4 (a stage lost, the job restarts from it) while the
    # stage files generation 0 queued before the failure still come in, for steps 4 and 6.
    asm = checkpoint.RunCheckpoints(tmp_path, stages=1, keep=1)
    asm.resumed(0, 0)
    checkpoint.write_stage(tmp_path, 4, 0, {"steps": 4, "model": {}, "optimizer": None}, 0)
    four = asm.stage_written(0, 4, 0, {})
    asm.announced(2, str(four.path))
    checkpoint.write_stage(tmp_path, 4, 0, {"steps": 4, "model": {}, "optimizer": None}, 1)
    assert asm.stage_written(1, 4, 0, {}) is None  # not sealed again while it is read
    checkpoint.write_stage(tmp_path, 6, 0, {"steps": 6, "model": {}, "optimizer": None}, 0)
    six = asm.stage_written(0, 6, 0, {})
    assert [c.iteration for c in checkpoint.complete_checkpoints(tmp_path)] == [4, 6]  # iter-4 kept
    assert checkpoint.load_stage(four, 0)["steps"] == 4
    asm.resumed(2, 4)  # generation 2 is ready: iter-4 is an older checkpoint like any other
    checkpoint.write_stage(tmp_path, 8, 0, {"steps": 8, "model": {}, "optimizer": None}, 2)
    asm.stage_written(2, 8, 0, {})
    assert [c.iteration for c in checkpoint.complete_checkpoints(tmp_path)] == [8] and six is not None


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_phi_must_be_a_positive_number(value):
    from schedc.diagnostics import RunError
    from schedc.live.options import TrainOptions

    with pytest.raises(RunError) as exc:
        TrainOptions(phi=value).check()
    assert exc.value.codes == ["E555"] and "phi must be a positive number" in exc.value.diagnostics[0].message
    TrainOptions(phi=12.0).check()


def test_a_plan_laid_out_on_other_pipelines_trains_the_jobs_microbatches_in_order():
    from schedc.runtime.manifest import Manifest

    base = dict(spec="s", schedc_version="0", pp=1, live_ranks=(0,), coords={0: (0, 0)}, stage_groups=((0,),),
                programs={}, source="m:f", data=None, partition=None, optimizer="sgd", lr=0.1, iterations=1,
                decouple_backward=True, stagger_optimizer=True)
    job = Manifest(dp=2, microbatches=3, **base)
    assert [job.data_index(d, m) for d in range(2) for m in range(3)] == [(d, m) for d in range(2) for m in range(3)]
    one = Manifest(dp=1, microbatches=6, data_microbatches=3, **base)  # the job's 2 x 3 as 1 x 6
    assert [one.data_index(0, m) for m in range(6)] == [(d, m) for d in range(2) for m in range(3)]
    three = Manifest(dp=3, microbatches=2, data_microbatches=3, **base)  # ... and as 3 x 2
    assert sorted(three.data_index(d, m) for d in range(3) for m in range(2)) == \
        [(d, m) for d in range(2) for m in range(3)]
    assert "data_microbatches" not in job.to_json() and Manifest.from_json(one.to_json()) == one


def test_a_host_whose_last_beat_arrives_late_is_still_found_gone():
    """A beat an agent sent just before its host was taken back can reach the store after the
    supervisor read the count: one beat more is not an answer, two are (an agent waits for the
    store to take each beat before it sends the next, so at most one is ever on its way)."""
    from types import SimpleNamespace

    from schedc.live.agent import Fleet

    class Beats:
        def __init__(self):
            self.reads = {1: 0, 2: 0}

        def agent_beats(self, host: int) -> int:
            self.reads[host] += 1
            if host == 1:  # dead: the one late beat shows from the second read on, then nothing
                return 7 if self.reads[host] == 1 else 8
            return 100 + self.reads[host]  # alive: a beat between any two reads

    gone: list[int] = []
    answered = Fleet.answers(SimpleNamespace(job=Beats(), _gone_at={}), [0, 1, 2], 0.3, gone.append)
    assert answered == {0, 2} and gone == [1]


def test_a_rename_carries_a_members_failure_over_to_its_new_number():
    """Found by the simulation (seed 1931): a survivor of a re-partition found failed while the
    processes without a place in the new layout end, before the survivors are renamed, was then
    taken for the new layout's member of the same number, a healthy one, and the run hung. The
    rename carries each suspect over to its new number, and drops those without a place."""
    from types import SimpleNamespace

    from schedc.live.detect import Suspect
    from schedc.live.relayout import Relayout

    renames = []
    sup = Relayout()
    sup.epoch, sup._renames, sup.dead = 0, {}, {1, 4, 7}
    sup.job = SimpleNamespace(put_rename=lambda epoch, renamed: renames.append((epoch, renamed)), epoch=0)
    sup.fleet = SimpleNamespace(rename=lambda epoch, renamed: None)
    sup.detector = SimpleNamespace(watching=lambda: [], forget=lambda r: None)
    sup.alive, sup.shadows_held, sup._error_exits, sup._started_by = {0, 3, 5}, set(), {}, {3: "a", 4: "b"}
    sup._suspects = {2: Suspect(2, "killed by SIGKILL", False, 1.78), 6: Suspect(6, "killed by SIGKILL", False, 1.8)}
    sup._rename({0: 0, 2: 1, 3: 2})  # (old rank 6 has no place in the new layout)
    assert sup._suspects == {1: Suspect(1, "killed by SIGKILL", False, 1.78)}
    assert sup.alive == {0, 2} and sup.dead == set() and renames == [(1, {0: 0, 2: 1, 3: 2})]
    assert sup._started_by == {2: "a"}  # (which agent started each process: under its new number)


def test_an_agent_started_mid_run_numbers_its_ranks_in_the_newest_epoch():
    """An agent restarted (or started again for a host found gone) after in-place re-partitions:
    the ranks it starts are numbered in the newest epoch, so its exits say that epoch (they were
    said in epoch 0 and renamed again by the supervisor: another rank declared failed), and a
    rename queued before it started does not take its numbering back."""
    from schedc.live.agent import Agent

    class Job:
        events: list = []

        def epoch_now(self):
            return 2

        def event(self, ev):
            self.events.append(ev)

    agent = Agent(Job(), 1)
    assert agent.epoch == 2
    agent.rename(1, {0: 1})
    assert agent.epoch == 2
    agent.rename(3, {1: 0})
    assert agent.epoch == 3



def test_an_agent_busy_starting_a_process_still_beats_so_its_host_is_not_taken_for_gone():
    # A remote agent's loop blocks while it starts a worker (a new forkserver imports torch for
    # seconds). Its beats come from a thread of their own, so the supervisor's question "two more
    # beats within a second?" (`Fleet.answers`) is answered meanwhile: the host is busy, not gone.
    import threading

    from schedc.live.agent import Agent, Fleet
    from schedc.live.protocol import AgentLeft

    job = JobStore.serve()
    agent = Agent(JobStore.connect(job.host, job.port, timeout=5.0), 1)
    agent.local.warm = lambda: None  # (no forkserver: nothing is started here)
    starting, release = threading.Event(), threading.Event()
    agent.start = lambda ranks: (starting.set(), release.wait(30.0))  # (the loop blocks, as in a slow start)
    served = threading.Thread(target=agent.serve, daemon=True)
    served.start()
    try:
        wait_until(lambda: job.agent_beats(1) > 0, "the agent's first beat")
        job.command(1, StartRanks((4,)))
        wait_until(starting.is_set, "the agent to begin the start")
        fleet = Fleet.__new__(Fleet)  # (its store only: no agent of its own)
        fleet.job, fleet._gone_at = job, {}
        gone = []
        assert fleet.answers([1], 5.0, gone.append) == {1} and gone == []
    finally:
        release.set()
        job.stop("finished")
        served.join(timeout=10.0)
    assert not served.is_alive()
    assert any(isinstance(ev, AgentLeft) and ev.host == 1 for ev in job.events())


def test_an_agent_whose_loop_is_wedged_longer_than_any_start_stops_beating(monkeypatch):
    # Beats from a thread would keep a wedged agent looking alive for ever (replacement starts
    # queued there, an operator's new agent refused): they stop once its loop has not turned for
    # longer than any start may take (150 s; 0.3 s here), and its host is found gone.
    import threading

    import schedc.live.agent as agent_module
    from schedc.live.agent import Agent, Fleet

    monkeypatch.setattr(agent_module, "LEAVE_WAIT_BUSY", 0.3)
    job = JobStore.serve()
    agent = Agent(JobStore.connect(job.host, job.port, timeout=5.0), 1)
    agent.local.warm = lambda: None
    release = threading.Event()
    agent.start = lambda ranks: release.wait(60.0)
    served = threading.Thread(target=agent.serve, daemon=True)
    served.start()
    try:
        wait_until(lambda: job.agent_beats(1) > 0, "the agent's first beat")
        job.command(1, StartRanks((4,)))
        fleet = Fleet.__new__(Fleet)
        fleet.job, fleet._gone_at = job, {}
        wait_until(lambda: not fleet.answers([1], 0.5, lambda h: None), "the wedged agent's beats to stop")
    finally:
        release.set()
        job.stop("finished")
        served.join(timeout=10.0)


def test_the_supervisor_reads_each_agents_registration_and_lease():
    # `Fleet.wait_for_agents` over a real store: each other host's first `AgentUp` (drained here,
    # before any worker starts) with the lease its agent holds.
    from schedc.live.agent import Fleet
    from schedc.live.protocol import AgentUp

    job = JobStore.serve()
    fleet = Fleet.__new__(Fleet)
    fleet.job, fleet.hosts, fleet.up, fleet.leases = job, 3, set(), {}
    for host in (2, 1):
        job.event(AgentUp(host=host, pid=10 + host, t=0.0, agent=f"pid {10 + host} on a #{host}"))
    notes = []
    fleet.wait_for_agents(5.0, lambda kind, message: notes.append(message))
    assert fleet.up == {1, 2} and fleet.leases == {1: "pid 11 on a #1", 2: "pid 12 on a #2"}
    assert "waiting for 2 agent(s)" in notes[0]


def test_the_supervisor_keeps_its_store_up_while_a_remote_agent_still_beats_and_not_for_a_silent_one():
    # At the run's end the store stays up until each remote agent said it left: 5 s, or as long as
    # it still beats (busy, it sees the stop once done: 150 s at most), so that a busy agent does
    # not take the store's end for a lost supervisor (E557 after a run that finished).
    from types import SimpleNamespace

    from schedc.live.agent import Fleet
    from schedc.live.protocol import AgentLeft

    class Job:
        def __init__(self, busy_for: int | None):
            self.reads, self.busy_for = 0, busy_for  # (None: silent, it never leaves)

        def agent_beats(self, host):  # (busy: one more beat at each read, until it is done)
            self.reads += 1
            return 0 if self.busy_for is None else min(self.reads, self.busy_for)

        def events(self):
            done = self.busy_for is not None and self.reads > self.busy_for
            return [AgentLeft(host=1, t=0.0)] if done else []

    for busy_for, leaves in ((20, True), (None, False)):
        fleet = Fleet.__new__(Fleet)
        fleet.job, fleet.up, fleet.left = Job(busy_for), {1}, set()
        fleet.local = SimpleNamespace(step=lambda timeout: __import__("time").sleep(timeout))
        fleet.wait_left(set(), set(), within=0.05, busy=60.0)
        assert (1 in fleet.left) == leaves, (busy_for, fleet.left)


def test_the_ledger_says_where_the_run_is_now_after_a_rollback_to_an_older_checkpoint():
    """After a restore of the checkpoint at 4 (iterations 0-9 done), the run is at 5 once 4 is
    done again, not at 10: a planned switch there would start 5 iterations ahead of the ranks'
    pace and be escalated as late (the slowness ladder's episodes, too, counted from 10)."""
    from schedc.live.ledger import Ledger
    from schedc.live.protocol import IterationDone

    ledger = Ledger(0.0)
    assert ledger.now == 0
    for gen, it in [(0, i) for i in range(10)] + [(1, 4)]:  # (generation 1 restored the checkpoint at 4)
        ledger.add(IterationDone(rank=0, it=it, t0=float(it), t1=it + 0.5, gen=gen, steps=it + 1, compute=0.0,
                                 planned=0.0), [0], {})
    assert ledger.completed == 10 and ledger.now == 5


def test_a_step_back_of_the_system_clock_does_not_step_the_supervisors_clock(monkeypatch):
    """The detector's bounds run on the supervisor's clock: a system clock set back an hour (NTP,
    an operator) must not hide a dead rank for an hour more."""
    import time as clock

    from schedc.live.world import LocalWorld

    world = LocalWorld()
    before = world.time()
    real_time, real_monotonic = clock.time, clock.monotonic
    monkeypatch.setattr(clock, "time", lambda: real_time() - 3600.0)
    assert world.time() >= before
    # ...and it is the monotonic clock that moves it (a clock that never moved would pass above).
    monkeypatch.setattr(clock, "monotonic", lambda: real_monotonic() + 100.0)
    assert world.time() >= before + 100.0


def test_the_ledger_finds_what_is_missing_from_its_first_gap_not_from_the_start():
    """The supervisor asks on every tick whether the run is complete: a run of a million
    iterations must not look every done iteration up each time (0.1 s a tick)."""
    from schedc.live.ledger import Ledger

    ledger = Ledger(0.0)
    ledger.first = 0
    for it in range(50):
        ledger.add(IterationDone(rank=0, it=it, t0=0.0, t1=0.01, loss=1.0), members=[0], speeds={})
    assert ledger.missing(10 ** 12, limit=1) == [50]  # (at once: the old scan built a list of 10^12 - 50)
    assert ledger.missing(53) == [50, 51, 52] and ledger.completed == 50
    ledger.add(IterationDone(rank=0, it=51, t0=0.0, t1=0.01, loss=1.0), members=[0], speeds={})
    assert ledger.missing(53) == [50, 52] and ledger.completed == 52


def test_the_ledger_keeps_per_rank_detail_for_its_newest_completions_only(monkeypatch):
    """Each record's per-rank speeds cost about 80 bytes a rank (84 KiB an iteration at 1,024
    ranks): a long run keeps them for its newest completions, its losses and times for all."""
    from schedc.live import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "DETAIL_KEPT", 3)
    ledger = ledger_module.Ledger(0.0)
    ledger.first = 0
    for it in range(5):
        ledger.add(IterationDone(rank=0, it=it, t0=0.0, t1=0.01, loss=1.0 + it, compute=0.01, planned=0.01),
                   members=[0], speeds={0: 1.0})
    assert [bool(r.speeds) for r in ledger.history] == [False, False, True, True, True]
    assert [ledger.records[i].speeds == {} for i in range(5)] == [True, True, False, False, False]
    assert [r.loss for r in ledger.history] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_stall_while_a_peer_is_silent_waits_for_the_silence_rule_not_stuck_for_all_waiting():
    # A whole host lost: ranks 2 and 3 stop beating at t=0 (no process exit reaches the supervisor,
    # its agent died too); ranks 0 and 1 wait for them. With the silence floor (15 s) past the stall
    # bound (10 s), the stall rule would call the run stuck (everyone waits) at t=10, before the
    # silence rule found the dead ranks. It defers to the silence rule instead, within a bound.
    d = _detector(heartbeat_timeout=15.0, stall_timeout=10.0)
    for r in (0, 1, 2, 3):
        d.watch(r, 0.0)
    t, found = 0.0, []
    while not found and t < 200.0:
        for r in (0, 1) if t > 0 else (0, 1, 2, 3):
            d.beat(r, f"{int(t / POLL)} 0 3 5 wait", t)
        found = d.check(t, running=True)
        assert not d.stalled_waiting, t
        t += POLL
    assert sorted(s.rank for s in found) == [2, 3] and all(s.silent for s in found), found
    assert 15.0 < t < 20.0, t
    # A stall with every member beating is still called out, deferral or not.
    d = _detector(heartbeat_timeout=15.0, stall_timeout=10.0)
    for r in (0, 1):
        d.watch(r, 0.0)
    t = 0.0
    while t <= 10.5:
        for r in (0, 1):
            d.beat(r, f"{int(t / POLL)} 0 3 5 wait", t)
        assert d.check(t, running=True) == []
        t += POLL
    assert d.stalled_waiting


def test_every_time_option_is_checked_by_one_rule_in_the_same_words():
    from schedc.limits import MAX_SECONDS, seconds_problem

    assert seconds_problem(0.5, "--timeout") is None and seconds_problem(MAX_SECONDS, "x") is None
    for bad, shown in ((0, "0"), (-1.5, "-1.5"), (float("nan"), "nan"), (float("inf"), "inf"), (2e6, "2e+06"),
                       (True, "True"), ("5", "'5'")):
        assert seconds_problem(bad, "--timeout") == (
            f"--timeout must be a positive number of seconds (at most 1e+06), got {shown}"), bad
    # the same words from a library call, a live option and a CLI store connection
    with pytest.raises(RunError) as e:
        schedc.compile("specs/mlp-2x2.sched", time_limit=float("nan"))
    assert e.value.diagnostics[0].code == "E206" and "positive number of seconds" in e.value.diagnostics[0].message
    from schedc.live.options import TrainOptions
    with pytest.raises(RunError) as e:
        TrainOptions(detect_timeout=2e6).check()
    assert "detect-timeout must be a positive number of seconds (at most 1e+06), got 2e+06" in str(
        e.value.diagnostics[0].message)
    # A cost-model figure is no wait: the spec's `recovery.horizon` range (up to 1e9 s) is train's too.
    TrainOptions(horizon=5e6).check()
    spec = schedc.load(Path("specs/mlp-2x2.sched").read_text() + "\nrecovery { horizon = 5000000s }\n")
    assert TrainOptions().with_spec(spec).horizon == 5e6
    with pytest.raises(RunError) as e:
        TrainOptions(horizon=2e9).check()
    assert "horizon must be a positive number of seconds (at most 1e+09), got 2e+09" in e.value.diagnostics[0].message


def test_a_stall_bound_of_a_few_beats_does_not_take_every_gap_between_beats_for_silence():
    # A stall bound of 0.2 s with beats every 50 ms: half of it (0.1 s) is two beats, so any late
    # beat would defer the stall rule for up to the silence ceiling. At least ten beats of silence
    # defer it, so a deadlock of live ranks whose beats come every 150 ms is still called at once.
    d = _detector(heartbeat_timeout=3.0, stall_timeout=0.2, beat_interval=0.05)
    assert d.quiet == pytest.approx(0.5)
    for r in (0, 1):
        d.watch(r, 0.0)
    t = 0.0
    while not d.stalled_waiting and t < 5.0:
        t = round(t + 0.15, 2)
        for r in (0, 1):
            d.beat(r, f"{int(t * 100)} 0 3 5 wait", t)
        d.check(t + 0.14, running=True)  # (checked just before the next beat: 140 ms of quiet)
    assert d.stalled_waiting and t < 0.5, t
