"""The live run's policies (recovery, rejoin, fail-slow) alone, against a fake controller:
no supervisor, no store, no processes. What each one asks of the run is recorded and checked."""

from __future__ import annotations

import pytest

import schedc
from live_support import spec_text
from schedc.live.protocol import CaughtUp, IterationDone, Phase
from schedc.live.recovery import RecoveryPolicy, failure_events
from schedc.load import load_text
from schedc.live.rejoin import Rejoins
from schedc.live.slowness import Slowness
from schedc.spec import Failure


class FakeController:
    """A `Controller` over one plan: it replans for real and records every request."""

    def __init__(self, plan, *, phase=Phase.RUNNING, completed=5, refuse_switch=None):
        self.plan = self.base_plan = plan
        self.phase = phase
        self.completed = completed
        self.running: set[int] = {g.rank for g in plan.spec.gpus if g.live}
        self.lost: set[int] = set()
        self.notes: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, dict]] = []  # the notes with their details
        self.replans: list[tuple] = []
        self.switches: list[dict] = []
        self.hosts_gone: set[int] = set()  # ranks whose host does not answer (`revive` refuses them)
        self.directives: dict[int, dict | None] = {}
        self.revived: list[int] = []
        self.rejoin_requests: list[int] = []
        self.refuse_switch = refuse_switch
        self.clock = 0.0
        self.gone_hosts: dict[int, int] = {}  # rank -> its host, for ranks on hosts that are gone
        self.asked_unreachable: list[list[int]] = []
        self.placed: dict[int, int] = {}  # rank -> the job's GPU, where it is not the rank itself
        self.holes: set[int] = set()  # ranks no GPU runs (a re-partitioned layout's holes)
        self.spare: list[int] = []  # the job's healthy GPUs outside the plan
        self.job = plan.spec  # the job's spec, as it names its GPUs
        self.relaid = False  # whether the plan is a re-partitioned layout (its GPUs named as the job names them)

    def now(self):
        return self.clock

    @property
    def members(self):
        return tuple(g.rank for g in self.plan.spec.gpus if g.live and g.rank not in self.lost)

    def is_running(self, rank):
        return rank in self.running

    def unreachable(self, ranks):
        self.asked_unreachable.append(list(ranks))
        out: dict[int, list[int]] = {}
        for r in ranks:
            if r in self.gone_hosts:
                out.setdefault(self.gone_hosts[r], []).append(r)
        return out

    def physical(self):
        return {g.rank: self.placed.get(g.rank, g.rank) for g in self.plan.spec.gpus if g.rank not in self.holes}

    def gpu_name(self, rank):
        if not self.relaid:
            g = self.plan.spec.gpus[rank]
            return f"GPU (dp={g.dp}, pp={g.pp})"
        g = self.job.gpus[self.placed.get(rank, rank)]
        return f"GPU (dp={g.dp}, pp={g.pp}) of the job"

    def spares(self):
        return list(self.spare)

    def note(self, kind, message, **details):
        self.notes.append((kind, message))
        self.events.append((kind, message, details))

    def replan(self, base, events, solver=None):
        self.replans.append((tuple(events), solver))
        return schedc.replan(base, list(events), deadline=5.0, solver=solver or "greedy")

    def switch(self, plan, *, kind, reason, ranks):
        self.switches.append({"plan": plan, "kind": kind, "reason": reason, "ranks": list(ranks)})
        return self.refuse_switch

    def revive(self, rank):
        if rank in self.hosts_gone:
            return "its host 1 is gone (its agent does not answer)"
        self.revived.append(rank)
        self.running.add(rank)

    def direct(self, rank, directive):
        self.directives[rank] = directive

    def request_rejoin(self, rank, reason):
        self.rejoin_requests.append(rank)

    def rejoin_wanted(self, rank):
        return False


@pytest.fixture(scope="module")
def plan():
    return schedc.compile(spec_text(dp=2, pp=2))


def test_recovery_reroutes_a_failed_gpu(plan):
    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="reroute", max_restarts=3, initial_plan=plan, latest_checkpoint=lambda: None)
    change = policy.decide(plan, [2], {2})
    assert change.method == "reroute" and change.events == ("fail gpu(dp=1, pp=0)",)
    assert change.restore is None and change.replacements == () and not change.restart_all
    assert not change.plan.spec.gpus[2].live and ctl.replans == [((Failure("fail_gpu", dp=1, pp=0),), None)]


def test_recovery_drop_pipeline_asks_for_its_solver(plan):
    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="drop-pipeline", max_restarts=3, initial_plan=plan,
                            latest_checkpoint=lambda: None)
    change = policy.decide(plan, [2], {2})
    assert change.method == "drop-pipeline" and ctl.replans[0][1] == "drop-pipeline"


def test_recovery_auto_takes_the_faster_plan_and_says_why(plan):
    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="auto", max_restarts=3, initial_plan=plan, latest_checkpoint=lambda: None)
    change = policy.decide(plan, [2], {2})
    times = {m: schedc.replan(plan, "fail gpu(dp=1, pp=0)", deadline=5.0, solver=s).metrics.iteration_time
             for m, s in (("reroute", "greedy"), ("drop-pipeline", "drop-pipeline"))}
    fastest = min(times, key=lambda m: (times[m], m != "reroute"))
    assert change.method == fastest and change.plan.metrics.iteration_time == times[fastest]
    assert [solver for _, solver in ctl.replans] == [None, "drop-pipeline"]
    kind, message = ctl.notes[-1]
    assert kind == "decision" and message.startswith(f"recovery: {fastest} ")
    assert f"{times[fastest] / 1e3:.2f} ms per iteration" in message and "horizon 900 s" in message


def test_recovery_auto_horizon_is_the_mean_gap_between_failures(plan):
    now = [100.0]
    policy = RecoveryPolicy(FakeController(plan), method="auto", max_restarts=3, initial_plan=plan,
                            latest_checkpoint=lambda: None, clock=lambda: now[0])
    for t in (100.0, 130.0, 190.0, 300.0):  # (130 is within BURST_S of 100: part of its burst)
        now[0] = t
        policy.decide(plan, [2], {2})
    assert policy.horizon.seconds == pytest.approx(100.0)


def test_recovery_auto_restores_a_lost_stage_from_the_checkpoint(plan):
    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="auto", max_restarts=1, initial_plan=plan, latest_checkpoint=lambda: None)
    change = policy.decide(plan, [0, 2], {0, 2})
    assert change.method == "checkpoint" and change.replacements == (0, 2)


def test_a_lost_stage_starts_no_replacement_for_a_hole_of_the_layout():
    # A re-partitioned layout with a hole: rank 2's slot of stage 0 has no GPU (its peer re-routes
    # its work). Stage 0 lost: a replacement process starts for rank 0, never for the hole.
    plan = schedc.compile(load_text(spec_text(dp=2, pp=2) + "\nfailures { fail gpu(dp=1, pp=0) }\n"))
    ctl = FakeController(plan)
    ctl.holes = {2}
    policy = RecoveryPolicy(ctl, method="auto", max_restarts=1, initial_plan=plan, latest_checkpoint=lambda: None)
    change = policy.decide(plan, [0], {0})
    assert change.method == "checkpoint" and change.replacements == (0,)
    assert ctl.asked_unreachable == [[0]]
    # (a GPU failed when the job started is one of the job's: it is replaced)
    ctl.holes = set()
    change = RecoveryPolicy(ctl, method="auto", max_restarts=1, initial_plan=plan,
                            latest_checkpoint=lambda: None).decide(plan, [0], {0})
    assert change.replacements == (0, 2)


