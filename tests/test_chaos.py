"""bench/chaos.py's pure parts: the seeded choice of faults, how a run's outcome is classified,
which declared failures count as healthy GPUs excluded, how worker pids get their ranks, and the
campaigns' table."""

from __future__ import annotations

import json
from dataclasses import asdict

from bench.chaos import (OUTCOMES, RANKS, TOLERANCE, Fault, Proc, Ranks, RunRecord, classify, declared,
                         fired_by_target, healthy_excluded, load_summaries, main, plan_faults, roles, table)


def test_faults_are_a_function_of_the_seed():
    assert plan_faults(7, 100) == plan_faults(7, 100)
    plans = [plan_faults(seed, 100) for seed in range(200)]
    assert len({p for p in plans}) > 150  # seeds give different runs
    kinds = {(f.target, f.action, f.trigger) for p in plans for f in p}
    # Over a few hundred seeds every target, action and trigger comes up.
    assert {t for t, _, _ in kinds} == {"worker", "forkserver", "tracker"}
    assert {a for _, a, _ in kinds} == {"kill", "stop"}
    assert {g for _, _, g in kinds} == {"iteration", "startup", "after", "phase"}


def test_faults_are_well_formed():
    for seed in range(300):
        faults = plan_faults(seed, 60)
        assert any(f.trigger == "iteration" for f in faults)
        for i, f in enumerate(faults):
            assert isinstance(f, Fault)
            if f.trigger == "iteration":
                assert 2 <= f.at <= 60 - 12
            if f.trigger == "after":  # follows an earlier fault
                assert 0 <= f.at < i and faults[f.at].trigger != "after"
            if f.target == "worker":
                assert 1 <= len(f.ranks) <= 2 and all(0 <= r < RANKS for r in f.ranks)
            else:
                assert f.ranks == ()
            assert (f.cont_after is not None) == (f.action == "stop")
            assert f.describe()


def test_classify():
    done = "iteration   99  loss 1.0\n100 iterations in 12 s\n"
    assert classify(0, done, False, 0.0) == "finished exact"
    assert classify(0, done, False, TOLERANCE / 2) == "finished exact"
    assert classify(0, done, False, TOLERANCE * 2) == "finished inexact"
    assert classify(0, done, False, None) == "finished inexact"  # no weights: not shown exact
    e553 = "error[E553]: a stage lost every GPU\n  = hint: resume\n"
    assert classify(1, e553, False, None) == "diagnostic"
    assert classify(1, "something died\n", False, None) == "crashed"  # nonzero, no diagnostic
    assert classify(-9, "", False, None) == "crashed"
    assert classify(2, "error[E000]: internal error in schedc: KeyError: 3\n", False, None) == "crashed"
    trace = "Traceback (most recent call last):\n  File \"x.py\"\nValueError: no\n"
    assert classify(0, done + trace, False, 0.0) == "crashed"  # a traceback even in a finished run
    assert classify(1, e553 + trace, False, None) == "crashed"
    assert classify(None, done, True, None) == "hung"  # hung wins over everything
    assert {classify(*a) for a in [(0, done, False, 0.0), (0, done, False, 1.0), (1, e553, False, None),
                                   (None, "", True, None), (2, "", False, None)]} == set(OUTCOMES)


def test_healthy_excluded_from_the_log():
    log = {"events": [
        {"kind": "failure", "rank": 2, "cause": "killed by SIGKILL"},
        {"kind": "failure", "rank": 5, "cause": "exited with status 255"},
        {"kind": "slow", "rank": 7, "speed": 0.8},  # reported slow, not taken out of work
        {"kind": "decision", "decision": {"rank": 4, "verdict": "switch", "action": "exclude"}},
        {"kind": "decision", "decision": {"rank": 6, "verdict": "switch", "action": "rebalance"}},
        {"kind": "decision", "decision": {"rank": 8, "verdict": "wait", "action": "exclude"}},
    ]}
    assert declared(log, "") == {2: ["killed by SIGKILL"], 5: ["exited with status 255"], 4: ["excluded as slow"]}
    assert healthy_excluded(log, "", {2}) == {5: ["exited with status 255"], 4: ["excluded as slow"]}
    assert healthy_excluded(log, "", {2, 4, 5}) == {}


