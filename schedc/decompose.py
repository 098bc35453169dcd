"""Planning by classes of pipelines: what a large cluster costs is what its failures touch.

One failed or slow GPU changes the work of its own pipeline and of the peers
that take its microbatches; every other pipeline runs the fault-free
program. So a cluster is cut into *components* (a faulty pipeline and
`helpers` untouched pipelines that may take its work, by default as many as
it has microbatches: one extra microbatch each is the best a peer can do) and
the *untouched* pipelines. Components whose GPUs are in the same states at
the same places form one class (`schedc.symmetry.PipelineClass`); each class
is planned once, as a small instance of its own with the chosen solver, and
the classes' programs are put side by side in the reduced instance and timed
together (the optimizer barrier couples them). `replan` keeps the components
an event leaves alone (same pipelines, same states) and reuses the programs
of classes it has planned before, so a new failure like an earlier one costs
no search at all, and an unlike one costs one small instance.

Determinism: components are formed in pipeline order (helpers are the
nearest untouched pipelines after the faulty one, wrapping around), classes
are ordered by their GPUs' states, and every class is solved with the same
options, so the same input (and, for `replan`, the same previous plan) gives
the same plan.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from schedc.diagnostics import VerificationError
from schedc.instance import Instance
from schedc.schedule import OpId, Schedule, SolverInfo
from schedc.spec import Gpu
from schedc.symmetry import Layout, PipelineClass, SymmetricSchedule, reduced_instance
from schedc.timing import schedule_from_programs

#: Planned by classes from this many GPUs on (below it, planning every pipeline takes well
#: under a second and the plans stay op by op, as they always were).
MIN_GPUS = 1024

Signature = tuple[tuple[tuple[str, float], ...], ...]  # per local pipeline, per stage: (state, speed)
LocalPrograms = dict[int, list[OpId]]  # local rank -> program


def faulty(instance: Instance, d: int) -> bool:
    return any(not (g.live and g.speed >= 1.0) for g in (instance.gpu(d, s) for s in range(instance.pp)))


def signature(instance: Instance, pipelines: tuple[int, ...]) -> Signature:
    return tuple(tuple((g.state, g.speed) for g in (instance.gpu(d, s) for s in range(instance.pp)))
                 for d in pipelines)


def _faulty_pipelines(instance: Instance) -> list[int]:
    out = {g.dp for g in instance.gpus if not (g.live and g.speed >= 1.0)}
    return sorted(out)


def helpers_needed(instance: Instance, d: int) -> int:
    """Peers faulty pipeline `d` needs so that none takes more than one extra microbatch per
    stage: M with a failed GPU, M x (1 - speed) of its slowest GPU otherwise (at least 1)."""
    gpus = [instance.gpu(d, s) for s in range(instance.pp)]
    M = instance.microbatches
    if any(not g.live for g in gpus):
        return M
    return max(1, min(M, math.ceil(M * (1.0 - min(g.speed for g in gpus)) - 1e-9)))


def components(instance: Instance, helpers: int | None = None, previous: "Decomposition | None" = None
               ) -> list[tuple[int, ...]] | None:
    """Each faulty pipeline with the untouched ones after it that may take its work (`helpers`
    of them, or `helpers_needed`), faulty first; None when the untouched pipelines run out.
    Components of `previous` whose GPUs are all in the same state are kept as they were; a
    faulty pipeline of a changed one keeps its old helpers where it can."""
    bad = _faulty_pipelines(instance)
    bad_set = set(bad)
    kept: list[tuple[int, ...]] = []
    preferred: dict[int, tuple[int, ...]] = {}
    if previous is not None:
        for comp, sig in previous.components.items():
            if comp[0] in bad_set and signature(instance, comp) == sig:
                kept.append(comp)
            elif comp[0] in bad_set:
                preferred[comp[0]] = comp[1:]
    taken = {d for comp in kept for d in comp}
    free = [d for d in range(instance.dp) if d not in bad_set and d not in taken]
    free_set = set(free)
    new: list[tuple[int, ...]] = []
    for d in bad:
        if d in taken:
            continue
        want = helpers_needed(instance, d) if helpers is None else helpers
        chosen = [h for h in preferred.get(d, ()) if h in free_set][:want]
        free_set.difference_update(chosen)
        if len(chosen) < want:
            # The nearest free pipelines after d, wrapping around: an ordered scan of `free`.
            at = bisect.bisect_right(free, d)
            for k in range(len(free)):
                h = free[(at + k) % len(free)]
                if h in free_set:
                    chosen.append(h)
                    free_set.discard(h)
                    if len(chosen) == want:
                        break
        if len(chosen) < want:
            return None
        new.append((d, *chosen))
    return sorted(kept + new)


@dataclass(frozen=True)
class Decomposition:
    """Components (faulty pipeline first) with their signatures, and the layout they make."""

    layout: Layout
    components: dict[tuple[int, ...], Signature]
    signatures: tuple[Signature, ...]  # per class, in layout order


def decompose(instance: Instance, previous: "Decomposition | None" = None,
              helpers: int | None = None) -> Decomposition | None:
    """The classes of `instance`'s pipelines, or None when no pipeline would repeat another
    (or the untouched pipelines are too few to help every faulty one)."""
    comps = components(instance, helpers, previous)
    if comps is None:
        return None
    in_comp = {d for comp in comps for d in comp}
    untouched = tuple((d,) for d in range(instance.dp) if d not in in_comp)
    sigs = {comp: signature(instance, comp) for comp in comps}
    by_sig: dict[Signature, list[tuple[int, ...]]] = {}
    for comp in comps:  # sorted: copies in pipeline order
        by_sig.setdefault(sigs[comp], []).append(comp)
    classes: list[PipelineClass] = []
    signatures: list[Signature] = []
    if untouched:
        classes.append(PipelineClass(copies=untouched))
        signatures.append(signature(instance, untouched[0]))
    for sig in sorted(by_sig):
        classes.append(PipelineClass(copies=tuple(by_sig[sig])))
        signatures.append(sig)
    layout = Layout(classes=tuple(classes))
    if layout.reduced_dp == instance.dp:
        return None
    return Decomposition(layout=layout, components=sigs, signatures=tuple(signatures))


def worth_it(instance: Instance) -> bool:
    """Whether `compile`/`replan` plan `instance` by classes on their own (when some repeat)."""
    return instance.dp * instance.pp >= MIN_GPUS


def local_instance(instance: Instance, sig: Signature) -> Instance:
    """A class planned on its own: `len(sig)` pipelines with these GPU states, ranks pipeline-major."""
    pp = instance.pp
    gpus = tuple(Gpu(rank=d * pp + s, dp=d, pp=s, node=(d * pp + s) // 8, state=st, speed=sp)
                 for d, row in enumerate(sig) for s, (st, sp) in enumerate(row))
    return replace(instance, dp=len(sig), gpus=gpus)


def known_programs(schedule) -> dict[Signature, LocalPrograms]:
    """The programs of every class of a symmetric schedule, by signature, in local numbering."""
    if not isinstance(schedule, SymmetricSchedule):
        return {}
    lay, red = schedule.layout, schedule.reduced
    pp = red.instance.pp
    out: dict[Signature, LocalPrograms] = {}
    for c, (cls, sig) in enumerate(zip(lay.classes, class_signatures(schedule))):
        off = lay.offsets[c]
        progs: LocalPrograms = {}
        for i in range(cls.size):
            for s in range(pp):
                rank = (off + i) * pp + s
                progs[i * pp + s] = [OpId(op.kind, op.dp - off, op.pp, op.mb) for op in red.program(rank)]
        out[sig] = progs
    return out


def class_signatures(schedule: SymmetricSchedule) -> tuple[Signature, ...]:
    """Each class's signature, read from the reduced instance."""
    lay, red = schedule.layout, schedule.reduced.instance
    return tuple(signature(red, tuple(range(off, off + cls.size)))
                 for off, cls in zip(lay.offsets, lay.classes))