def test_auto_re_partitions_a_lost_stage_whose_host_is_gone(plan):
    """A stage lost with the host of one of its GPUs (its agent no longer answers): no replacement
    process can start there, so `auto` lays the survivors out anew instead of waiting for one."""
    ctl = FakeController(plan)
    ctl.gone_hosts = {2: 1}  # rank 2's host is gone; rank 0's is not
    policy = RecoveryPolicy(ctl, method="auto", max_restarts=1, initial_plan=plan, latest_checkpoint=lambda: None)
    change = policy.decide(plan, [0, 2], {0, 2})  # both GPUs of stage 0
    assert ctl.asked_unreachable == [[0, 2]]
    assert change.method == "repartition" and change.restart_all and change.restore == "initial"
    assert change.replacements == () and sorted(r for row in change.ranks for r in row if r is not None) == [1, 3]
    kind, message = ctl.notes[-1]
    assert kind == "restart" and "host 1 (rank(s) [2]) is gone, so no replacement process can start" in message
    assert "re-partitioning the 2 survivors" in message


def test_a_lost_stage_asks_whose_hosts_are_gone_once_per_recovery(plan):
    """The supervisor asks `repartitions` first, then `decide`: both need whether the lost stage's
    hosts are gone, and asking a live host's agent waits for its beats, so the answer is reused
    within the recovery. A later recovery (the clock past `ASKED_FRESH_S`) asks again."""
    from schedc.live.recovery import ASKED_FRESH_S

    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="auto", max_restarts=3, initial_plan=plan, latest_checkpoint=lambda: None,
                            clock=ctl.now)
    assert not policy.repartitions(plan, {0, 2})  # their hosts answer: replacements can start
    change = policy.decide(plan, [0, 2], {0, 2})
    assert change.method == "checkpoint" and ctl.asked_unreachable == [[0, 2]]
    ctl.clock += ASKED_FRESH_S + 0.5
    ctl.gone_hosts = {2: 1}  # rank 2's host went away since: a later recovery must see it
    assert policy.repartitions(plan, {0, 2})
    assert ctl.asked_unreachable == [[0, 2], [0, 2]]


def test_a_fixed_policy_stops_with_e553_when_a_lost_stage_cannot_be_replaced(plan):
    ctl = FakeController(plan)
    ctl.gone_hosts = {0: 0, 2: 1}
    policy = RecoveryPolicy(ctl, method="reroute", max_restarts=3, initial_plan=plan, latest_checkpoint=lambda: None)
    with pytest.raises(schedc.RunError) as info:
        policy.decide(plan, [0, 2], {0, 2})
    (first, *_) = info.value.diagnostics
    assert first.code == "E553" and "host 0 (rank(s) [0]), host 1 (rank(s) [2]) are gone" in first.message
    assert "--recovery auto" in first.hint and policy.restarts == 0


def test_a_lost_stage_restores_with_replacements_until_no_restart_is_left(plan):
    ctl = FakeController(plan)
    policy = RecoveryPolicy(ctl, method="reroute", max_restarts=1, initial_plan=plan, latest_checkpoint=lambda: None,
                            out="OUTDIR")
    change = policy.decide(plan, [0, 2], {0, 2})  # both GPUs of stage 0
    assert change.method == "checkpoint" and change.restore == "initial" and change.replacements == (0, 2)
    assert all(g.live for g in change.plan.spec.gpus)
    assert ctl.notes[-1][0] == "restart" and "restart 1 of 1" in ctl.notes[-1][1]
    with pytest.raises(schedc.RunError) as info:
        policy.decide(plan, [0, 2], {0, 2})
    assert info.value.codes[0] == "E553" and "no checkpoint was written" in info.value.diagnostics[0].hint


@pytest.mark.parametrize("method", ["reroute", "repartition"])
@pytest.mark.parametrize("own_dir, emulate, iterations", [(False, False, None), (True, False, None),
                                                          (True, True, 40)])
def test_e553_names_the_options_that_resume_this_run(plan, tmp_path, method, own_dir, emulate, iterations):
    """The hint's command must pass what `--resume` checks: the checkpoint folder when it is not
    OUT/checkpoints (else E556, no checkpoint), --emulate for an emulated run's checkpoint, and
    the run's --iterations when the policy knows them (else the resumed run stops at the spec's)."""
    from schedc.live.checkpoint import Checkpoint

    out = tmp_path / "my out"
    root = tmp_path / "ckpts" if own_dir else out / "checkpoints"
    found = Checkpoint(root / "iter-000004", 4, {"emulate": emulate})
    policy = RecoveryPolicy(FakeController(plan), method=method, max_restarts=0, initial_plan=plan,
                            latest_checkpoint=lambda: found, out=out, iterations=iterations)
    with pytest.raises(schedc.RunError) as info:
        policy.decide(plan, [0, 2], {0, 2})  # both GPUs of stage 0, no restart allowed
    assert info.value.codes[0] == "E553"
    hint = info.value.diagnostics[0].hint
    want = f"schedc train '{out}' --resume"
    if own_dir:
        want += f" --checkpoint-dir {root}"
    if emulate:
        want += " --emulate"
    if iterations:
        want += f" --iterations {iterations}"
    assert f"`{want}`" in hint, hint
    assert ("--iterations N" in hint) == (iterations is None), hint


def test_recovery_restart_restarts_everything_from_the_initial_plan(plan):
    later = schedc.replan(plan, "fail gpu(dp=1, pp=1)", solver="greedy")
    policy = RecoveryPolicy(FakeController(later), method="restart", max_restarts=3, initial_plan=plan,
                            latest_checkpoint=lambda: None)
    change = policy.decide(later, [1], {1})
    assert change.restart_all and change.plan is plan and change.restore == "initial"


def test_failure_events_name_a_whole_node_once():
    plan = schedc.compile(spec_text(dp=2, pp=2, gpus_per_node=2))
    assert failure_events(plan.spec, [2, 3]) == [Failure("fail_node", node=1)]
    assert failure_events(plan.spec, [1]) == [Failure("fail_gpu", dp=0, pp=1)]


def test_failure_events_name_only_the_gpus_that_died_now():
    """A node whose other GPU failed earlier: the GPU that died now, not `fail node` (the replan: line
    named node 0 when only GPU (dp=0, pp=1) had died)."""
    plan = schedc.compile(spec_text(dp=3, pp=2, gpus_per_node=2))
    later = schedc.replan(plan, "fail gpu(dp=0, pp=0)", solver="greedy")
    assert failure_events(later.spec, [1]) == [Failure("fail_gpu", dp=0, pp=1)]
    assert failure_events(later.spec, [2, 3]) == [Failure("fail_node", node=1)]


