"""The verifier rejects each kind of broken schedule with the right code (docs/architecture.md, the meaning of a schedule)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedc.diagnostics import VerificationError
from schedc.instance import Instance, make_instance
from schedc.schedule import OpId, Schedule, ScheduledOp, SolverInfo
from schedc.simulate_engine import schedule_from_programs
from schedc.verify import (MAX_DIAGNOSTICS, check_schedule, diagnose, format_grid, memory_profile,
                           schedule_passes, verify_schedule)

from tests.strategies import instances

GOLDEN = Path(__file__).parent / "golden" / "verify"


# -- hand-written programs (independent of the solvers under test) -----------------


def _backward(inst: Instance, d: int, s: int, m: int) -> list[OpId]:
    return [OpId("B", d, s, m)] + ([OpId("W", d, s, m)] if inst.decouple_backward else [])


def one_f_one_b_programs(inst: Instance) -> dict[int, list[OpId]]:
    """Classic 1F1B per pipeline on its own GPUs: S-1-s warm-up forwards, then F/B pairs."""
    progs = {}
    for g in inst.gpus:
        d, s, M = g.dp, g.pp, inst.microbatches
        warm = min(inst.pp - 1 - s, M)
        prog = [OpId("F", d, s, m) for m in range(warm)]
        nf = warm
        for nb in range(M):
            if nf < M:
                prog.append(OpId("F", d, s, nf))
                nf += 1
            prog += _backward(inst, d, s, nb)
        progs[g.rank] = prog + [OpId("O", d, s)]
    return progs


def gpipe_programs(inst: Instance) -> dict[int, list[OpId]]:
    progs = {}
    for g in inst.gpus:
        d, s, M = g.dp, g.pp, inst.microbatches
        prog = [OpId("F", d, s, m) for m in range(M)]
        for m in range(M):
            prog += _backward(inst, d, s, m)
        progs[g.rank] = prog + [OpId("O", d, s)]
    return progs


def rerouted_programs(inst: Instance, dead: tuple[int, int], host: int) -> dict[int, list[OpId]]:
    """1F1B where the failed GPU's ops are appended (before O) to a live peer of its stage."""
    progs = one_f_one_b_programs(inst)
    moved = [o for o in progs.pop(inst.gpu(*dead).rank) if o.kind != "O"]
    host_rank = inst.gpu(host, dead[1]).rank
    progs[host_rank] = progs[host_rank][:-1] + moved + progs[host_rank][-1:]
    return progs


def hand_schedule(inst: Instance, programs=one_f_one_b_programs) -> Schedule:
    return schedule_from_programs(inst, programs(inst), SolverInfo(name="hand"))


def base_instance(**kw) -> Instance:
    args = dict(forward=1000, backward_input=1000, backward_weight=800, optimizer=300,
                activation=1 << 20, stash=1 << 18, static=1 << 22, send=1 << 20,
                latency=10, bandwidth=1_000_000_000)
    args.update(kw)
    return make_instance(2, 3, 4, **args)


def op_of(schedule: Schedule, op_id: OpId) -> ScheduledOp:
    return next(o for o in schedule.ops if o.id == op_id)


def with_op(schedule: Schedule, op_id: OpId, **changes) -> Schedule:
    """The schedule with one op's fields changed."""
    ops = tuple(replace(o, **changes) if o.id == op_id else o for o in schedule.ops)
    return replace(schedule, ops=ops)


def codes_of(schedule: Schedule) -> list[str]:
    return [d.code for d in check_schedule(schedule)]


def messages_of(schedule: Schedule) -> str:
    return "\n".join(d.message for d in check_schedule(schedule))


# -- valid schedules pass -----------------------------------------------------------


@pytest.mark.parametrize("decouple", [True, False])
@pytest.mark.parametrize("stagger", [True, False])
@pytest.mark.parametrize("programs", [one_f_one_b_programs, gpipe_programs])
def test_hand_written_schedules_pass(decouple, stagger, programs):
    inst = base_instance(decouple_backward=decouple, stagger_optimizer=stagger)
    verify_schedule(hand_schedule(inst, programs))


def test_rerouted_schedule_with_slow_gpu_passes():
    inst = base_instance(failed=[(1, 1)], slow={(0, 2): 0.6})
    sched = hand_schedule(inst, lambda i: rerouted_programs(i, (1, 1), 0))
    assert sched.rerouted  # the test is about re-routed work
    verify_schedule(sched)


# -- one mutation per rule ------------------------------------------------------------


def test_dropped_op():
    sched = hand_schedule(base_instance())
    victim = OpId("W", 1, 2, 3)
    broken = replace(sched, ops=tuple(o for o in sched.ops if o.id != victim))
    assert codes_of(broken) == ["E401"]
    assert "d1:2W3 is missing" in messages_of(broken)


