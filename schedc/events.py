"""Replan events: what happened to the cluster, applied to a `Spec`.

An event is a statement of the `failures` block or `recover gpu(dp=D, pp=S)`
(the GPU is back at full speed), as text or as a `Failure`:

    >>> [f.kind for f in parse_events(["fail gpu(dp=1, pp=2)", "slow gpu(dp=0, pp=3) speed = 0.5"])]
    ['fail_gpu', 'slow_gpu']

`apply_events(spec, events)` returns a new validated `Spec` whose `failures`
reflect the events, in order:

* `fail gpu` / `fail rank`: the GPU is failed (a `slow` line for it is dropped);
  failing an already failed GPU changes nothing.
* `fail node N`: every GPU of node N is failed (their own lines are dropped).
* `slow gpu(...) speed = X`: adds or replaces that GPU's speed; a failed GPU
  cannot be slowed (E208: recover it first). `speed = 1.0` is full speed: the
  GPU is no longer slow (its `slow` line goes, as a `recover` would remove it),
  and a healthy GPU stays healthy.
* `recover gpu(...)`: removes that GPU's failure or slowness; a GPU failed by
  `fail node` is recovered alone (the node line becomes one line per other
  GPU); recovering a healthy GPU is an error (E216), and so is recovering
  one at full speed (`slow ... speed = 1.0`, in the events or the spec).

The result is re-validated: E207 for a GPU that does not exist, E301 when a
stage loses its last live GPU. Errors in event text are `SpecError`s whose
columns point inside the event string (file name `<event>`, or
`<event N>` for the N-th of a list).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from schedc.diagnostics import Diagnostic, Label, SpecError, error, spec_error
from schedc.failures import describe_failure, failure_from_statement, failure_ranks, validate_failures
from schedc.parse import parse_statements
from schedc.spec import Failure, Spec

def parse_events(event: str | Failure | Sequence[str | Failure]) -> tuple[Failure, ...]:
    """Events as `Failure`s. A string may hold several statements (separated by spaces or newlines)."""
    return _parse_events(event)[0]


def _parse_events(event: str | Failure | Sequence[str | Failure]) -> tuple[tuple[Failure, ...], dict[str, str]]:
    """The events, and their text by the file name their spans give (`<event>`, `<event N>`)."""
    items: Sequence[str | Failure]
    items = [event] if isinstance(event, (str, Failure)) else list(event)
    out: list[Failure] = []
    diags: list[Diagnostic] = []
    sources: dict[str, str] = {}
    for i, item in enumerate(items):
        if isinstance(item, Failure):
            out.append(item)
            continue
        if not isinstance(item, str):
            raise SpecError([error("E205", f"an event must be a string or a Failure, got {type(item).__name__}",
                                   hint='for example "fail gpu(dp=1, pp=2)"')])
        file = "<event>" if len(items) == 1 else f"<event {i}>"
        sources[file] = item
        try:
            statements = parse_statements(item, file)
        except SpecError as exc:
            diags.extend(exc.diagnostics)
            continue
        if not statements:
            diags.append(error("E102", "empty event", None,
                               hint='write a statement such as "fail gpu(dp=1, pp=2)"'))
        for st in statements:
            f, problems = failure_from_statement(st, allow_recover=True)
            diags.extend(problems)
            if f is not None:
                out.append(f)
    if diags:
        raise SpecError(diags, sources)
    return tuple(out), sources


def apply_events(spec: Spec, events: str | Failure | Sequence[str | Failure]) -> Spec:
    """A new validated `Spec` with `events` applied to its failures (see the module docstring)."""
    parsed, sources = _parse_events(events)
    failures = list(spec.failures)
    cluster = spec.cluster
    before = {g.rank for g in spec.gpus if not g.live}
    down = set(before)
    fresh: list[tuple[Failure, list[int]]] = []  # each failing event, and the GPUs it fails that were live
    for ev in parsed:
        ranks, problem = failure_ranks(cluster, ev)
        if problem is not None:
            raise SpecError([problem], sources)
        try:
            failures = _apply(spec, failures, ev, ranks)
        except SpecError as exc:
            raise SpecError(exc.diagnostics, sources) from None
        if ev.kind == "recover_gpu":
            down.difference_update(ranks)
        elif ev.kind != "slow_gpu":
            fresh.append((ev, [r for r in ranks if r not in down]))
            down.update(ranks)
    per_stage = Counter(cluster.coords_of(r)[1] for r in down)  # (a pass over the failed GPUs only)
    lost = sorted(s for s, n in per_stage.items() if n == cluster.dp)
    if lost:
        raise spec_error([_lost_stage(spec, s, fresh, before & down) for s in lost], sources)
    # A GPU at full speed is not slow: its line says nothing (kept until here for E216's note).
    return validate_failures(spec, [f for f in failures if not _full_speed(f)], sources)


def _lost_stage(spec: Spec, stage: int, fresh: list[tuple[Failure, list[int]]], earlier: set[int]) -> Diagnostic:
    """E301 for a stage the events leave without a live GPU, naming what each event fails of it
    and the replicas that had failed before. (The spec's check named a `fail node` for GPUs that
    had failed before it, and pointed each earlier event's note at this call's event text.)"""
    cluster = spec.cluster
    takes = [(ev, [r for r in ranks if cluster.coords_of(r)[1] == stage]) for ev, ranks in fresh]
    takes = [(ev, ranks) for ev, ranks in takes if ranks]
    said = [f"`{describe_failure(ev)}` fails {_gpus(cluster, ranks)}" for ev, ranks in takes]
    gone = sorted(r for r in earlier if cluster.coords_of(r)[1] == stage)
    if gone:
        said.append(f"{_gpus(cluster, gone)} had failed before")
    last_ev, last = takes[-1]
    notes = [Label(ev.span, f"fails {_gpus(cluster, ranks)} of stage {stage}") for ev, ranks in takes[:-1] if ev.span]
    return error("E301", f"stage {stage} has no live GPU left: " + "; ".join(said), last_ev.span,
                 label=f"fails {_gpus(cluster, last)}, the last live replica{'s' if len(last) > 1 else ''} of "
                       f"stage {stage}", notes=notes,
                 hint=f"the weights of stage {stage} exist on no live GPU: restore from a checkpoint onto "
                      "replacement GPUs")


def _gpus(cluster, ranks: Sequence[int]) -> str:
    """`GPU (dp=1, pp=0)`, `GPUs (dp=0, pp=0), (dp=1, pp=0)`; past three, how many."""
    if len(ranks) > 3:
        return f"{len(ranks):,} GPUs"
    coords = ", ".join("(dp={}, pp={})".format(*cluster.coords_of(r)) for r in ranks)
    return f"GPU{'s' if len(ranks) > 1 else ''} {coords}"


def _full_speed(f: Failure) -> bool:
    """A `slow` line at speed 1.0: full speed, so the GPU is not slow."""
    return f.kind == "slow_gpu" and f.speed is not None and f.speed >= 1.0


def _covering(spec: Spec, failures: list[Failure], rank: int) -> list[Failure]:
    """The failure lines that name `rank`."""
    return [f for f in failures if f.kind != "recover_gpu" and rank in failure_ranks(spec.cluster, f)[0]]


def _apply(spec: Spec, failures: list[Failure], ev: Failure, ranks: list[int]) -> list[Failure]:
    cluster = spec.cluster
    if ev.kind in ("fail_gpu", "fail_rank", "fail_node"):
        fresh = [r for r in ranks if not any(f.kind != "slow_gpu" for f in _covering(spec, failures, r))]
        if not fresh:
            return failures  # already failed: events may be repeated by a launcher
        if ev.kind == "fail_node":
            # The node line replaces every line about its GPUs.
            return [f for f in failures if not set(failure_ranks(cluster, f)[0]) <= set(ranks)] + [ev]
        return [f for f in failures if not (f.kind == "slow_gpu" and failure_ranks(cluster, f)[0] == ranks)] + [ev]
    (rank,) = ranks
    lines = _covering(spec, failures, rank)
    if ev.kind == "slow_gpu":
        if any(f.kind != "slow_gpu" for f in lines):
            raise SpecError([error("E208", f"GPU (dp={ev.dp}, pp={ev.pp}) is failed and cannot be slow", ev.span,
                                   label="failed GPU",
                                   hint=f"recover it first: `recover gpu(dp={ev.dp}, pp={ev.pp})`")])
        return [f for f in failures if f not in lines] + [ev]
    # recover
    if all(_full_speed(f) for f in lines):
        notes = [Label(f.span, "`speed = 1.0` is full speed: the GPU is not slow from here on")
                 for f in lines if f.span is not None]
        hint = "only a GPU with a `fail` line, or a `slow` line below speed 1.0, can recover"
        hint += ("; `speed = 1.0` already put this one back at full speed" if lines else
                 " (`slow ... speed = 1.0` is full speed: it ends a GPU's slowness as `recover` does)")
        raise SpecError([error("E216", f"GPU (dp={ev.dp}, pp={ev.pp}) is neither failed nor slow", ev.span,
                               label="nothing to recover", notes=notes, hint=hint)])
    out: list[Failure] = []
    for f in failures:
        if f not in lines:
            out.append(f)
        elif f.kind == "fail_node":
            # Keep the node's other GPUs failed, one line each.
            for r in failure_ranks(cluster, f)[0]:
                if r != rank and not _covering(spec, out, r):
                    dp, pp = cluster.coords_of(r)
                    out.append(Failure(kind="fail_gpu", dp=dp, pp=pp, span=f.span))
    return out


def describe_events(events: Sequence[Failure]) -> str:
    """The events as statement text, one per line."""
    return "\n".join(describe_failure(f) for f in events)