def test_rejoin_revives_catches_up_then_switches(plan):
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    ctl.running.discard(2)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    assert ctl.revived == [2] and 2 in rejoins.wanted
    assert ctl.directives[0] == {"role": "donate", "session": 1, "joiner": 2}  # the stage's live GPU donates
    assert ctl.directives[2] == {"role": "join", "session": 1, "donor": 0}
    rejoins.switch_if_ready(ctl.completed)
    assert ctl.switches == []  # not caught up yet
    rejoins.caught_up(CaughtUp(rank=2, session=1, steps=ctl.completed - 1, bytes=100, t=0.0))
    rejoins.switch_if_ready(ctl.completed)
    (sw,) = ctl.switches
    assert sw["kind"] == "rejoin" and sw["ranks"] == [2] and sw["plan"].spec.gpus[2].live
    assert sw["reason"] == "recover gpu(dp=1, pp=0): asked for"
    rejoins.joined((0, 1, 2, 3))
    assert rejoins.wanted == {} and ctl.directives[0] is None and ctl.directives[2] is None


def test_a_rejoin_into_a_re_partitioned_layout_names_the_gpu_as_the_job_does(plan):
    # A 2 x 2 layout over GPUs of a 2 x 3 job: rank 2 of the layout (its slot dp=1, pp=0) is the
    # job's GPU 4, (dp=1, pp=1). Naming the slot "GPU (dp=1, pp=0)" would name another GPU of the job.
    job = schedc.compile(spec_text(dp=2, pp=3))
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    ctl.job, ctl.placed, ctl.relaid = job.spec, {0: 0, 1: 2, 2: 4, 3: 5}, True
    ctl.running.discard(2)
    Rejoins(ctl).request(2, "asked for")
    assert ("rejoin", "taking GPU (dp=1, pp=1) of the job (rank 2) back: asked for") in ctl.notes, ctl.notes


def test_a_rejoin_of_a_gpu_whose_host_is_gone_is_refused_and_said_not_left_waiting(plan):
    # A start sent to a gone host's agent is never read: the GPU would stay "wanted" forever, in silence.
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    ctl.running.discard(2)
    ctl.hosts_gone.add(2)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    assert 2 not in rejoins.wanted and ctl.revived == []
    assert any(kind == "rejoin" and "cannot take" in text and "its host 1 is gone" in text
               for kind, text in ctl.notes), ctl.notes


def test_a_refused_rejoin_switch_gives_up_and_says_why(plan):
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone, refuse_switch="the run ends first")
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    rejoins.caught_up(CaughtUp(rank=2, session=1, steps=ctl.completed, bytes=1, t=0.0))
    rejoins.switch_if_ready(ctl.completed)
    assert rejoins.wanted == {} and ("rejoin", "rank 2 stays out: the run ends first") in ctl.notes


def test_a_catch_up_that_does_not_move_ends_and_the_gpu_stays_out(plan):
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    ctl.clock = 5.0
    rejoins.caught_up(CaughtUp(rank=2, session=1, steps=1, bytes=10, t=0.0))  # it moves: the clock restarts
    ctl.clock = 14.0
    rejoins.check_progress(10.0)
    assert 2 in rejoins.sessions
    ctl.clock = 15.5
    rejoins.check_progress(10.0)
    assert rejoins.sessions == {} and rejoins.wanted == {}
    assert ("rejoin", "rank 2 stays out: its catch-up made no progress in 10 s") in ctl.notes
    assert ctl.directives[0] is None and ctl.directives[2] is None


def test_a_catch_up_that_moves_but_never_gains_on_training_ends(plan):
    # The joiner applies steps, but training runs away from it (a link slower than the gradients
    # come): its lag has not shrunk for the bound, so it ends, said, before the donor's queue of
    # gradients grows without end. One that gains, however slowly, goes on.
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone, completed=20)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    for t, completed, steps in [(1.0, 20, 10), (5.0, 24, 15), (9.0, 28, 19), (12.0, 33, 23)]:  # 10, 9, 9, 10 behind
        ctl.clock, ctl.completed = t, completed
        rejoins.caught_up(CaughtUp(rank=2, session=1, steps=steps, bytes=1, t=0.0))
        rejoins.check_progress(10.0)
    assert 2 in rejoins.sessions  # (9 behind since t = 5: 7 s)
    ctl.clock, ctl.completed = 15.5, 37
    rejoins.caught_up(CaughtUp(rank=2, session=1, steps=27, bytes=1, t=0.0))
    rejoins.check_progress(10.0)
    assert rejoins.sessions == {} and rejoins.wanted == {}
    assert ("rejoin", "rank 2 stays out: its catch-up does not gain on training: 9 or more iterations behind for "
                      "10 s (the gradients come slower than training makes them)") in ctl.notes


def test_a_joiner_waiting_for_its_first_state_has_the_time_to_receive_it(plan):
    # A joiner says nothing until its whole first state is loaded: the bound grows by the
    # stage's state at FIRST_STATE_RATE (16 MiB here: 0.84 s), not only the no-progress bound.
    from schedc.live.rejoin import FIRST_STATE_RATE

    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    allowed = 10.0 + 16 * 2**20 / FIRST_STATE_RATE
    ctl.clock = allowed - 0.01
    rejoins.check_progress(10.0)
    assert 2 in rejoins.sessions
    ctl.clock = allowed + 0.01
    rejoins.check_progress(10.0)
    assert rejoins.sessions == {}
    assert ("rejoin", "rank 2 stays out: its catch-up made no progress in 10.8 s (no first state yet)") in ctl.notes


def test_two_gpus_of_a_stage_back_at_once_catch_up_in_turn_from_its_one_donor():
    # 3 x 2 with stage 0 left on rank 0 alone: a donor serves one session (its directive names one
    # joiner), so rank 4 waits while rank 2 catches up, and starts once rank 2 is in (then from
    # rank 0 again, the lowest free). Before, rank 4's session took rank 0 over and rank 2 stalled.
    three = schedc.compile(spec_text(dp=3, pp=2))
    gone = schedc.replan(three, ["fail gpu(dp=1, pp=0)", "fail gpu(dp=2, pp=0)"], solver="greedy")
    ctl = FakeController(gone)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    rejoins.request(4, "asked for")
    assert ctl.directives[0] == {"role": "donate", "session": 1, "joiner": 2} and 4 not in rejoins.sessions
    assert ("catch-up", "rank 4 waits for a donor: every live GPU of stage 0 is donating to another GPU coming "
                        "back") in ctl.notes
    rejoins.caught_up(CaughtUp(rank=2, session=1, steps=ctl.completed, bytes=1, t=0.0))
    rejoins.switch_if_ready(ctl.completed)
    assert [sw["ranks"] for sw in ctl.switches] == [[2]]
    ctl.plan = ctl.base_plan = ctl.switches[0]["plan"]
    rejoins.joined(ctl.members)
    rejoins.resume()
    assert ctl.directives[0] == {"role": "donate", "session": 2, "joiner": 4}
    assert ctl.directives[4] == {"role": "join", "session": 2, "donor": 0} and ctl.directives[2] is None


