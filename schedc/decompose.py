"""Planning by classes of pipelines: what a large cluster costs is what its failures touch.

One failed or slow GPU changes the work of its own pipeline and of the peers
that take its microbatches; every other pipeline runs the fault-free
program. So a cluster is cut into *components* (a faulty pipeline and
`helpers` untouched pipelines that may take its work, by default as many as
it has microbatches: one extra microbatch each is the best a peer can do) and
the *untouched* pipelines. Components whose GPUs are in the same states at
the same places form one class (`schedc.symmetry.PipelineClass`); each class
is planned once, as a small instance of its own with the chosen solver (its
*part*); the optimizer's barriers couple the parts, which the verifier and the
simulator account for (`schedc.symmetry`). `replan` keeps the components
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
from schedc.schedule import Schedule, SolverInfo, status_text
from schedc.symmetry import Layout, PipelineClass, SymmetricSchedule, part_instance

#: Planned by classes from this many GPUs on (below it, planning every pipeline takes well
#: under a second and the plans stay op by op, as they always were).
MIN_GPUS = 1024

Signature = tuple[tuple[tuple[str, float], ...], ...]  # per local pipeline, per stage: (state, speed)


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


#: Solvers that plan the instance as given. The baselines plan a transformed one (the field's
#: options, Bamboo's copies), which a class's part planned alone cannot stand for in the
#: cluster's layout, so they always plan the whole cluster.
CLASS_SOLVERS = ("cpsat", "greedy")


def classes_for(instance: Instance, symmetric: bool | None, solver: str = "cpsat",
                previous: Decomposition | None = None) -> Decomposition | None:
    """The classes `compile` and `replan` plan `instance` by, or None to plan it op by op:
    `symmetric` True at any size, None (the default) from `MIN_GPUS` GPUs on, False never;
    only for `CLASS_SOLVERS`, and only where some pipeline repeats another (`decompose`)."""
    if (symmetric is False or solver not in CLASS_SOLVERS
            or (symmetric is None and instance.dp * instance.pp < MIN_GPUS)):
        return None
    return decompose(instance, previous=previous)


def known_parts(schedule) -> dict[Signature, Schedule]:
    """The part (a class planned alone) of every class of a symmetric schedule, by signature."""
    if not isinstance(schedule, SymmetricSchedule):
        return {}
    return dict(zip(class_signatures(schedule), schedule.parts))


def class_signatures(schedule: SymmetricSchedule) -> tuple[Signature, ...]:
    """Each class's signature, read from its part's instance."""
    return tuple(signature(part.instance, tuple(range(part.instance.dp))) for part in schedule.parts)


Solve = Callable[[Instance, object], Schedule]


def plan_by_classes(instance: Instance, decomposition: Decomposition, solve: Solve, options,
                    name: str, previous: SymmetricSchedule | None = None, *,
                    fallback: Solve) -> SymmetricSchedule:
    """Plan each class that `previous` (the plan `replan` starts from) has no part for on its
    own (the `solve` of solver `name`) and return the symmetric schedule of all parts. A part
    `previous` has is reused as it is (the same object: what the verifier and the simulator
    found for it still holds), so a replan costs the classes it plans, not the cluster.
    A part `solve` gets wrong is planned again by `fallback` (the callers pass greedy's).

    `options.deadline` (replan) is shared out evenly among the classes still to plan."""
    from schedc.verify import verify_schedule

    started = time.perf_counter()
    lay = decomposition.layout
    known = known_parts(previous)
    todo = [c for c, sig in enumerate(decomposition.signatures) if sig not in known]
    details, statuses, stopped = [], [], "work"
    for k, c in enumerate(todo):
        local = part_instance(instance, lay.classes[c].copies[0])
        # The work budget is shared out evenly (the same plan under any load); a deadline too.
        opts = replace(options, time_limit=options.time_limit / len(todo), hint=None)
        if options.deadline is not None:
            left = max(0.0, options.deadline - time.monotonic())
            opts = replace(opts, deadline=time.monotonic() + left / (len(todo) - k))
        sched = solve(local, opts)
        try:
            verify_schedule(sched)
        except VerificationError:
            # A solver bug must not reach the user: the fallback (greedy) plans this class.
            sched = fallback(local, opts)
            verify_schedule(sched)
        known[decomposition.signatures[c]] = sched
        statuses.append(sched.solver.status)
        details.append(f"{lay.classes[c].size} pipelines: {sched.solver.name} {status_text(sched.solver.status)}")
        if sched.solver.stopped_by == "deadline":
            stopped = "deadline"
    reused = len(decomposition.signatures) - len(todo)
    if not todo and previous is not None:
        statuses.append(previous.solver.status)
    info = SolverInfo(
        name=name, status="fallback" if "fallback" in statuses else "feasible",
        wall_s=time.perf_counter() - started, stopped_by=stopped,
        detail=(f"planned by classes: {lay.full_dp:,} pipelines as {lay.reduced_dp:,} "
                f"({len(lay.classes)} classes, {len(todo)} planned, {reused} reused)"
                + (": " + "; ".join(details) if details else "")))
    parts = tuple(known[sig] for sig in decomposition.signatures)
    return SymmetricSchedule(instance=instance, layout=lay, parts=parts, solver=info)


def decomposition_of(schedule) -> Decomposition | None:
    """The decomposition a symmetric schedule was planned with (None for an op-by-op one)."""
    if not isinstance(schedule, SymmetricSchedule):
        return None
    lay = schedule.layout
    signatures = class_signatures(schedule)
    comps: dict[tuple[int, ...], Signature] = {}
    for c, (cls, sig) in enumerate(zip(lay.classes, signatures)):
        if c != schedule.untouched:
            for copy in cls.copies:
                comps[copy] = sig
    return Decomposition(layout=lay, components=comps, signatures=signatures)