def test_duplicated_op():
    sched = hand_schedule(base_instance())
    broken = replace(sched, ops=sched.ops + (op_of(sched, OpId("F", 0, 1, 2)),))
    assert "E401" in codes_of(broken)
    assert "d0:1F2 is scheduled twice" in messages_of(broken)


def test_missing_optimizer_and_w_without_decoupling():
    inst = base_instance(decouple_backward=False)
    sched = hand_schedule(inst)
    no_o = replace(sched, ops=tuple(o for o in sched.ops if o.id != OpId("O", 1, 0)))
    assert codes_of(no_o) == ["E401"] and "d1:0O is missing" in messages_of(no_o)
    extra_w = ScheduledOp(rank=0, kind="W", dp=0, pp=0, mb=0, start=10**7, end=10**7 + 800)
    broken = replace(sched, ops=sched.ops + (extra_w,))
    assert "decouple_backward is off" in messages_of(broken)


def test_op_on_failed_gpu():
    inst = base_instance(failed=[(1, 1)])
    sched = hand_schedule(inst, lambda i: rerouted_programs(i, (1, 1), 0))
    dead = inst.gpu(1, 1).rank
    broken = with_op(sched, OpId("F", 1, 1, 0), rank=dead)
    assert "E402" in codes_of(broken)
    assert f"d1:1F0 runs on rank {dead} (dp=1, pp=1), which failed" in messages_of(broken)


def test_op_on_wrong_stage_gpu():
    sched = hand_schedule(base_instance())
    broken = with_op(sched, OpId("O", 0, 1), rank=sched.instance.gpu(0, 2).rank)
    assert "E402" in codes_of(broken)
    assert "d0:1O of stage 1 runs on rank 2, a GPU of stage 2" in messages_of(broken)


def test_f_b_w_split_across_executors():
    inst = base_instance()
    sched = hand_schedule(inst)
    # Move W of (d0, m1, s1) to the other pipeline's GPU of stage 1, at a time that GPU is idle.
    other = inst.gpu(1, 1).rank
    w = op_of(sched, OpId("W", 0, 1, 1))
    start = sched.makespan + 1000
    broken = with_op(sched, w.id, rank=other, start=start, end=start + w.duration)
    assert "E402" in codes_of(broken)
    assert "share one executor" in "\n".join(d.hint for d in check_schedule(broken))


def test_dependency_violated_by_one_microsecond():
    inst = base_instance()
    sched = hand_schedule(inst)
    f = op_of(sched, OpId("F", 1, 2, 0))
    pred = op_of(sched, OpId("F", 1, 1, 0))
    earliest = pred.end + inst.boundary_transfer(1)
    assert f.start == earliest  # ASAP timing: the edge is tight
    broken = with_op(sched, f.id, start=f.start - 1, end=f.end - 1)
    assert codes_of(broken) == ["E403"]


def test_transfer_time_ignored():
    inst = base_instance()
    sched = hand_schedule(inst)
    b = op_of(sched, OpId("B", 0, 0, 0))
    pred = op_of(sched, OpId("B", 0, 1, 0))
    assert inst.boundary_transfer(0) > 0
    broken = with_op(sched, b.id, start=pred.end, end=pred.end + b.duration)
    assert "E403" in codes_of(broken)
    assert "transfer" in messages_of(broken)


def test_overlap_on_one_gpu():
    inst = base_instance()
    sched = hand_schedule(inst)
    # The last stage's first F and B: stretch F's slot by starting B inside it.
    f, b = op_of(sched, OpId("F", 0, 2, 1)), op_of(sched, OpId("B", 0, 2, 0))
    assert f.end <= b.start or b.end <= f.start
    broken = with_op(sched, f.id, start=b.start + 1, end=b.start + 1 + f.duration)
    assert "E404" in codes_of(broken)


def test_wrong_duration():
    sched = hand_schedule(base_instance())
    o = op_of(sched, OpId("O", 1, 1))
    broken = with_op(sched, o.id, end=o.end + 1)
    assert codes_of(broken) == ["E405"]
    assert "lasts 301 us" in messages_of(broken)


def test_wrong_duration_on_slow_gpu():
    inst = base_instance(slow={(0, 1): 0.6})
    sched = hand_schedule(inst)
    f = op_of(sched, OpId("F", 0, 1, 0))
    assert f.duration == 1667  # ceil(1000 / 0.6)
    broken = with_op(sched, f.id, end=f.start + 1000)
    assert "E405" in codes_of(broken)


def test_memory_over_the_limit_by_one_byte():
    inst = base_instance()
    sched = hand_schedule(inst)
    peak = max(memory_profile(inst, r, p).peak for r, p in sched.programs.items())
    at_limit = replace(sched, instance=replace(inst, gpu_memory=peak))
    assert codes_of(at_limit) == []
    over = replace(sched, instance=replace(inst, gpu_memory=peak - 1))
    assert set(codes_of(over)) == {"E406"}
    assert "1 bytes over" in messages_of(over)


