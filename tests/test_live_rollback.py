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
from schedc.live.rollback import RollbackError, StepSnapshot, roll_back
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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_interrupted_all_reduce_keeps_the_copy_of_the_step_that_was_applied(tmp_path, optimizer, overlap):
    out = compiled(tmp_path, dp=2, pp=2, optimizer=optimizer)
    manifest = load_manifest(out)
    rank = manifest.stage_groups[0][0]  # a first-stage rank: one stage all-reduce per step (no loss)
    rt = Runtime(manifest, rank, _Transport(interrupt_at=2))
    snapshot = StepSnapshot(rt.module, rt.optimizer, overlap=overlap)
    rt.observer = _worker_observer(snapshot)
    initial = [p.detach().clone() for p in rt.params]

    snapshot.prefetch(rt.steps_done)  # as the live worker does when an iteration starts
    for p in rt.params:
        p.grad = torch.ones_like(p)
    rt.optimizer_step()  # step 1 applied
    assert rt.steps_done == 1 and snapshot.steps == 0
    snapshot.prefetch(rt.steps_done)  # overlapped: the state after step 1 goes to the spare buffers
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


# -- the overlapped copy: prefetched during the iteration into spare buffers, kept at the step ------

def _stage(optimizer: str, device: str = "cpu"):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
    params = list(module.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=0.01)}[optimizer]()
    return module, opt


def _backward(module, seed: int) -> None:
    """An iteration's forward and backward work: gradients, weights untouched."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = None
    x = torch.randn(3, 4, generator=g).to(next(module.parameters()).device)
    module(x).pow(2).sum().backward()


def _step(module, opt, seed: int) -> None:
    """An iteration's backward and its optimizer step, with no call to the snapshot."""
    _backward(module, seed)
    opt.step()


def _iteration(snap: StepSnapshot, module, opt, k: int) -> None:
    """Iteration k as a live rank runs it: prefetch as it starts, take just before the step."""
    snap.prefetch(k)
    _backward(module, k)
    snap.take(k)
    opt.step()


def _state(module, opt):
    return ({k: v.clone() for k, v in module.state_dict().items()},
            {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for i, p in enumerate(module.parameters()) if opt.state.get(p)})


def _assert_state(module, opt, expected) -> None:
    weights, state = _state(module, opt)
    assert weights.keys() == expected[0].keys() and state.keys() == expected[1].keys()
    for key, v in expected[0].items():
        assert torch.equal(weights[key], v), key
    for i, s in expected[1].items():
        assert state[i].keys() == s.keys()
        for key, v in s.items():
            assert torch.equal(state[i][key], v) if torch.is_tensor(v) else state[i][key] == v, (i, key)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("applied", [1, 3])
def test_a_rank_one_step_ahead_goes_back_exactly_while_the_next_copy_is_prefetched(optimizer, applied):
    """A rank applied step `applied - 1` and ran on into the next iteration (its prefetch is made)
    when a peer that never applied that step died: it goes back to the state before it, bit for
    bit (with Adam after one step: no optimizer state at all), and running the iteration again
    gives the state it had, bit for bit."""
    module, opt = _stage(optimizer)
    snap = StepSnapshot(module, opt, overlap=True)
    before = {}
    for k in range(applied):
        before[k] = _state(module, opt)
        _iteration(snap, module, opt, k)
    after = _state(module, opt)
    snap.prefetch(applied)  # the next iteration started; it is interrupted before its step
    _backward(module, seed=applied)

    assert roll_back(applied, applied - 1, snap)
    _assert_state(module, opt, before[applied - 1])
    _iteration(snap, module, opt, applied - 1)  # the iteration again, after the rollback
    _assert_state(module, opt, after)