def test_healthy_excluded_from_the_output_without_a_log():
    out = ("[   3.1 s] rank 1 GPU (dp=0, pp=1) failed: killed by SIGKILL\n"
           "[   6.2 s] rank 3 GPU (dp=1, pp=0) failed: no heartbeat for 3.0 s\n"
           "iteration    4  loss 1.0\n")
    assert healthy_excluded(None, out, {1}) == {3: ["no heartbeat for 3.0 s"]}


def test_worker_ranks_follow_the_start_order_and_the_replacement_lines():
    ranks = Ranks(pending=list(range(RANKS)))
    ranks.born([120, 101, 105, 102, 103, 104, 106, 107, 108], now=1.0)  # seen in any order: pid order
    assert ranks.of == {101: 0, 102: 1, 103: 2, 104: 3, 105: 4, 106: 5, 107: 6, 108: 7, 120: 8}
    assert ranks.first_birth == 1.0
    # A replacement seen before its line waits for it.
    ranks.born([130, 131], now=5.0)
    assert 130 not in ranks.of
    ranks.line("[ 5.0 s] stage(s) [1] lost every GPU: restoring iter-000020 with replacement process(es) for "
               "rank(s) [4, 7] (restart 1 of 3)", RANKS)
    assert ranks.of[130] == 4 and ranks.of[131] == 7
    alive = {101, 105, 130}
    assert ranks.pid_of(4, alive) == 130  # the newest process of the rank
    assert ranks.pid_of(7, alive) is None  # its process is gone
    ranks.line("[ 9.0 s] restarting every process from iter-000040 with the failed GPU(s) replaced", RANKS)
    ranks.born(list(range(200, 209)), now=9.0)
    assert [ranks.of[p] for p in range(200, 209)] == list(range(RANKS))


def test_a_restart_after_a_deadline_starts_only_the_ranks_not_declared_failed():
    # Seed 50043: ranks 1, 0 and 8 killed, generation 3 never ready, every process restarted: six
    # workers start, for ranks 2..7 (the script once took them for ranks 0..5).
    ranks = Ranks(pending=list(range(RANKS)))
    ranks.born(list(range(100, 109)), now=1.0)
    for r in (1, 0, 8):
        ranks.line(f"[ 9.1 s] rank {r} GPU (dp=0, pp={r % 3}) failed: killed by SIGKILL", RANKS)
    ranks.line("[ 129.5 s] generation 3 did not become ready within 60 s of its members running (rank(s) "
               "[2, 3, 4, 5, 6, 7] never reported ready) again: restarting every process from iter-000040 "
               "(restart 1 of 3)", RANKS)
    ranks.born(list(range(200, 206)), now=130.0)
    assert [ranks.of[p] for p in range(200, 206)] == [2, 3, 4, 5, 6, 7]
    assert ranks.pid_of(0, alive=set(range(200, 206))) is None  # rank 0 has no process now
    # A replacement takes its rank off the failed ones; a restart with the failed GPUs replaced
    # starts every rank.
    ranks.line("[ 140 s] stage(s) [0] lost every GPU: restoring iter-000060 with replacement process(es) for "
               "rank(s) [0] (restart 2 of 3)", RANKS)
    ranks.born([300], now=141.0)
    assert ranks.of[300] == 0 and ranks.failed == {1, 8}
    ranks.line("[ 150 s] restarting every process from iter-000080 with the failed GPU(s) replaced", RANKS)
    ranks.born(list(range(400, 409)), now=151.0)
    assert [ranks.of[p] for p in range(400, 409)] == list(range(RANKS)) and ranks.failed == set()


