"""Which layouts a live re-partition weighs, and what moving into one costs.

`layout_candidates` lists the layouts of some GPUs that `schedc.live.recovery.RecoveryPolicy`
plans and prices (as `schedc replay` weighs them: the job's pipelines of fewer stages, and the
best shapes by the planner's estimate, holes included); `growth_option` prices growing onto one;
`holding` and `covers` say which GPUs hold which units, and whether a layout keeps a holder of
each stage (an in-place move needs one). Pure functions of a spec: no run, no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from schedc.recovery_cost import Costs, Option, transition_s

if TYPE_CHECKING:  # pragma: no cover
    from schedc.plan import Plan


def survivor_layout(spec, gpus: Sequence[int], keep: Sequence[Sequence[int]] = ()):
    """The survivors `gpus` as `spec.dp` pipelines of as many stages as they can hold; when they
    cannot hold that many pipelines, as the best shape by the planner's estimate that keeps the
    global batch with fewer (`schedc.repartition.candidate_shapes`: a number of pipelines that
    divides it; no holes). The GPUs used include one of each group of `keep` where they can (the
    holders of the state an in-place move needs: `covers` says whether they all are), then the
    lowest ranks; `assign_gpus` deals them to stages. None when no shape fits."""
    from schedc.layout import units_of
    from schedc.repartition import candidate_shapes, partition_units

    units = units_of(spec)
    dp, stages, microbatches = spec.dp, min(len(gpus) // spec.dp, units.count), spec.microbatches
    slices = partition_units(units, dp, stages, microbatches, spec.cluster.gpu.memory) if stages >= 1 else None
    if slices is None:
        shape = next((sh for sh in candidate_shapes(spec, len(gpus)) if not sh.holes), None)
        if shape is None:
            return None
        dp, stages, microbatches, slices = shape.dp, shape.pp, shape.microbatches, shape.slices
    return _on_gpus(spec, dp, stages, microbatches, slices, gpus, keep)


def layout_candidates(spec, gpus: Sequence[int], keep: Sequence[Sequence[int]] = ()) -> list:
    """The layouts a re-partition of `gpus` weighs (`RecoveryPolicy.laid_out`), as `schedc replay`
    does: the job's pipelines of fewer stages (`survivor_layout`), and the best
    `repartition.PLANNED_SHAPES` shapes by the planner's estimate that keep the global batch
    (`repartition.candidate_shapes`; with holes too: the first stages one GPU short, their other
    GPUs re-routing its work, for GPU counts equal pipelines cannot use), each on GPUs chosen as
    `survivor_layout` chooses them; one layout per shape."""
    from schedc.repartition import PLANNED_SHAPES, candidate_shapes

    out = []
    rule = survivor_layout(spec, gpus, keep)
    if rule is not None:
        out.append(rule)
    for shape in candidate_shapes(spec, len(gpus))[:PLANNED_SHAPES]:
        if all((lay.dp, lay.pp, lay.holes) != (shape.dp, shape.pp, shape.holes) for lay in out):
            out.append(_on_gpus(spec, shape.dp, shape.pp, shape.microbatches, shape.slices, gpus, keep,
                                holes=shape.holes))
    return out


def _on_gpus(spec, dp: int, stages: int, microbatches: int, slices, gpus: Sequence[int],
             keep: Sequence[Sequence[int]], holes: int = 0):
    """A shape on `gpus`: one of each group of `keep` first (where they fit), then the lowest
    ranks, dealt to stages by `assign_gpus` (`holes`: the first stages have one GPU fewer)."""
    from schedc.layout import Layout, units_of
    from schedc.repartition import assign_gpus

    need = dp * stages - holes
    chosen: list[int] = []
    for group in keep:
        if group and not set(group) & set(chosen):  # (a stage no running process holds: nothing to keep)
            chosen.append(min(group))
    chosen = chosen[:need] + [r for r in sorted(gpus) if r not in chosen][:max(0, need - len(chosen))]
    held = {g.rank: frozenset() for g in spec.gpus}
    return Layout(dp, stages, microbatches, slices, assign_gpus(units_of(spec), slices, dp, sorted(chosen), held,
                                                                holes=holes))


def growth_option(costs: Costs, job, now: "Plan", running: dict[int, int], target: "Plan",
                  physical: dict[int, int], *, in_place: bool) -> Option:
    """The price of growing from the running plan `now` onto `target` (`schedc.live.growth`), as an
    `Option` of `schedc.recovery_cost`: `target`'s predicted iteration time and the transition.
    `running` and `physical` map each plan's ranks to the GPUs that run them, named as the spec
    `job` names its GPUs. In place: reconfiguring, and the largest share of state one GPU
    receives over the link (the layers of its new stage it does not hold now, at
    `Units.state_bytes`; with a `stages` block, whose merged stages are not matched unit by
    unit, its whole new stage: an upper bound). Otherwise every process restarts from the
    checkpoint just written (`transition_s(..., restore=True, planned=True)`: no work lost)."""
    from schedc.layout import bytes_of, units_of

    new_s = target.metrics.iteration_time / 1e6
    bandwidth = target.spec.cluster.link.bandwidth
    if not in_place:
        cost = transition_s(costs, lost_gpus=False, moved_bytes=0, bandwidth=bandwidth, previous_iteration_s=None,
                            restore=True, planned=True)
        return Option("restart", new_s, cost, detail="every process restarts from the checkpoint", restore=True,
                      plan=target)
    units = units_of(job)

    def layers(spec, rank: int) -> frozenset[int] | None:
        if units.kind == "layer" and spec.partition is not None:
            return frozenset(range(*spec.partition[spec.gpus[rank].pp]))
        return None

    held = {gpu: layers(now.spec, r) for r, gpu in running.items()}
    moved = 0
    for r, gpu in physical.items():
        need = layers(target.spec, r)
        if need is None:
            share = target.spec.stages[target.spec.gpus[r].pp].static
        else:
            share = bytes_of(units, need - (held.get(gpu) or frozenset()))
        moved = max(moved, share)
    cost = transition_s(costs, lost_gpus=False, moved_bytes=moved, bandwidth=bandwidth, previous_iteration_s=None)
    return Option("repartition", new_s, cost, moved_bytes=moved, plan=target,
                  detail=f"reconfiguring {costs.reconfigure_s:g} s and at most {moved / 2**20:.1f} MiB to one GPU "
                         f"at {bandwidth / 1e9:g} GB/s")


def holding(spec, keep: Sequence[Sequence[int]] = ()) -> dict[int, frozenset[int]]:
    """Each GPU of `spec` -> the units it holds: its stage's, and those of stage s when it is in
    group s of `keep` (the holders of each stage: a lost one's are the GPUs with its shadow)."""
    from schedc.layout import held_units

    own = held_units(spec)
    stage_units = {g.pp: own[g.rank] for g in spec.gpus}
    out = dict(own)
    for s, group in enumerate(keep):
        for r in group:
            out[r] = out.get(r, frozenset()) | stage_units[s]
    return out


def covers(gpus: Iterable[int], keep: Sequence[Sequence[int]]) -> bool:
    """Whether the GPUs a layout runs, `gpus`, hold one of every group of `keep`."""
    used = set(gpus)
    return all(used & set(group) for group in keep)


def layout_words(plan: "Plan") -> str:
    """"6 GPUs as 3 x 2", "5 GPUs as 3 x 2 with 1 slot(s) re-routed": a layout a job runs on."""
    spec = plan.spec
    live = sum(1 for g in spec.gpus if g.live)
    holes = spec.dp * spec.pp - live
    return f"{live} GPUs as {spec.dp} x {spec.pp}" + (f" with {holes} slot(s) re-routed" if holes else "")