def test_a_take_keeps_the_state_its_prefetch_copied():
    """The copy is written at the prefetch, not at the take: anything that changed the weights in
    between (nothing does in a live run: the iteration's forward and backward work only) shows."""
    module, opt = _stage("adam")
    snap = StepSnapshot(module, opt, overlap=True)
    _iteration(snap, module, opt, 0)
    prefetched = _state(module, opt)
    snap.prefetch(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    snap.take(1)
    opt.step()
    assert roll_back(2, 1, snap)
    _assert_state(module, opt, prefetched)


def test_a_prefetch_of_another_state_is_not_kept():
    """After a prefetch of 1 step the weights change by a step that takes no copy (a catch-up
    replays its donor's steps so): the take of 2 steps copies the state it finds."""
    module, opt = _stage("adam")
    snap = StepSnapshot(module, opt, overlap=True)
    _iteration(snap, module, opt, 0)
    snap.prefetch(1)
    _step(module, opt, seed=1)  # step 1, with no take
    current = _state(module, opt)
    snap.take(2)
    _step(module, opt, seed=2)
    assert roll_back(3, 2, snap)
    _assert_state(module, opt, current)


def test_a_prefetch_made_before_a_checkpoint_load_or_a_restore_is_not_kept():
    module, opt = _stage("adam")
    snap = StepSnapshot(module, opt, overlap=True)
    _iteration(snap, module, opt, 0)
    snap.prefetch(1)
    # A checkpoint of the same step count, with other weights, replaces the state.
    other_module, other_opt = _stage("adam")
    _step(other_module, other_opt, seed=7)
    module.load_state_dict(other_module.state_dict())
    opt.load_state_dict(other_opt.state_dict())
    snap.invalidate()
    with pytest.raises(RollbackError):
        roll_back(1, 0, snap)  # the copy of before step 0 is not of this state's past
    loaded = _state(module, opt)
    snap.take(1)
    _step(module, opt, seed=1)
    assert roll_back(2, 1, snap)
    _assert_state(module, opt, loaded)

    # A restore: a prefetch made in the interrupted iteration is of the state it replaced.
    _iteration(snap, module, opt, 1)
    snap.prefetch(2)
    assert roll_back(2, 1, snap)
    _step(module, opt, seed=8)  # another state with 2 steps (no take: made only to tell the two apart)
    other = _state(module, opt)
    snap.take(2)
    _step(module, opt, seed=9)
    assert roll_back(3, 2, snap)
    _assert_state(module, opt, other)


def test_the_overlapped_copy_allocates_nothing_once_its_buffers_are_filled_and_holds_two_copies():
    module, opt = _stage("adam")
    snap = StepSnapshot(module, opt, overlap=True)
    for k in range(3):  # Adam's state appears at step 0; each set of buffers gets it at its next prefetch
        _iteration(snap, module, opt, k)
    held = snap.buffers()  # (held here: a buffer allocated anew cannot take a freed one's place)
    pointers = [b.data_ptr() for b in held]
    for k in range(3, 6):
        _iteration(snap, module, opt, k)
    snap.prefetch(6)
    assert roll_back(6, 5, snap)
    _iteration(snap, module, opt, 5)
    now = snap.buffers()
    assert len(now) == len(held) and {id(b) for b in now} == {id(b) for b in held}
    assert sorted(b.data_ptr() for b in now) == sorted(pointers)
    params = list(module.parameters())
    one = 4 * sum(p.numel() for p in params) * 3 + 4 * len(params)  # weights, m, v (+ Adam's step)
    assert snap.nbytes == snap.host_bytes == 2 * one and snap.device_bytes == 0
    assert StepSnapshot(module, opt).overlap is False  # on a CPU: one copy, taken at the step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_copy_is_pinned_host_memory_and_goes_back_bit_for_bit():
    module, opt = _stage("adam", device="cuda")
    snap = StepSnapshot(module, opt)
    assert snap.overlap  # on by default with the parameters on a GPU
    params = list(module.parameters())
    _backward(module, seed=0)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    snap.prefetch(0)
    snap.take(0)  # the first copy: its buffers are allocated here, none on the GPU
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    opt.step()
    before = {}
    for k in range(1, 4):
        before[k] = _state(module, opt)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        snap.prefetch(k)  # (its buffers get Adam's state at k = 1 and 2: in host memory)
        _backward(module, seed=k)  # (the gradients it replaces are of the same sizes)
        snap.take(k)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated
        opt.step()
    assert snap.device_bytes == 0 and all(b.device.type == "cpu" for b in snap.buffers())
    on_gpu = sum(p.numel() for p in params) + sum(v.numel() for s in opt.state.values() for v in s.values()
                                                  if torch.is_tensor(v) and v.is_cuda)  # weights, m, v
    assert on_gpu >= 3 * sum(p.numel() for p in params)
    assert sum(b.numel() for b in snap.buffers() if b.is_pinned()) == 2 * on_gpu  # their copies, twice
    snap.prefetch(4)
    _backward(module, seed=4)  # interrupted before its step
    assert roll_back(4, 3, snap)
    _assert_state(module, opt, before[3])
    _iteration(snap, module, opt, 3)
    snap.prefetch(4)
    snap.invalidate()  # (as after a checkpoint load: no copy kept, the prefetch unusable)
    current = _state(module, opt)
    snap.take(4)  # copied here, on the current stream
    _step(module, opt, seed=5)
    assert roll_back(5, 4, snap)
    _assert_state(module, opt, current)