def test_a_catch_up_whose_donor_a_switch_excluded_starts_again_from_another_donor():
    # Rank 0 donates to rank 4, then is excluded as slow (on standby it sends nothing): once the
    # switch is done the session starts again from rank 2, the stage's other live GPU.
    three = schedc.compile(spec_text(dp=3, pp=2))
    gone = schedc.replan(three, "fail gpu(dp=2, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    rejoins = Rejoins(ctl)
    rejoins.request(4, "asked for")
    assert rejoins.sessions[4]["donor"] == 0
    ctl.plan = ctl.base_plan = schedc.replan(gone, "fail gpu(dp=0, pp=0)", solver="greedy")
    rejoins.resume()
    assert rejoins.sessions[4]["donor"] == 2 and rejoins.sessions[4]["session"] == 2
    assert ctl.directives[0] is None and ctl.directives[2] == {"role": "donate", "session": 2, "joiner": 4}


def test_a_growth_that_ends_a_catch_up_says_the_gpu_counts_as_lost_not_that_it_died(plan):
    # A growth kills the processes on standby (no place in the new numbering): a GPU being taken
    # back into the layout that ran counts as lost, said once; its exit then says nothing more.
    gone = schedc.replan(plan, "fail gpu(dp=1, pp=0)", solver="greedy")
    ctl = FakeController(gone)
    rejoins = Rejoins(ctl)
    rejoins.request(2, "asked for")
    assert rejoins.drop_for_growth() == [2] and rejoins.wanted == {} and rejoins.sessions == {}
    rejoins.lost(2)
    assert [m for k, m in ctl.notes if k == "rejoin"][-1] == (
        "rank 2 was being taken back: the job grows onto another layout first: its GPU counts as lost; ask for it "
        "again to grow the job onto it")


def test_rejoin_of_a_running_member_is_a_no_op(plan):
    ctl = FakeController(plan)
    Rejoins(ctl).request(1, "asked for")
    assert ctl.revived == [] and "runs already" in ctl.notes[-1][1]


def _reports(rank, speed, iterations, planned=0.01):
    return [IterationDone(rank=rank, it=i, t0=0.0, t1=1.0, compute=planned / speed, planned=planned)
            for i in iterations]


@pytest.mark.parametrize("mode", ["act", "detect"])
def test_slowness_finds_a_slow_gpu_and_acts_only_in_act_mode(plan, mode):
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode=mode)
    for i in range(40):
        for rank in (0, 1, 2, 3):
            speed = 0.4 if rank == 3 and i >= 10 else 1.0
            (rep,) = _reports(rank, speed, [i])
            slowness.observe(rep, 1.0)
        ctl.completed = i + 1
        slowness.tick(i)
    slow = [m for k, m in ctl.notes if k == "slow"]
    assert slow and slow[0].startswith("rank 3 GPU (dp=1, pp=1) runs at speed 0.40")
    assert not any("rank 0" in m or "rank 1" in m or "rank 2" in m for m in slow)  # healthy peers: no alarm
    assert slowness.decisions and {d["rank"] for d in slowness.decisions} == {3}
    if mode == "act":
        assert [s["kind"] for s in ctl.switches][:1] in (["rebalance"], ["exclude"])
    else:
        assert ctl.switches == [] and "--fail-slow detect" in slowness.decisions[-1]["reason"]


def _feed(slowness, ctl, speed_of, iterations, rates_of=None, noise=0.0, seed=0, wall_of=lambda i: 1.0,
          stalls_of=None, queued_of=None):
    """Every member's report of each iteration (speed_of(rank, i); the iteration lasting
    wall_of(i) seconds; queued_of(rank, i): the share of its compute its thread waited for a
    CPU), heartbeat rates first (rates_of(rank, i) beats per second) and stalled fractions
    (stalls_of(rank, i)), then the iteration's tick."""
    import dataclasses
    import random

    rnd = random.Random(seed)
    for i in iterations:
        if rates_of is not None:
            slowness.beat_rates({r: rates_of(r, i) for r in ctl.members})
        if stalls_of is not None:
            slowness.stalls({r: stalls_of(r, i) for r in ctl.members})
        for rank in ctl.members:
            (rep,) = _reports(rank, speed_of(rank, i) * (1 + rnd.uniform(-noise, noise)), [i])
            queued = rep.compute * queued_of(rank, i) if queued_of is not None else 0.0
            slowness.observe(dataclasses.replace(rep, t1=rep.t0 + wall_of(i), queued=queued), 1.0)
        ctl.completed = i + 1
        slowness.tick(i)


def test_a_rank_that_beats_less_often_while_the_run_keeps_its_pace_is_not_slow(plan):
    # A heartbeat thread starved (a fresh process, a busy interpreter) while the GPU keeps pace:
    # the run is as fast as before, so nobody is slow (found by the simulation: replacement
    # processes after a checkpoint restore were reported at speed 0.62).
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(45), noise=0.05,
          rates_of=lambda r, i: 10.0 if r == 2 and i >= 20 else 20.0)
    assert _slow_notes(ctl) == []



def test_a_starved_rank_rebalanced_for_stays_slow_until_its_own_rate_is_back(plan):
    # Rank 2's heartbeat thread beats at 0.6 of its peers' from 30 to 100 and slows the run until
    # its rebalance; then the run keeps its pace. It was "back to full speed" 5 iterations later
    # (the gate fed the signal healthy readings), then restored, and never found again.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="act")
    switched = []
    real = ctl.switch

    def switch(new_plan, **kw):
        switched.append(ctl.completed)
        return real(new_plan, **kw)

    ctl.switch = switch
    _feed(slowness, ctl, lambda r, i: 1.0, range(160), noise=0.05,
          rates_of=lambda r, i: 12.0 if r == 2 and 30 <= i < 100 else 20.0,
          wall_of=lambda i: 1.6 if 30 <= i and not (switched and i > switched[0]) else 1.0)
    notes = _slow_notes(ctl)
    assert [s["kind"] for s in ctl.switches][:1] == ["rebalance"], notes
    _assert_slow(notes[0], rank=2, speed=0.6, since=30)
    assert len(notes) == 2 and "back to full speed since iteration 100" in notes[1], notes


def test_a_rank_that_beats_less_often_on_a_host_slowed_for_everyone_is_not_slow(plan):
    # Other processes take the CPUs from iteration 20: every iteration takes twice as long, every
    # heartbeat thread beats half as often, and rank 2's, starved a little more, at 0.6 of its
    # peers' (bench/live_false_alarms.py saw a healthy rank at 0.65 under two busy loops). The run
    # is as slow as the host is: nobody holds it up, nobody is slow.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(60), noise=0.05,
          rates_of=lambda r, i: (20.0 if i < 20 else 10.0) * (0.6 if r == 2 and i >= 20 else 1.0),
          wall_of=lambda i: 2.0 if i >= 20 else 1.0)
    assert _slow_notes(ctl) == []



