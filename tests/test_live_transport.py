"""The live transport's waits over real gloo groups (threads of one process, as two ranks)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from schedc.runtime.transport import Interrupted, Transport


def _pair(timeout_s: float):
    store = dist.HashStore()
    groups = {}

    def form(r: int) -> None:
        groups[r] = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), r, 2, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=form, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(groups) == {0, 1}
    return groups


class _Flag:
    """An `interrupted` callback that counts how often the transport asked it."""

    def __init__(self):
        self.asked = 0
        self.set = False
        self.changed = threading.Condition()

    def __call__(self) -> bool:
        with self.changed:
            self.asked += 1
            self.changed.notify_all()
            return self.set

    def wait_asked(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.asked >= n, timeout=60)


def _min(group, tensor: torch.Tensor):
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return group.allreduce([tensor], opts)


def test_an_aborted_rank_leaves_a_collective_its_peer_never_joined():
    """Seed 50043 of bench/chaos.py: a peer abandoned the generation while its groups formed (its
    connections stay open, it never posts the step-count all-reduce). Once the generation is
    aborted this rank must leave the all-reduce, not sit out the transport's timeout (600 s in a
    live run; an hour here, so that the test fails by its own bound instead of passing late)."""
    groups = _pair(timeout_s=3600)
    flag = _Flag()
    transport = Transport(None, 0, 3600.0, world=groups.pop(0), stage=None, interrupted=flag)
    outcome: list = []

    def resume() -> None:
        try:
            transport.all_reduce_min(torch.tensor([5, -5]), "the members' step counts")
            outcome.append("completed")
        except Interrupted as exc:
            outcome.append(str(exc))

    rank = threading.Thread(target=resume, daemon=True)
    rank.start()
    flag.wait_asked(3)  # before the wait, then while it looks at the work: the peer never posted its side
    assert outcome == [] and transport.waiting == "the members' step counts"
    with flag.changed:
        flag.set = True  # the generation is aborted
    rank.join(60)
    assert outcome == ["rank 0 stopped while waiting for the members' step counts"]
    assert transport.waiting is None
    # The rank drops the generation's groups and goes on: a group whose collective still runs
    # would hold its destructor (on this thread) until gloo's own timeout.
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive() and transport.world is None


@pytest.mark.parametrize("late", [False, True])
def test_a_watched_wait_completes_with_the_peers_values(late):
    groups = _pair(timeout_s=60)
    flag = _Flag()
    transport = Transport(None, 0, 60.0, world=groups[0], stage=None, interrupted=flag)
    mine = torch.tensor([3, -3])
    done = threading.Event()

    def rank0() -> None:
        transport.all_reduce_min(mine, "the members' step counts")
        done.set()

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    if late:  # the peer posts its side only once this rank has looked at its work a few times
        flag.wait_asked(5)
    assert _min(groups[1], torch.tensor([2, -7])).wait(timedelta(seconds=60))
    t.join(60)
    assert done.is_set() and mine.tolist() == [2, -7]