def test_memory_frees_before_allocations_at_the_same_instant():
    # GPipe-like order on one GPU: F0 B0 W0 F1 ... back to back; one microbatch in flight at a time.
    inst = make_instance(1, 1, 3, forward=100, backward_input=100, backward_weight=100,
                         activation=1000, stash=400, static=50, gpu_memory=1050)
    progs = {0: [OpId(k, 0, 0, m) for m in range(3) for k in "FBW"] + [OpId("O", 0, 0)]}
    verify_schedule(schedule_from_programs(inst, progs, SolverInfo(name="hand")))


def test_optimizer_before_a_w_of_its_stage():
    # Pipeline 1's GPU of stage 1 is slow, so its last W ends after pipeline 0's.
    inst = base_instance(slow={(1, 1): 0.5})
    sched = hand_schedule(inst)
    rank = inst.gpu(0, 1).rank
    prog = sched.program(rank)
    o = prog[-1]
    early = prog[-2].end
    assert early < op_of(sched, OpId("W", 1, 1, 3)).end
    broken = with_op(sched, o.id, start=early, end=early + o.duration)
    assert codes_of(broken) == ["E407"]
    assert "d0:1O on rank 1 starts at" in messages_of(broken)
    assert "d1:1W3 of its own stage" in messages_of(broken)


def test_optimizer_before_a_w_of_another_stage_without_staggering():
    inst = base_instance(stagger_optimizer=False)
    sched = hand_schedule(inst)
    prog = sched.program(inst.gpu(0, 2).rank)
    o = prog[-1]
    early = prog[-2].end  # the last stage finishes its Ws long before stage 0 does
    broken = with_op(sched, o.id, start=early, end=early + o.duration)
    assert codes_of(broken) == ["E407"]
    assert "of stage 0 ends" in messages_of(broken)
    # The same O time is fine with staggering: only its own stage counts.
    staggered = replace(broken, instance=replace(inst, stagger_optimizer=True))
    assert codes_of(staggered) == []


def test_op_after_optimizer():
    inst = base_instance()
    sched = hand_schedule(inst)
    f = op_of(sched, OpId("F", 0, 0, 0))
    late = sched.makespan + 5000
    # F0 of stage 0 moved after O; stage 1's F0 still waits on the original time (E403 too).
    broken = with_op(sched, f.id, start=late, end=late + f.duration)
    assert "E407" in codes_of(broken)
    assert "d0:0F0 runs on rank 0 after its optimizer op d0:0O" in messages_of(broken)


def test_malformed_times():
    sched = hand_schedule(base_instance())
    f = op_of(sched, OpId("F", 0, 0, 0))
    assert codes_of(with_op(sched, f.id, start=-5, end=995)) == ["E408"]
    assert "E408" in codes_of(with_op(sched, f.id, start=10, end=5))


def test_all_violations_are_reported_and_capped():
    sched = hand_schedule(base_instance())
    # Every op 1 us late lasts 1 us too long: one E405 per op, far more than the cap.
    broken = replace(sched, ops=tuple(replace(o, end=o.end + 1) for o in sched.ops))
    with pytest.raises(VerificationError) as exc:
        verify_schedule(broken)
    diags = exc.value.diagnostics
    assert len(diags) == MAX_DIAGNOSTICS
    assert diags[-1].code == "E400" and "more violations" in diags[-1].message