def test_a_member_without_compute_is_judged_by_its_fastest_probe(plan):
    # Rank 2 runs at 0.1 and its plan says so; it has only its probes to show its speed (a
    # rebalanced plan may give it no F, B or W). Its probes compete with its own main thread and
    # a loaded host: most read far slower than the GPU runs, some all five of a window (under
    # four busy loops the fastest of five read 0.03-0.05). It still runs as planned: nothing to
    # report (the median of five once reported it at 0.04). Well again, its first fast probe says so.
    from schedc.live.protocol import Probe

    slow = schedc.replan(plan, [Failure("slow_gpu", dp=1, pp=0, speed=0.1)], deadline=5.0, solver="greedy")
    ctl = FakeController(slow, completed=30)
    slowness = Slowness(ctl)
    for k in range(10):
        slowness.probe(Probe(rank=2, speed=0.1 if k % 3 == 0 else 0.004, t=0.0))
    for k in range(10):
        slowness.probe(Probe(rank=2, speed=0.03, t=0.0))
    assert _slow_notes(ctl) == []
    ctl.completed = 46
    slowness.probe(Probe(rank=2, speed=0.04, t=0.0))
    assert _slow_notes(ctl) == []
    ctl.completed = 47
    slowness.probe(Probe(rank=2, speed=1.0, t=0.0))
    (note,) = _slow_notes(ctl)
    assert note.startswith("rank 2 GPU (dp=1, pp=0) is back to full speed since iteration 47")



def test_a_throttled_rank_does_not_probe_back_to_full_speed_while_still_stopped(plan):
    # Rank 2 was found held stopped half the time and the plan rebalanced for 0.5 (the rank may
    # get no compute, and only its probes show its speed). A probe is a short op: it reads the
    # GPU at full speed while the process is still stopped half the time (bench/live_false_alarms.py:
    # "back to full speed" at iteration 92 of a throttle until 100, then a restore). Its stall
    # clock caps what a probe can say; once the throttle ends, its probes say so.
    from schedc.live.protocol import Probe

    slow = schedc.replan(plan, [Failure("slow_gpu", dp=1, pp=0, speed=0.5)], deadline=5.0, solver="greedy")
    ctl = FakeController(slow, completed=30)
    slowness = Slowness(ctl)
    others = {r: 0.02 for r in ctl.members if r != 2}
    slowness.stalls({**others, 2: 0.5})
    for k in range(10):
        slowness.probe(Probe(rank=2, speed=1.0, t=0.0))
    assert _slow_notes(ctl) == []
    ctl.completed = 40
    slowness.stalls({**others, 2: 0.01})  # the throttle ended
    for k in range(5):
        slowness.probe(Probe(rank=2, speed=1.0, t=0.0))
    (note,) = _slow_notes(ctl)
    assert note.startswith("rank 2 GPU (dp=1, pp=0) is back to full speed")


def test_a_starved_rank_is_found_when_the_plans_first_iterations_were_slow(plan):
    # The first iterations took twice the steady pace (warm-up, a loaded start); from iteration
    # 30 rank 2 is stopped half the time: it beats half as often and the run takes 1.6 x the
    # steady pace, less than its first iterations took (a pace taken from them alone hid it).
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(60), noise=0.05,
          rates_of=lambda r, i: 10.0 if r == 2 and i >= 30 else 20.0,
          wall_of=lambda i: 2.0 if i < 8 else 1.6 if i >= 30 else 1.0)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=2, speed=0.5, since=30)


def _throttle_trace(rank, start, end, held, loaded, length, seed=0):
    """Heartbeat rates and stalled fractions as bench/live_false_alarms.py saw them: every rank
    under load beats at 0.65-1.0 of its peers' rate, now one now another; `rank`, held stopped
    half the time from `start` to `end`, beats at 0.6-0.8 of theirs and its stall clock reads
    `held` (what of its stops it sees), the others' 0-0.02."""
    import random

    rnd = random.Random(seed)
    rates, stalls = {}, {}
    for i in range(length):
        for r in range(16):
            throttled = r == rank and start <= i < end
            rates[r, i] = 20.0 * (rnd.uniform(0.6, 0.8) if throttled else rnd.uniform(0.65, 1.0) if loaded else 1.0)
            stalls[r, i] = held * rnd.uniform(0.8, 1.2) if throttled else rnd.uniform(0.0, 0.02)
    return (lambda r, i: rates[r, i]), (lambda r, i: stalls[r, i])


@pytest.mark.parametrize("loaded", [False, True])
def test_a_process_held_stopped_half_the_time_is_found_by_its_stall_clock(plan, loaded):
    # Rank 2 is stopped from outside (SIGSTOP/SIGCONT, 50% duty) from iteration 30 to 90; its
    # stops fall between its millisecond ops, whose times stay healthy, and its heartbeat rate
    # (0.6-0.8 of its peers') overlaps a healthy rank's under load (0.65 for seconds). Its stall
    # clock sees a third of its stops (under load a stop is blurred); its peers' see nearly none.
    # Found by that, dated from the throttle's start, and back once it ends; nobody else is.
    rates_of, stalls_of = _throttle_trace(2, 30, 90, held=0.35, loaded=loaded, length=130)
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(130), noise=0.05, rates_of=rates_of, stalls_of=stalls_of,
          wall_of=lambda i: 1.6 if 30 <= i < 90 else 1.0)
    down, up = _slow_notes(ctl)
    _assert_slow(down, rank=2, speed=0.65, since=30)
    assert slowness.speeds[2] >= 0.95 and "back to full speed since iteration 9" in up
    assert [e["signal"] for k, m, e in ctl.events if k == "slow"] == ["stall", "stall"]


def test_a_throttle_switched_for_is_found_over_once_it_ends(plan):
    # Rank 2 held stopped from 30 to 120 (its heartbeat rate too low for the gate, 0.6-0.8 with
    # the run slowed): found by its stall clock and rebalanced for. Once the throttle ends, it is
    # back to full speed: the switch told only the measure that found it to expect its speed (the
    # heartbeat rate's tracker, told so too, held the rank at that speed for the rest of the run).
    rates_of, stalls_of = _throttle_trace(2, 30, 120, held=0.4, loaded=False, length=200)
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="act")
    _feed(slowness, ctl, lambda r, i: 1.0, range(200), noise=0.05, rates_of=rates_of, stalls_of=stalls_of,
          wall_of=lambda i: 1.6 if 30 <= i < 120 else 1.0)
    notes = _slow_notes(ctl)
    assert ctl.switches and ctl.switches[0]["kind"] in ("rebalance", "exclude") and ctl.switches[0]["ranks"] == [2]
    assert notes and "back to full speed since iteration 12" in notes[-1], notes