Solve = Callable[[Instance, object], Schedule]


def plan_by_classes(instance: Instance, decomposition: Decomposition, solve: Solve, options,
                    name: str, previous: SymmetricSchedule | None = None) -> SymmetricSchedule:
    """Plan each class that `previous` (the plan `replan` starts from) has no programs for on its
    own (the `solve` of solver `name`), time all classes' programs together on the reduced
    instance, and return the symmetric schedule. When every class is one `previous` has, in the
    same order, its reduced schedule is reused as it is (the same object: what the verifier and
    the simulator found for it still holds), and only the copies change.

    `options.deadline` (replan) is shared out evenly among the classes still to plan."""
    from schedc.solvers import get_solver
    from schedc.verify import verify_schedule

    started = time.perf_counter()
    lay = decomposition.layout
    if not isinstance(previous, SymmetricSchedule):
        previous = None
    known = known_programs(previous) if previous is not None else {}
    if previous is not None and decomposition.signatures == class_signatures(previous):
        info = SolverInfo(name=name, status=previous.solver.status, wall_s=time.perf_counter() - started,
                          detail=(f"planned by classes: {lay.full_dp:,} pipelines as {lay.reduced_dp:,} "
                                  f"({len(lay.classes)} classes, 0 planned, all reused)"))
        return SymmetricSchedule(instance=instance, layout=lay, reduced=previous.reduced, solver=info)
    todo = [sig for sig in decomposition.signatures if sig not in known]
    details, statuses, stopped = [], [], "work"
    for k, sig in enumerate(todo):
        local = local_instance(instance, sig)
        # The work budget is shared out evenly (the same plan under any load); a deadline too.
        opts = replace(options, time_limit=options.time_limit / len(todo), hint=None)
        if options.deadline is not None:
            left = max(0.0, options.deadline - time.monotonic())
            opts = replace(opts, deadline=time.monotonic() + left / (len(todo) - k))
        sched = solve(local, opts)
        try:
            verify_schedule(sched)
        except VerificationError:
            # A solver bug must not reach the user: the greedy list scheduler plans this class.
            sched = get_solver("greedy")(local, opts)
            verify_schedule(sched)
        known[sig] = {r: [op.id for op in prog] for r, prog in sched.programs.items()}
        statuses.append(sched.solver.status)
        details.append(f"{len(sig)} pipelines: {sched.solver.name} {sched.solver.status}")
        if sched.solver.stopped_by == "deadline":
            stopped = "deadline"
    red = reduced_instance(instance, lay)
    pp = instance.pp
    programs: dict[int, list[OpId]] = {}
    for c, sig in enumerate(decomposition.signatures):
        off = lay.offsets[c]
        for local_rank, prog in known[sig].items():
            programs[off * pp + local_rank] = [OpId(op.kind, op.dp + off, op.pp, op.mb) for op in prog]
    reused = len(decomposition.signatures) - len(todo)
    info = SolverInfo(
        name=name, status="fallback" if "fallback" in statuses else "feasible",
        wall_s=time.perf_counter() - started, stopped_by=stopped,
        detail=(f"planned by classes: {lay.full_dp:,} pipelines as {lay.reduced_dp:,} "
                f"({len(lay.classes)} classes, {len(todo)} planned, {reused} reused)"
                + (": " + "; ".join(details) if details else "")))
    reduced = schedule_from_programs(red, programs, info)
    return SymmetricSchedule(instance=instance, layout=lay, reduced=reduced, solver=info)


def decomposition_of(schedule) -> Decomposition | None:
    """The decomposition a symmetric schedule was planned with (None for an op-by-op one)."""
    if not isinstance(schedule, SymmetricSchedule):
        return None
    lay = schedule.layout
    signatures = class_signatures(schedule)
    comps: dict[tuple[int, ...], Signature] = {}
    for cls, sig in zip(lay.classes, signatures):
        if cls.size == 1 and all(st == "live" and sp >= 1.0 for st, sp in sig[0]):
            continue  # the untouched pipelines
        for copy in cls.copies:
            comps[copy] = sig
    return Decomposition(layout=lay, components=comps, signatures=signatures)