def test_targets_can_be_restricted_without_changing_the_default_plans():
    assert plan_faults(11, 100) == plan_faults(11, 100, targets=("worker", "forkserver", "tracker"))
    for seed in range(200):
        assert {f.target for f in plan_faults(seed, 100, targets=("worker", "tracker"))} <= {"worker", "tracker"}


def test_workers_whose_forkserver_was_killed_stay_workers():
    fs = "python -c from multiprocessing.forkserver import main; main(...)"
    sid = 10
    procs = {10: Proc(10, 1, "S", "python -m schedc train out"), 20: Proc(20, 10, "S", fs),
             21: Proc(21, 20, "S", fs), 22: Proc(22, 20, "S", fs), 30: Proc(30, 10, "S", "python -c resource_tracker")}
    assert roles(procs, sid, workers={21, 22}) == ({20}, {21, 22})
    # The forkserver is killed: its workers are re-parented to `schedc train`, where it lived;
    # they are still workers, and there is no forkserver until a new one starts.
    procs = {10: procs[10], 21: Proc(21, 10, "S", fs), 22: Proc(22, 10, "S", fs), 20: Proc(20, 10, "Z", fs)}
    assert roles(procs, sid, workers={21, 22}) == (set(), {21, 22})
    procs[40] = Proc(40, 10, "S", fs)  # the agent starts a new forkserver
    assert roles(procs, sid, workers={21, 22}) == ({40}, {21, 22})


def _record(seed, outcome, fired, load, diff=1e-6, healthy=None, leaked=()):
    return RunRecord(seed, outcome, 0, 10.0, diff, [], fired, [], healthy or {}, list(leaked), [], [], "", load)


def test_the_table_counts_outcomes_and_signalled_processes_per_load(tmp_path, capsys):
    kill = {"fault": 0, "t": 1.0, "signal": "SIGKILL", "targets": ["rank 3", "rank 5"], "pids": [1, 2], "iteration": 4}
    stop = {"fault": 1, "t": 2.0, "signal": "SIGSTOP", "targets": ["forkserver"], "pids": [3], "iteration": 5}
    none = {"fault": 2, "t": 3.0, "signal": "SIGKILL", "targets": [], "pids": [], "iteration": 6}
    tracker = {"fault": 0, "t": 1.0, "signal": "SIGKILL", "targets": ["resource tracker"], "pids": [4], "iteration": 2}
    calm = [_record(1, "finished exact", [kill, stop, none], 0, diff=2e-6),
            _record(2, "hung", [kill], 0, diff=None, healthy={"4": ["no heartbeat"]}, leaked=["pid 9"])]
    busy = [_record(3, "finished exact", [tracker], 2, diff=5e-7)]
    assert fired_by_target(calm) == {"forkserver SIGSTOP": 1, "no process": 1, "worker SIGKILL": 4}
    rows = table(busy + calm).splitlines()
    assert len(rows) == 4 and rows[0].startswith("| campaign | runs | finished exact")
    assert rows[2] == ("| load 0 | 2 | 1 (2e-06) | 0 | 0 | 1 | 0 | 1 / 1 | 1 | "
                       "forkserver SIGSTOP 1, no process 1, worker SIGKILL 4 |")
    assert rows[3] == "| load 2 | 1 | 1 (5e-07) | 0 | 0 | 0 | 0 | 0 / 0 | 0 | resource tracker SIGKILL 1 |"
    # --table reads campaigns' summary.json back, also those written before the load was kept.
    for name, recs in (("a", calm), ("b", busy)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps([asdict(r) for r in recs]))
    old = asdict(busy[0])
    del old["load"]
    (tmp_path / "old.json").write_text(json.dumps([old]))
    assert [r.seed for r in load_summaries([tmp_path / "a", tmp_path / "b"])] == [1, 2, 3]
    assert main(["--table", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "old.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in printed[2:]] == ["| load 0", "| load 2", "| load ?"]