def test_a_plan_change_moves_healthy_ranks_levels_and_no_one_is_slow_for_it(plan):
    # A switch at iteration 40 splits the layers anew: the cost model misses rank 0's real op
    # times by another factor under the new split, and it reads 0.55 of its former level
    # against its peers' from then on, at full speed (bench/live_false_alarms.py: a healthy rank
    # of another pipeline read 0.33-0.6 after a rebalance for a throttled one, and was reported
    # slow). Its level is learned anew; a slowdown after that is still found.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    level = lambda r, i: 0.55 if r == 0 and i >= 40 else 1.0  # noqa: E731
    _feed(slowness, ctl, level, range(40), noise=0.05)
    slowness.after_plan_change()
    _feed(slowness, ctl, level, range(40, 120), noise=0.05)
    assert _slow_notes(ctl) == []
    _feed(slowness, ctl, lambda r, i: level(r, i) * (0.4 if r == 1 else 1.0), range(120, 160), noise=0.05)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=1, speed=0.4, since=120)


def test_a_ranks_first_iterations_under_a_new_plan_do_not_set_its_level(plan):
    # After a switch at iteration 40 rank 0 settles into the new plan sooner than its peers: it
    # reads 3x their speed for 8 iterations, then as before (bench/live_false_alarms.py: a
    # healthy stage-0 rank read 1.5-5.4 over its first 8 after a rebalance, and was reported at
    # 0.26 against an offset learned from them). Nobody is slow; a slowdown after is still found.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    settling = lambda r, i: 3.0 if r == 0 and 40 <= i < 48 else 1.0  # noqa: E731
    _feed(slowness, ctl, settling, range(40), noise=0.05)
    slowness.after_plan_change()
    _feed(slowness, ctl, settling, range(40, 120), noise=0.05)
    assert _slow_notes(ctl) == []
    _feed(slowness, ctl, lambda r, i: 0.4 if r == 0 else 1.0, range(120, 160), noise=0.05)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=0, speed=0.4, since=120)


def test_a_starved_heartbeat_without_stalls_is_not_slow(plan):
    # Under load every rank's heartbeat rate wanders (0.65-1.0 of its peers'), the run slows
    # with the host, and no process is held stopped: nobody is slow.
    rates_of, stalls_of = _throttle_trace(2, 30, 30, held=0.0, loaded=True, length=200)
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(200), noise=0.05, rates_of=rates_of, stalls_of=stalls_of,
          wall_of=lambda i: 1.3 if i % 40 >= 20 else 1.0)
    assert _slow_notes(ctl) == []


def _slow_notes(ctl):
    return [m for k, m in ctl.notes if k == "slow"]


def _assert_slow(note, *, rank, speed, since):
    import re

    m = re.match(r"rank (\d+) GPU .* runs at speed ([\d.]+) since iteration (\d+)", note)
    assert m and int(m[1]) == rank and abs(float(m[2]) - speed) <= 0.05 and abs(int(m[3]) - since) <= 1, note


@pytest.mark.parametrize("host", [0.3, 0.6])
def test_a_host_slowed_for_every_rank_is_no_gpus_slowness(plan, host):
    # Every rank's compute slows alike at iteration 15 (other processes took the CPUs), and
    # again by half of that at 40 for a while: no GPU is slow, nothing is switched.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl)
    _feed(slowness, ctl, lambda r, i: 1.0 if i < 15 else host if not 40 <= i < 60 else host / 2, range(100),
          noise=0.1)
    assert _slow_notes(ctl) == [] and ctl.switches == [] and slowness.decisions == []
    assert slowness.host_speed() == pytest.approx(host, rel=0.15)  # what probes are judged against


def test_a_gpu_slowed_on_a_loaded_host_is_found_at_its_speed_against_its_peers(plan):
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: (0.6 if i >= 12 else 1.0) * (0.5 if r == 1 and i >= 20 else 1.0), range(45),
          noise=0.05)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=1, speed=0.5, since=20)
    assert slowness.net_of_load(1, 0.5, 20) == 0.5  # nobody waited for a CPU (a GPU's kernels): nothing moves


def test_a_rank_the_scheduler_runs_half_as_much_as_its_peers_is_load_not_a_slow_gpu(plan):
    # A loaded host: from iteration 20 to 60 the scheduler runs rank 1's thread half as much as
    # its peers' (it waits for a CPU half of its compute time, they a tenth), so its compute
    # takes 0.55 of their speed. Its GPU is healthy: no slow report, no switch; the reason is said.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl)
    starved = lambda r, i: r == 1 and 20 <= i < 60  # noqa: E731
    _feed(slowness, ctl, lambda r, i: 0.9 * (0.5 / 0.9 if starved(r, i) else 1.0), range(90), noise=0.05,
          queued_of=lambda r, i: 0.5 if starved(r, i) else 0.1)
    assert _slow_notes(ctl) == [] and ctl.switches == [] and slowness.decisions == []
    (load,) = [m for k, m in ctl.notes if k == "load"]
    assert load.startswith("rank 1 GPU (dp=0, pp=1) computes at 0.5") and "host load, not a slow GPU" in load


def test_a_slow_gpu_is_found_net_of_its_waits_for_a_cpu(plan):
    # Rank 2's GPU runs at 0.5 from iteration 20, and its thread also waits for a CPU a fifth of
    # its compute time (its peers never): it computes at 0.4 of its peers' speed, of which load
    # explains a fifth; the GPU is reported at 0.5.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    slow = lambda r, i: r == 2 and i >= 20  # noqa: E731
    _feed(slowness, ctl, lambda r, i: 0.4 if slow(r, i) else 1.0, range(45), noise=0.05,
          queued_of=lambda r, i: 0.2 if slow(r, i) else 0.0)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=2, speed=0.5, since=20)
    assert not [m for k, m in ctl.notes if k == "load"]


def test_a_gpu_slowed_on_a_host_where_every_rank_waits_alike_is_found(plan):
    # Every thread waits for a CPU 40% of its compute time (a loaded host) and rank 3's GPU runs
    # at 0.5 from iteration 20: the waits, alike for every rank, explain none of it.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 0.3 if r == 3 and i >= 20 else 0.6, range(45), noise=0.05,
          queued_of=lambda r, i: 0.4)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=3, speed=0.5, since=20)


def test_a_rank_that_beats_half_as_often_as_its_peers_is_slow_though_its_ops_time_normal(plan):
    # A process stopped half the time between its ops: its timed ops look healthy, but its
    # heartbeat thread runs half as often as its peers'.
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl, mode="detect")
    _feed(slowness, ctl, lambda r, i: 1.0, range(45), noise=0.05,
          rates_of=lambda r, i: 10.0 if r == 2 and i >= 20 else 20.0,
          wall_of=lambda i: 2.0 if i >= 20 else 1.0)  # (the whole pipeline waits for it)
    (note,) = _slow_notes(ctl)
    _assert_slow(note, rank=2, speed=0.5, since=20)


def test_a_probe_is_judged_against_the_hosts_speed(plan):
    # Rank 3 was excluded; the host then got slower for every member (0.6): probes at 0.6 are a
    # healthy GPU on a loaded host, so taking it back is priced.
    without = schedc.replan(plan, [Failure("fail_gpu", dp=1, pp=1)], deadline=5.0, solver="greedy")
    ctl = FakeController(without, completed=0)
    slowness = Slowness(ctl)
    _feed(slowness, ctl, lambda r, i: 1.0 if i < 15 else 0.6, range(30))
    slowness.excluded.add(3)
    from schedc.live.protocol import Probe

    for _ in range(5):
        slowness.probe(Probe(rank=3, speed=0.6, t=0.0))
    assert any("probes healthy again" in m for m in _slow_notes(ctl))