def test_grid_marks_the_failing_step():
    grid = format_grid({0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1B0"]}, error_rank=1, error_step=1)
    lines = grid.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[2].startswith("Step 1: 0F1") and lines[2].endswith("*1B0 <-- ERROR HERE")


# -- golden text ----------------------------------------------------------------------------


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("SCHEDC_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_golden_dependency_with_transfer():
    inst = base_instance()
    sched = hand_schedule(inst)
    f = op_of(sched, OpId("F", 1, 2, 0))
    broken = with_op(sched, f.id, start=f.start - 1, end=f.end - 1)
    with pytest.raises(VerificationError) as exc:
        verify_schedule(broken)
    _golden("dependency.txt", exc.value.render() + "\n")


def test_golden_memory():
    inst = base_instance()
    sched = hand_schedule(inst)
    peak = max(memory_profile(inst, r, p).peak for r, p in sched.programs.items())
    over = replace(sched, instance=replace(inst, gpu_memory=peak - 1))
    with pytest.raises(VerificationError) as exc:
        verify_schedule(over)
    _golden("memory.txt", exc.value.render() + "\n")


# -- the fast path decides exactly as the rule-by-rule checker ------------------------------


def blocks_programs(inst: Instance) -> dict[int, list[OpId]]:
    """1F1B blocks per pipeline; a failed GPU's block runs on the first live peer of its stage.

    Every rank runs its blocks in pipeline order, so no two ranks wait on each other.
    """
    blocks: dict[int, list[list[OpId]]] = {g.rank: [] for g in inst.live_gpus()}
    for d in range(inst.dp):
        for s, prog in enumerate(_one_f_one_b_block(inst, d, s) for s in range(inst.pp)):
            gpu = inst.gpu(d, s)
            host = gpu if gpu.live else inst.live_gpus(s)[0]
            blocks[host.rank].append(prog)
    return {r: [op for b in bs for op in b] + [OpId("O", inst.gpus[r].dp, inst.gpus[r].pp)]
            for r, bs in blocks.items()}


def _one_f_one_b_block(inst: Instance, d: int, s: int) -> list[OpId]:
    M = inst.microbatches
    warm = min(inst.pp - 1 - s, M)
    prog, nf = [OpId("F", d, s, m) for m in range(warm)], warm
    for nb in range(M):
        if nf < M:
            prog.append(OpId("F", d, s, nf))
            nf += 1
        prog += _backward(inst, d, s, nb)
    return prog


def _mutate(sched: Schedule, data) -> Schedule:
    """One random change of the kind a buggy solver or a hand edit makes."""
    inst = sched.instance
    i = data.draw(st.integers(0, len(sched.ops) - 1), label="op")
    op = sched.ops[i]
    how = data.draw(st.sampled_from(["shift", "stretch", "rank", "drop", "twice", "mb", "dp", "kind",
                                     "negative", "float", "bool", "memory", "options", "none"]), label="how")
    change: dict = {}
    if how == "shift":
        delta = data.draw(st.integers(-3000, 3000), label="delta")
        change = dict(start=max(0, op.start + delta), end=max(0, op.start + delta) + op.duration)
    elif how == "stretch":
        change = dict(end=op.end + data.draw(st.sampled_from([-1, 1, 500]), label="by"))
    elif how == "rank":
        change = dict(rank=data.draw(st.integers(0, len(inst.gpus) - 1), label="rank"))
    elif how == "mb" and op.mb is not None:
        change = dict(mb=data.draw(st.integers(0, inst.microbatches), label="mb"))
    elif how == "dp":
        change = dict(dp=data.draw(st.integers(0, inst.dp), label="dp"))
    elif how == "kind":
        change = dict(kind=data.draw(st.sampled_from("FBWO"), label="kind"))
    elif how == "negative":
        change = dict(start=-1)
    elif how == "float":
        change = dict(start=float(op.start))
    elif how == "bool":
        change = dict(end=True)
    elif how == "drop":
        return replace(sched, ops=sched.ops[:i] + sched.ops[i + 1:])
    elif how == "twice":
        return replace(sched, ops=sched.ops + (op,))
    elif how == "memory":
        peak = max(memory_profile(inst, r, p).peak for r, p in sched.programs.items())
        limit = peak - data.draw(st.sampled_from([-1, 0, 1, 1 << 20]), label="slack")
        return replace(sched, instance=replace(inst, gpu_memory=limit))
    elif how == "options":
        return replace(sched, instance=replace(inst, stagger_optimizer=not inst.stagger_optimizer))
    if not change:
        return sched
    ops = list(sched.ops)
    ops[i] = replace(op, **change)
    return replace(sched, ops=tuple(ops))


@given(inst=instances(tight_memory=False), data=st.data())
def test_fast_path_agrees_with_the_rule_by_rule_checker(inst, data):
    sched = hand_schedule(inst, blocks_programs)
    assert schedule_passes(sched) and diagnose(sched) == []
    broken = _mutate(sched, data)
    full = diagnose(broken)
    # Never accepts what the full checker rejects, and (positive costs, stash <= activation)
    # never sends a valid schedule to the slow path either.
    assert schedule_passes(broken) == (full == [])
    assert check_schedule(broken) == full


def test_ties_in_program_order_go_to_the_full_checker():
    # Zero-cost forwards: F0 and F1 start at the same instant, so program order
    # depends on (end, op id); the fast path defers and the full checker accepts.
    inst = make_instance(1, 2, 2, forward=0, backward_input=100, backward_weight=100, optimizer=0)
    sched = hand_schedule(inst, gpipe_programs)
    assert not schedule_passes(sched)
    assert check_schedule(sched) == [] == diagnose(sched)
    verify_schedule(sched)


def test_verifier_never_imports_a_solver():
    source = (Path(__file__).parents[1] / "schedc" / "verify.py").read_text(encoding="utf-8")
    assert "solvers" not in "\n".join(line for line in source.splitlines()
                                      if line.startswith(("import", "from")))
