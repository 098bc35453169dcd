"""The copy a rollback restores, taken where nothing can interrupt the step it guards.

Found by bench/chaos.py (seed 3009): a rank stopped inside its stage's gradient all-reduce; the
all-reduce completed on one peer and not on another, the peer that stepped ran on into the next
iteration's optimizer op and replaced its copy there, so it could not go back to the step the
others had not applied (E552 "cannot roll back"). The copy is now taken after the all-reduce,
just before the step changes the weights."""

from __future__ import annotations

import types

import pytest
import torch

from live_support import compiled
from schedc.live.member import LiveWorker
from schedc.live.opclock import HostClock
from schedc.live.rollback import StepSnapshot, roll_back
from schedc.runtime import load_manifest
from schedc.runtime.primitives import Runtime
from schedc.runtime.transport import Interrupted


class _Transport:
    """Stage all-reduces that succeed, except call number `interrupt_at`."""

    def __init__(self, interrupt_at: int):
        self.calls, self.interrupt_at = 0, interrupt_at

    def all_reduce_stage(self, stage, tensor):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise Interrupted("a peer stopped inside the all-reduce")

    def barrier(self, what):
        pass


def _worker_observer(snapshot: StepSnapshot):
    """The live worker's own op callbacks (`LiveWorker.op_ready` / `op_done` / `step_starts`) on
    just the state they use."""
    state = types.SimpleNamespace(snapshot=snapshot, trigger=None, _clock=HostClock(),
                                  ops=0, iteration=0)
    return types.SimpleNamespace(**{name: types.MethodType(getattr(LiveWorker, name), state)
                                    for name in ("op_ready", "op_done", "step_starts")})


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_interrupted_all_reduce_keeps_the_copy_of_the_step_that_was_applied(tmp_path, optimizer):
    out = compiled(tmp_path, dp=2, pp=2, optimizer=optimizer)
    manifest = load_manifest(out)
    rank = manifest.stage_groups[0][0]  # a first-stage rank: one stage all-reduce per step (no loss)
    rt = Runtime(manifest, rank, _Transport(interrupt_at=2))
    snapshot = StepSnapshot(rt.module, rt.optimizer)
    rt.observer = _worker_observer(snapshot)
    initial = [p.detach().clone() for p in rt.params]

    for p in rt.params:
        p.grad = torch.ones_like(p)
    rt.optimizer_step()  # step 1 applied
    assert rt.steps_done == 1 and snapshot.steps == 0
    for p in rt.params:
        p.grad = torch.full_like(p, 2.0)
    with pytest.raises(Interrupted):
        rt.optimizer_step()  # step 2: its all-reduce never completes here
    assert rt.steps_done == 1 and snapshot.steps == 0  # the copy still guards step 1

    # The survivors agree on 0 steps (a peer never applied step 1): this rank goes back exactly.
    assert roll_back(rt.steps_done, 0, snapshot)
    assert all(torch.equal(a, p) for a, p in zip(initial, rt.params))
    if optimizer == "adam":
        assert all(not rt.optimizer.state.get(p) for p in rt.params)  # no Adam state before step 1