# -- the survivors' layout (`survivor_layout`): the job's pipelines while they fit, then fewer ------


def test_survivors_keep_the_jobs_pipelines_while_they_can_hold_them():
    from schedc.live.layouts import survivor_layout

    spec = load_text(spec_text(dp=3, pp=3))
    layout = survivor_layout(spec, [0, 2, 3, 5, 6, 8])  # stage 1 lost
    assert (layout.dp, layout.pp, layout.microbatches) == (3, 2, 3)


def test_survivors_too_few_for_the_jobs_pipelines_keep_its_global_batch_on_fewer():
    from schedc.live.layouts import survivor_layout

    spec = load_text(spec_text(dp=3, pp=3))
    layout = survivor_layout(spec, [2, 8])  # 2 GPUs: 3 pipelines do not fit
    assert layout.dp * layout.microbatches == 9 and layout.dp < 3
    assert {r for row in layout.ranks for r in row} <= {2, 8}


def test_the_gpus_an_in_place_move_needs_are_kept_in_the_layout():
    from schedc.live.layouts import covers, survivor_layout

    spec = load_text(spec_text(dp=3, pp=3))
    survivors = [0, 2, 3, 5, 8]  # stage 1 lost; 3 x 1 runs on 3 of the 5
    plain = survivor_layout(spec, survivors)
    assert (plain.dp, plain.pp) == (3, 1)
    keep = [[0, 3], [8], [2, 5, 8]]  # stage 0's GPUs; stage 1's only exact shadow (on 8); stage 2's
    assert not covers(plain.gpus, keep)  # the lowest ranks would leave stage 1's state behind
    kept = survivor_layout(spec, survivors, keep)
    assert covers(kept.gpus, keep) and (kept.dp, kept.pp) == (3, 1)


def test_a_stage_no_running_process_holds_is_nothing_to_keep_and_no_move_in_place():
    # (asked while that stage's loss is being recovered: min() of its empty group ended the supervisor)
    from schedc.live.layouts import covers, layout_candidates

    spec = load_text(spec_text(dp=2, pp=3))
    keep = [[0], []]
    layouts = layout_candidates(spec, [0, 2, 3, 5], keep)
    assert layouts and all(0 in layout.gpus for layout in layouts)
    assert not any(covers(layout.gpus, keep) for layout in layouts)


TINY_GPT = """
model "g" { layers = 8  hidden = 256  heads = 4  seq_len = 128  vocab = 1000  microbatch_size = 1  precision = bf16 }
cluster { dp = 2  pp = 2  gpus_per_node = 1  gpu { memory = 40GiB  flops = 312TFLOPS  efficiency = 0.45 }
          link { latency = 20us  bandwidth = 25GB/s } }
train { microbatches = 4 }
schedule { solver = greedy }
"""


def test_a_growth_in_place_is_priced_by_the_layers_one_gpu_lacks_at_most():
    """`growth_option` (what `auto`'s ski rental weighs a growth by): reconfiguring, and the largest
    share of state one GPU receives: the layers of its new stage it does not hold now."""
    from schedc.layout import bytes_of, units_of
    from schedc.live.layouts import growth_option
    from schedc.recovery_cost import Costs

    plan = schedc.compile(TINY_GPT)
    units, costs = units_of(plan.spec), Costs()
    (a0, b0), (a1, b1) = plan.spec.partition
    everyone = {r: r for r in range(4)}
    same = growth_option(costs, plan.spec, plan, everyone, plan, everyone, in_place=True)
    assert same.moved_bytes == 0 and same.transition_s == pytest.approx(costs.reconfigure_s)
    # GPU 3 (pipeline 1, stage 1) comes back with nothing: it receives its stage's layers.
    back = growth_option(costs, plan.spec, plan, {0: 0, 1: 1, 2: 2}, plan, everyone, in_place=True)
    assert back.moved_bytes == bytes_of(units, range(a1, b1)) > 0
    assert back.transition_s == pytest.approx(costs.reconfigure_s + back.moved_bytes / 25e9)
    # GPUs 2 and 3 ran each other's stage: each receives the other's layers; the larger share counts.
    swapped = growth_option(costs, plan.spec, plan, {0: 0, 1: 1, 2: 3, 3: 2}, plan, everyone, in_place=True)
    assert swapped.moved_bytes == max(bytes_of(units, range(a0, b0)), bytes_of(units, range(a1, b1)))
    assert swapped.iteration_s == plan.metrics.iteration_time / 1e6 and swapped.method == "repartition"
    # A growth that restarts every process pays the restart's fixed part instead (no work lost:
    # it starts from the checkpoint just written).
    restart = growth_option(costs, plan.spec, plan, {0: 0, 1: 1, 2: 2}, plan, everyone, in_place=False)
    assert restart.method == "restart" and restart.moved_bytes == 0
    assert restart.transition_s == pytest.approx(costs.reconfigure_s + costs.restart_s)


def test_a_growth_of_a_stages_block_is_priced_by_its_whole_new_stage():
    # With a `stages` block the merged stages are not matched unit by unit: each GPU is priced as
    # receiving its whole new stage (an upper bound).
    from schedc.live.layouts import growth_option
    from schedc.recovery_cost import Costs

    plan = schedc.compile(spec_text(dp=2, pp=2))
    everyone = {r: r for r in range(4)}
    option = growth_option(Costs(), plan.spec, plan, everyone, plan, everyone, in_place=True)
    assert option.moved_bytes == max(s.static for s in plan.spec.stages) == 16 * 2**20


def test_a_re_partition_plans_the_layouts_its_deadline_predicts_room_for_and_always_the_jobs_own():
    """`laid_out` weighs the job's pipelines of fewer stages and the best shapes by estimate; which
    of them are planned is decided by their predicted planning time against the replan deadline,
    not by the clock (the same choice on every run): with no room, only the first, the job's own."""
    plan = schedc.compile(spec_text(dp=2, pp=3))
    survivors = [0, 2, 3, 5]  # stage 1 lost

    def weighed(deadline_s):
        policy = RecoveryPolicy(FakeController(plan), method="repartition", max_restarts=3, initial_plan=plan,
                                latest_checkpoint=lambda: None, deadline_s=deadline_s)
        best, options = policy.laid_out(plan.spec, survivors, cover=False, price=lambda layout: (1.0, 0),
                                        work_iterations=1000)
        assert all(best.time_to_train(1000) <= o.time_to_train(1000) for o in options)
        return best, [o.detail for o in options]

    # (3 x 1 wins here: 0.5 ms slower an iteration than 2 x 2 over 1,000 iterations, but its one
    # stage has 3 replicas where 2 x 2's have 2, so it risks far less of a restore)
    best, every = weighed(0.5)
    assert every == ["2 x 2", "3 x 1", "1 x 3"] and best.detail == "3 x 1"
    assert weighed(1e-9)[1] == ["2 x 2"]


