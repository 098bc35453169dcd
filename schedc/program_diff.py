"""Which ranks' programs differ between two schedules (`changed_ranks`).

What a launcher reconfigures after `schedc.replan`: `Plan.changed_ranks`
compares the new plan's schedule with the one it was replanned from. A
program is the op order of one rank with the peers each op receives from and
sends to, and the ranks it all-reduces with; start times do not count.
"""

from __future__ import annotations

from schedc.schedule import Schedule, _program_order
from schedc.symmetry import SymmetricSchedule


def _program_signatures(schedule: Schedule, ranks=None) -> dict[int, tuple]:
    """Per live rank (of `ranks`, if given), what its program depends on besides its all-reduce
    group: its ops in order and, for each, the ranks it receives from and sends to (the
    executors of the neighbouring stages' same microbatch). A symmetric schedule expands only
    the copies that hold `ranks`."""
    if isinstance(schedule, SymmetricSchedule):
        ops = list(schedule.expanded_ops(_copies_of(schedule, ranks)) if ranks is not None
                   else schedule.expanded_ops())
    else:
        ops = list(schedule.ops)
    executor = {(op.dp, op.pp, op.mb): op.rank for op in ops if op.kind == "F"}
    programs: dict[int, list] = {}
    for op in ops:
        if ranks is None or op.rank in ranks:
            programs.setdefault(op.rank, []).append(op)
    out: dict[int, tuple] = {}
    for rank, prog in programs.items():
        prog.sort(key=_program_order)
        out[rank] = tuple(("O", op.dp, op.pp) if op.kind == "O" else
                          (op.kind, op.dp, op.pp, op.mb, executor.get((op.dp, op.pp - 1, op.mb)),
                           executor.get((op.dp, op.pp + 1, op.mb))) for op in prog)
    return out


def _copies_of(schedule: SymmetricSchedule, ranks) -> dict[int, set[int]]:
    """{class: copies} of the copies that run the given full ranks."""
    lay, pp = schedule.layout, schedule.instance.pp
    out: dict[int, set[int]] = {}
    for rank in ranks:
        hit = schedule.reduced_rank.get(rank)
        if hit is not None:
            out.setdefault(lay.class_of_reduced[hit[0] // pp], set()).add(hit[1])
    return out


def _component_ranks(schedule) -> set[int] | None:
    """Full ranks outside the untouched class of a symmetric schedule (None: not symmetric)."""
    if not isinstance(schedule, SymmetricSchedule):
        return None
    lay, pp = schedule.layout, schedule.instance.pp
    out: set[int] = set()
    for c, cls in enumerate(lay.classes):
        if c != schedule.untouched:
            for r in range(lay.offsets[c] * pp, (lay.offsets[c] + cls.size) * pp):
                out.update(schedule.full_ranks[r])
    return out


def _untouched_programs(schedule) -> tuple | None:
    """The untouched pipelines' programs (None: not symmetric, or none)."""
    if not isinstance(schedule, SymmetricSchedule) or schedule.untouched is None:
        return None
    part = schedule.parts[schedule.untouched]
    return tuple(tuple((op.kind, op.pp, op.mb) for op in part.program(s)) for s in range(part.instance.pp))


def changed_ranks(old: Schedule, new: Schedule) -> frozenset[int]:
    """The schedule ranks (GPUs) whose program differs between `old` and `new`: a different op
    order, a different peer to receive from or send to, a different set of ranks to all-reduce
    with, or a rank that runs in only one of them (failed, or back). Start times do not count:
    programs run as soon as their inputs allow.

    For symmetric schedules (`schedc.symmetry`) only the ranks whose program can have changed
    are compared op by op: those of the components around failures, old or new, and every
    rank of a stage whose all-reduce group changed; an untouched pipeline's program changes
    only if the untouched class's program did."""
    inst_old, inst_new = old.instance, new.instance
    pp = inst_new.pp
    changed: set[int] = set()
    for s in range(pp):
        a = tuple(g.rank for g in inst_old.live_gpus(s))
        b = tuple(g.rank for g in inst_new.live_gpus(s))
        if a != b:
            changed.update(a)
            changed.update(b)
    live = {g.rank for g in inst_new.gpus if g.live}
    at_risk: set[int] | None = None
    comp_old, comp_new = _component_ranks(old), _component_ranks(new)
    if comp_old is not None and comp_new is not None and _untouched_programs(old) == _untouched_programs(new):
        at_risk = (comp_old | comp_new) - changed
    if at_risk is None:
        at_risk = (live | {g.rank for g in inst_old.gpus if g.live}) - changed
    a, b = _program_signatures(old, at_risk), _program_signatures(new, at_risk)
    changed.update(r for r in at_risk if a.get(r) != b.get(r))
    return frozenset(changed)
