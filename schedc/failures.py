"""Failures: the `failures` block's statements (and replan events) as `Failure`s, and their effect.

One place for what a failure statement means, whoever wrote it: a spec's `failures`
block (`schedc.validate`), a replan event (`schedc.events`) or the event of a
`--inject` (`schedc.live.inject`). The steps, each usable alone:

* `failure_from_statement`: a parsed `fail`/`slow`/`recover` statement -> `Failure`
  (shape and values: E201-E206);
* `failure_ranks`: the schedule ranks a failure names in a cluster (E207);
* `resolve_gpus`: every GPU with a list of failures applied (E207, E208, E301);
* `describe_failure`: a failure back to statement text.

    >>> from schedc.parse import parse_statements
    >>> (st,) = parse_statements("slow gpu(dp=1, pp=0) speed = 0.5")
    >>> describe_failure(failure_from_statement(st, allow_recover=False)[0])
    'slow gpu(dp=1, pp=0) speed = 0.5'
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from types import MappingProxyType
from typing import Sequence

from schedc.diagnostics import Diagnostic, Label, Span, did_you_mean, error, spec_error
from schedc.parse import Assign, Block, Statement, Value
from schedc.spec import ClusterSpec, Failure, Gpu, Spec

MIN_SPEED = Fraction(1, 1000)  # slower than this, a GPU is better failed than slowed

#: What each verb may name.
FAIL_TARGETS = ("gpu", "rank", "node")


def failures_from_block(block: Block) -> tuple[tuple[Failure, ...] | None, list[Diagnostic]]:
    """The statements of a `failures { ... }` block, in order, or None with the problems found."""
    out: list[Failure] = []
    diags: list[Diagnostic] = []
    for item in block.items:
        if not isinstance(item, Statement):
            span = item.key_span if isinstance(item, Assign) else item.name_span
            name = item.key if isinstance(item, Assign) else item.name
            diags.append(error("E201", f"unknown statement `{name}` in `failures`", span,
                               label=did_you_mean(name, ("fail", "slow")) or "not a failure statement",
                               hint="write `fail gpu(dp=D, pp=S)`, `fail rank R`, `fail node N` or "
                                    "`slow gpu(dp=D, pp=S) speed = X`"))
            continue
        f, problems = failure_from_statement(item, allow_recover=False)
        diags.extend(problems)
        if f is not None:
            out.append(f)
    return (None if diags else tuple(out)), diags


def _int_of(v: Value, what: str) -> tuple[int | None, Diagnostic | None]:
    if v.kind != "number" or v.unit or v.number.denominator != 1:  # type: ignore[union-attr]
        return None, error("E205", f"{what} must be a whole number, got `{v.text}`", v.span, label="expected a number")
    return int(v.number), None  # type: ignore[arg-type]


def failure_from_statement(st: Statement, *, allow_recover: bool,
                           verb: str | None = None) -> tuple[Failure | None, list[Diagnostic]]:
    """One `fail`/`slow`/`recover` statement -> `Failure` (shape and value checks only, not ranges).

    `verb` reads the statement as that verb (an injection's `hang` names what `fail` names);
    messages still quote the verb as written."""
    diags: list[Diagnostic] = []
    meaning = verb or st.verb
    if meaning == "recover" and not allow_recover:
        return None, [error("E201", "`recover` is a replan event, not a spec statement", st.span,
                            label="only in events", hint="remove the GPU's `fail`/`slow` line instead")]
    targets = FAIL_TARGETS if meaning == "fail" else ("gpu",)
    if st.target not in targets:
        return None, [error("E201", f"`{st.verb}` cannot name `{st.target}`", st.target_span,
                            label=did_you_mean(st.target, targets) or "unknown target",
                            hint=f"`{st.verb}` takes " + ", ".join(
                                "gpu(dp=D, pp=S)" if t == "gpu" else f"{t} N" for t in targets))]
    coords: dict[str, int] = {}
    index = None
    if st.target == "gpu":
        if st.args is None:
            return None, [error("E205", f"`{st.verb} gpu` needs coordinates", st.target_span,
                                label="expected (dp=D, pp=S)", hint=f"write `{st.verb} gpu(dp=0, pp=1)`")]
        for arg in st.args:
            if arg.name not in ("dp", "pp"):
                diags.append(error("E201", f"unknown coordinate `{arg.name}`", arg.span,
                                   label=did_you_mean(arg.name, ("dp", "pp")) or "expected dp or pp",
                                   hint="a GPU is named gpu(dp=D, pp=S)"))
            elif arg.name in coords:
                diags.append(error("E202", f"coordinate `{arg.name}` is given twice", arg.span, label="twice"))
            else:
                n, d = _int_of(arg.value, f"`{arg.name}`")
                if d:
                    diags.append(d)
                    coords[arg.name] = -1
                else:
                    coords[arg.name] = n  # type: ignore[assignment]
        for c in ("dp", "pp"):
            if c not in coords and not diags:
                diags.append(error("E203", f"`gpu(...)` is missing `{c}`", st.target_span, label=f"no {c}",
                                   hint=f"write `{st.verb} gpu(dp=0, pp=1)`"))
    else:
        if st.index is None:
            return None, [error("E205", f"`{st.verb} {st.target}` needs a number", st.target_span,
                                label=f"expected `{st.target} N`", hint=f"write `{st.verb} {st.target} 0`")]
        index, d = _int_of(st.index, f"the {st.target}")
        if d:
            diags.append(d)
    speed = None
    if meaning == "slow":
        assert st.setting is not None  # the grammar requires `speed = X` after `slow gpu(...)`
        if st.setting.key != "speed":
            diags.append(error("E201", f"unknown setting `{st.setting.key}` of `slow`", st.setting.key_span,
                               label=did_you_mean(st.setting.key, ("speed",)) or "expected `speed`",
                               hint="write `slow gpu(dp=0, pp=1) speed = 0.5`"))
        else:
            v = st.setting.value
            if v.kind != "number" or v.unit:
                diags.append(error("E205", f"`speed` must be a plain number in (0, 1], got `{v.text}`", v.span,
                                   label="expected a number"))
            elif not 0 < v.number <= 1:  # type: ignore[operator]
                diags.append(error("E206", f"`speed` must be in (0, 1], got {v.text}", v.span,
                                   label="out of range",
                                   hint="speed is the fraction of full speed: 0.5 means its ops take twice as long"))
            elif v.number < MIN_SPEED:  # type: ignore[operator]
                diags.append(error("E206", f"`speed` must be at least {float(MIN_SPEED):g}, got {v.text}", v.span,
                                   label="too slow",
                                   hint="a GPU this slow is better taken out: `fail gpu(...)`"))
            else:
                speed = float(v.number)  # type: ignore[arg-type]
    if diags:
        return None, diags
    kind = {"fail": f"fail_{st.target}", "slow": "slow_gpu", "recover": "recover_gpu"}[meaning]
    return Failure(kind=kind, dp=coords.get("dp"), pp=coords.get("pp"),  # type: ignore[arg-type]
                   rank=index if st.target == "rank" else None, node=index if st.target == "node" else None,
                   speed=speed, span=st.span), []


def describe_failure(f: Failure) -> str:
    """The statement text of a failure (`fail gpu(dp=1, pp=2)`), as the printer writes it."""
    if f.kind in ("fail_gpu", "recover_gpu"):
        return f"{f.kind.split('_')[0]} gpu(dp={f.dp}, pp={f.pp})"
    if f.kind == "slow_gpu":
        return f"slow gpu(dp={f.dp}, pp={f.pp}) speed = {f.speed!r}"
    if f.kind == "fail_rank":
        return f"fail rank {f.rank}"
    return f"fail node {f.node}"


def failure_ranks(cluster: ClusterSpec, f: Failure) -> tuple[list[int], Diagnostic | None]:
    """The ranks a failure names, or a diagnostic (E207) if it names a GPU/rank/node that does not exist."""
    world = cluster.world_size
    if f.kind in ("fail_gpu", "slow_gpu", "recover_gpu"):
        assert f.dp is not None and f.pp is not None
        if not (0 <= f.dp < cluster.dp and 0 <= f.pp < cluster.pp):
            return [], error("E207", f"there is no GPU (dp={f.dp}, pp={f.pp})", f.span, label="no such GPU",
                             hint=f"the cluster has dp = 0..{cluster.dp - 1} and pp = 0..{cluster.pp - 1}")
        return [cluster.rank_of(f.dp, f.pp)], None
    if f.kind == "fail_rank":  # a real GPU's rank: its whole tensor-parallel group fails
        assert f.rank is not None
        devices = cluster.devices
        if not 0 <= f.rank < devices:
            how = f"dp * pp * tp = {devices}" if cluster.tp > 1 else f"dp * pp = {world}"
            return [], error("E207", f"there is no rank {f.rank}", f.span, label="no such rank",
                             hint=f"the cluster has ranks 0..{devices - 1} ({how})")
        return [f.rank // cluster.tp], None
    assert f.node is not None
    nodes = cluster.nodes
    if not 0 <= f.node < nodes:
        return [], error("E207", f"there is no node {f.node}", f.span, label="no such node",
                         hint=f"the cluster has nodes 0..{nodes - 1} ({cluster.devices} GPUs, "
                              f"gpus_per_node = {cluster.gpus_per_node})")
    return list(cluster.ranks_on_node(f.node)), None


def resolve_gpus(cluster: ClusterSpec, failures: Sequence[Failure], *,
                 block_span: Span | None = None) -> tuple[tuple[Gpu, ...], list[Diagnostic]]:
    """Every GPU in rank order with `failures` applied, and the problems found (E207, E208, E301)."""
    diags: list[Diagnostic] = []
    state: dict[int, tuple[str, float]] = {}
    cause: dict[int, Failure] = {}
    for f in failures:
        if f.kind == "recover_gpu":
            diags.append(error("E201", "`recover` is a replan event, not a failure", f.span))
            continue
        ranks, d = failure_ranks(cluster, f)
        if d is not None:
            diags.append(d)
            continue
        if f.kind == "fail_rank" and cluster.tp > 1 and all(
                cause.get(r) is not None and cause[r].kind == "fail_rank" and cause[r].rank != f.rank for r in ranks):
            continue  # another real GPU of the same tensor-parallel group: the group failed already
        for r in ranks:
            if r in cause:
                dp, pp = cluster.coords_of(r)
                first = cause[r]
                notes = [Label(first.span, "first listed here")] if first.span is not None else []
                diags.append(error("E208", f"GPU (dp={dp}, pp={pp}) (rank {r}) is listed twice", f.span,
                                   label="listed again here", notes=notes,
                                   hint="a GPU is either failed or slow, and listed once; remove one line"))
                break
        else:
            for r in ranks:
                cause[r] = f
                state[r] = ("failed", 1.0) if f.kind != "slow_gpu" else ("live", float(f.speed or 1.0))
    gpus = []
    for r in range(cluster.world_size):
        dp, pp = cluster.coords_of(r)
        st, speed = state.get(r, ("live", 1.0))
        gpus.append(Gpu(rank=r, dp=dp, pp=pp, node=cluster.node_of(r), state=st, speed=speed))  # type: ignore[arg-type]
    if not diags:
        # One pass over the GPUs, by stage (a pass per stage was pp x dp x pp: 10 s at pp = 10,000).
        by_stage: list[list[Gpu]] = [[] for _ in range(cluster.pp)]
        for g in gpus:
            by_stage[g.pp].append(g)
        for s in range(cluster.pp):
            if any(g.live for g in by_stage[s]):
                continue
            # The distinct causes in rank order (by identity: equal lines stay apart, as listed).
            causes = list({id(cause[g.rank]): cause[g.rank] for g in by_stage[s]}.values())
            notes = [Label(c.span, f"{describe_failure(c)} takes a replica of stage {s}")
                     for c in causes if c.span is not None]
            diags.append(error(
                "E301", f"stage {s} has no live GPU left: all {cluster.dp} of its replicas failed",
                block_span if block_span is not None else (causes[-1].span if causes else None),
                label=f"stage {s} is lost", notes=notes,
                hint=f"the weights of stage {s} exist on no live GPU: restore from a checkpoint onto "
                     f"replacement GPUs, or remove one of these `fail` lines"))
    return tuple(gpus), diags




def validate_failures(spec: Spec, failures: Sequence[Failure], sources: dict[str, str] | None = None) -> Spec:
    """`spec` with its failures replaced by `failures`, re-checked (E207, E208, E301)."""
    gpus, diags = resolve_gpus(spec.cluster, failures, block_span=spec.span("failures"))
    if diags:
        raise spec_error(diags, sources or {})
    spans = {k: v for k, v in spec.spans.items() if not k.startswith("failures.")}
    for i, f in enumerate(failures):
        if f.span is not None:
            spans[f"failures.{i}"] = f.span
    return replace(spec, failures=tuple(failures), gpus=gpus, spans=MappingProxyType(spans))