def test_spare_gpus_on_a_host_whose_agent_does_not_answer_are_not_offered():
    """`Controller.spares` (what a re-partition may start fresh processes on) asks the spare GPUs'
    hosts as `unreachable` asks: a GPU on a host found gone is no spare, and the host is said
    gone once."""
    from schedc.live.control import SupervisorControl
    from schedc.live.hosts import Hosts

    class Fleet:
        asked: list[list[int]] = []

        def host_of_gpu(self, gpu):
            return {6: 1, 7: 2, 8: 2}[gpu]

        def answers(self, hosts, within, note):
            self.asked.append(list(hosts))
            for h in hosts:
                if h == 2:
                    note(h)
            return {h for h in hosts if h != 2}

        def back(self, hosts):
            return set()

    class Sup(Hosts):
        def __init__(self):
            self.spare, self.hosts_gone, self.fleet, self.notes = {6, 7, 8}, set(), Fleet(), []

        def _note(self, kind, message, **details):
            self.notes.append((kind, message))

    sup = Sup()
    ctl = SupervisorControl(sup)
    assert ctl.spares() == [6] and sup.hosts_gone == {2}
    assert ctl.spares() == [6]  # (a host found gone is not asked again)
    assert sup.fleet.asked == [[1, 2], [1]]
    assert [kind for kind, _ in sup.notes] == ["host"]


def test_an_exclusion_whose_switch_was_abandoned_is_priced_again_as_the_rank_runs(plan):
    # Rank 2 was to be excluded at speed 0.3; a failure came first and the switch was abandoned,
    # so rank 2 runs on in the plan that ran. It was left "excluded" with no speed: slow, in the
    # plan, and never looked at again. Now the next plan change prices it again (a decision).
    ctl = FakeController(plan, completed=12)
    slowness = Slowness(ctl, mode="act")
    slowness.excluded.add(2)
    slowness._excluded_speed[2] = 0.3  # (what `_act` leaves for an exclusion it switched for)
    slowness.after_plan_change()
    assert 2 not in slowness.excluded and slowness.speeds[2] == 0.3
    assert [d["rank"] for d in slowness.decisions] == [2], slowness.decisions


def test_ranks_numbered_anew_have_their_speeds_learned_afresh(plan):
    # Rank 2 was found slow and rebalanced; a re-partition then numbers the GPUs anew, and another
    # GPU runs as rank 2: it is not that GPU's slowness (nor is rank 2's new GPU excluded).
    ctl = FakeController(plan, completed=0)
    slowness = Slowness(ctl)
    for i in range(40):
        for r in (0, 1, 2, 3):
            (rep,) = _reports(r, 0.4 if r == 2 and i >= 10 else 1.0, [i])
            slowness.observe(rep, 1.0)
        ctl.completed = i + 1
        slowness.tick(i)
    assert slowness.speeds.get(2, 1.0) < 0.8, slowness.speeds
    slowness.excluded.add(2)
    slowness.relabelled()
    assert slowness.speeds == {} and slowness.trackers == {} and slowness.excluded == set()


def test_a_host_found_gone_whose_agent_beats_again_is_back():
    """An agent busy for over a second (a forkserver started anew blocks it) misses its two beats
    and its host is found gone; once it beats twice more, the host is back (said), and its spare
    GPUs with it. Before, a host found gone stayed gone for the rest of the run."""
    from schedc.live.agent import Fleet
    from schedc.live.control import SupervisorControl
    from schedc.live.hosts import Hosts

    class Job:
        beats, beating = {1: 5}, False  # (a beating agent beats between any two reads)

        def agent_beats(self, host):
            self.beats[host] += self.beating
            return self.beats[host]

    fleet = Fleet.__new__(Fleet)  # (its store and host map only: no agent of its own)
    fleet.job, fleet._gone_at, fleet.gpu_host, fleet.physical = Job(), {}, {6: 1}, {}

    class Sup(Hosts):
        def __init__(self):
            self.spare, self.hosts_gone, self.fleet, self.notes = {6}, set(), fleet, []

        def _note(self, kind, message, **details):
            self.notes.append((kind, message))

    sup = Sup()
    ctl = SupervisorControl(sup)
    assert ctl.spares() == [] and sup.hosts_gone == {1}  # (no beat within the second: gone)
    Job.beats[1] = 6
    assert ctl.spares() == [] and fleet.back({1}) == set()  # one beat could be the last before it died
    Job.beating = True
    assert ctl.spares() == [6] and sup.hosts_gone == set()
    assert sup.notes[-1] == ("host", "host 1 answers again: its agent beats (paused or starved of a CPU, not gone)")


def test_e553_says_the_planner_refused_every_layout_and_why(monkeypatch):
    # Every layout of the survivors passes the estimate and is refused by the planner: E553 says so
    # (not "cannot hold one pipeline") and shows the planner's own diagnostic after it.
    import schedc.repartition as repartition
    from schedc.diagnostics import RunError, SchedcError, error

    def refuse(spec, layout, *args, **kwargs):
        raise SchedcError([error("E330", f"{layout.dp} x {layout.pp} does not fit")])

    monkeypatch.setattr(repartition, "plan_layout", refuse)
    plan = schedc.compile(spec_text(dp=2, pp=3))
    policy = RecoveryPolicy(FakeController(plan), method="repartition", max_restarts=3, initial_plan=plan,
                            latest_checkpoint=lambda: None)
    with pytest.raises(RunError) as info:
        policy.decide(plan, [1, 4], {1, 4}, in_place="restore")
    first = info.value.diagnostics[0]
    assert first.code == "E553" and "the planner refused every layout of the 4 surviving GPU(s) (below)" in first.message
    assert "E330" in info.value.codes and "cannot hold one pipeline" not in first.message


def test_a_spare_gpu_on_a_host_found_gone_does_not_count_toward_growing_back():
    # The job (2 x 2) runs re-partitioned on GPUs 0 and 1; GPUs 2 and 3 are spare, 3 on host 1,
    # found gone. With 3 counted as up, every GPU of the job would be up and the job would grow
    # onto its spec, starting a process on a host whose agent does not answer.
    from types import SimpleNamespace

    from schedc.live.growth import Growth

    initial = schedc.compile(spec_text(dp=2, pp=2))
    asked = []
    sup = SimpleNamespace(
        recovery=SimpleNamespace(initial_plan=initial, horizon=SimpleNamespace(seconds=900.0),
                                 laid_out=lambda spec, up, *a, **k: asked.append(up)),
        physical={0: 0, 1: 1}, gen=SimpleNamespace(members=(0, 1), number=3), dead=set(), spare={2, 3},
        fleet=SimpleNamespace(host_of_gpu=lambda gpu: 1 if gpu == 3 else 0), hosts_gone={1},
        _growth_cache=None, plan=initial)
    assert Growth._growth_target(sup) is None
    assert asked == [[0, 1, 2]]  # weighed without GPU 3
    sup.hosts_gone, sup._growth_cache = set(), None
    assert Growth._growth_target(sup)[0] is initial  # (its host back: every GPU of the job is up)
