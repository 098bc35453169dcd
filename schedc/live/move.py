"""A member's part in an in-place re-partition (`schedc.live.relayout`): agree on the steps, say
what it holds, receive the old stages its new layers need, re-shard them onto its new stage.

`held` is what the member ran before (its old stage's `Runtime`, its rollback copy, its shadow),
or None for a process started for this layout (a GPU back: the job grows in place), which holds
nothing and takes every layer it needs from the others; `rt` and `shadow` are the new stage it
was built for and the new shadow (or None). Every member
works out the same plan from what all of them said (`sources`): each old stage a member needs
comes from itself when it holds it exactly, else from one holder of it, its own GPUs first and
then its shadows, spread over the holders in turn; a holder sends only the layers the receiver
takes from that stage (`reshard.trim`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from schedc.diagnostics import RunError, error
from schedc.live import reshard
from schedc.live.rollback import roll_back, rollback_target


@dataclass
class Held:
    """What a member ran before the move: its old stage, the copy a rollback restores, its shadow."""

    rt: object  # schedc.runtime.primitives.Runtime
    snapshot: object  # schedc.live.rollback.StepSnapshot
    shadow: object | None  # schedc.live.shadow.ShadowStage


def sources(members, old_stage: dict[int, int], old_pp: int, shadow_ok: dict[int, bool],
            need: dict[int, list[int]]) -> dict[tuple[int, int], int]:
    """(member, old stage it needs) -> the member it takes that stage's state from (itself when
    it holds it). A member holds its own old stage, and stage s - 1 where `shadow_ok` (its
    shadow is exact at the agreed steps). E552 when no member holds a needed stage."""
    def holds(r: int, t: int) -> bool:  # (a process new to the layout has no old stage: it holds nothing)
        return r in old_stage and (old_stage[r] == t or (shadow_ok[r] and (old_stage[r] - 1) % old_pp == t))

    out: dict[tuple[int, int], int] = {}
    for t in range(old_pp):
        pool = sorted(r for r in members if old_stage.get(r) == t) or \
            sorted(r for r in members if holds(r, t))
        turn = 0
        for r in sorted(r for r in members if t in need[r]):
            if holds(r, t):
                out[(r, t)] = r
                continue
            if not pool:
                raise RunError([error("E552", f"no survivor holds stage {t} of the layout before the "
                                              "re-partition at the agreed step count",
                                      hint="this is a bug in schedc's live runtime; please report it")])
            out[(r, t)] = pool[turn % len(pool)]
            turn += 1
    return out


#: What a process new to the layout says in the step all-reduce MIN: it lowers neither count.
_NOTHING_HELD = 2 ** 62


def move_in(gen, manifest, rank: int, transport, held: Held | None, rt, shadow) -> tuple[int, bool, int]:
    """Carry out this member's part of generation `gen`'s move (see the module docstring);
    (the step count every member now holds, whether this member undid its last step, the bytes
    it received)."""
    moved = gen.moved
    members = list(gen.members)
    old_pp = int(moved["pp"])
    old_stage = {int(r): int(s) for r, s in moved["stage"].items()}
    if (held is not None) != (rank in old_stage):  # (what it holds, against the move)
        says = "holds no stage" if held is not None else "holds a stage"
        raise RunError([error("E552", f"rank {rank}'s move says it {says} of the layout before, which it does not",
                              hint="this is a bug in schedc's live runtime; please report it")])
    partition = held.rt.partition if held is not None else _old_partition(moved, rt)  # (every old stage's layers)
    # 1. The steps: the fewest any member holds, or one fewer where a lost stage's shadow lags.
    steps = torch.tensor([held.rt.steps_done, -held.rt.steps_done] if held is not None
                         else [_NOTHING_HELD, _NOTHING_HELD], dtype=torch.int64)
    transport.all_reduce_min(steps, "the members' step counts")
    low, high = int(steps[0]), -int(steps[1])
    mine, copy = low, (held.shadow if held is not None else None)
    lost = set(range(old_pp)) - set(old_stage.values())
    if copy is not None and copy.stage in lost:
        mine = copy.steps_to_keep(low, high)
    agreed = torch.tensor([mine], dtype=torch.int64)
    transport.all_reduce_min(agreed, "the steps the lost stages' shadows hold")
    target = rollback_target([int(agreed[0]), high])
    undone = False
    if held is not None:
        undone = roll_back(held.rt.steps_done, target, held.snapshot)
        held.rt.steps_done = target
    if copy is not None:
        copy.catch_up(target)
    # 2. Who holds which old stage exactly at `target` (its own stage, always; its shadow, if exact).
    ok = torch.ones(len(members), dtype=torch.int64)
    ok[members.index(rank)] = int(copy is not None and copy.valid and copy.steps == target)
    transport.all_reduce_min(ok, "which survivors hold their shadows exactly")
    shadow_ok = {r: bool(ok[i]) for i, r in enumerate(members)}
    # 3. What each member needs: the old stages holding its new layers (and its new shadow's).
    if rt.module is None:  # emulated: no tensors, only the step count moves
        rt.load_stage_state({"steps": target, "model": {}, "optimizer": None})
        if shadow is not None:
            shadow.load({"steps": target, "model": {}, "optimizer": None})
        return target, undone, 0
    need = {}
    for r in members:
        s = manifest.coords[r][1]
        wanted = set(reshard.needed_stages(partition, rt.partition[s]))
        if shadow is not None:  # (every member keeps one, or none does: `Generation.shadow`)
            wanted |= set(reshard.needed_stages(partition, rt.partition[(s - 1) % manifest.pp]))
        need[r] = sorted(wanted)
    plan = sources(members, old_stage, old_pp, shadow_ok, need)
    # 4. Send what others take from this member, receive what it takes from others.
    mine_of = {}

    def state_of(t: int) -> dict:  # (asked only of a holder: `sources`)
        if t not in mine_of:
            mine_of[t] = held.rt.stage_state() if old_stage[rank] == t else copy.state()
        return mine_of[t]

    def layers_of(r: int) -> list[tuple[int, int]]:  # (the new stage's layers, and its shadow's)
        s = manifest.coords[r][1]
        return [rt.partition[s]] + ([rt.partition[(s - 1) % manifest.pp]] if shadow is not None else [])

    sends = {(r, t): _dumps(reshard.trim(state_of(t), partition[t][0], layers_of(r)))
             for (r, t), src in sorted(plan.items()) if src == rank and r != rank}
    receives = [(src, t) for (r, t), src in sorted(plan.items()) if r == rank and src != rank]
    got = transport.exchange_blobs(sends, receives, "the layers moved to the new layout")
    states = {t: _loads(blob) for (_, t), blob in got.items()}
    for t in need[rank]:
        if t not in states:
            states[t] = state_of(t)
    rt.load_stage_state(reshard.assemble(partition, states.__getitem__, target, rt.partition[rt.stage], rt.module,
                                         "the survivors' state"))
    if shadow is not None:
        shadow.load(reshard.assemble(partition, states.__getitem__, target, shadow.layers, shadow.module,
                                     "the survivors' state"))
    return target, undone, sum(len(blob) for blob in got.values())


def _old_partition(moved: dict, rt) -> tuple[tuple[int, int], ...] | None:
    """The old layout's split of the model, for a process that never ran it: as its plan gave it
    (`moved["partition"]`), else the even split of the model's layers (None when emulated)."""
    from schedc.runtime.manifest import even_partition

    if moved.get("partition"):
        return tuple(tuple(p) for p in moved["partition"])
    if rt.partition is None:
        return None
    return even_partition(rt.partition[-1][1], int(moved["pp"]))


def _dumps(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _loads(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)
