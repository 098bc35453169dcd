"""Run every rank's program in one process, one thread per rank, over an in-memory transport.

`run_threads` is for checking programs quickly (hundreds of random
schedules in a test) without starting processes. Its `ThreadTransport` has
the blocking semantics of the gloo `Transport`: a send never blocks (the
message is queued at the receiver under its (source, tag)), a receive
blocks until that message arrives, the stage all-reduce blocks until every
live GPU of the stage has contributed (and sums them in rank order), the
barrier blocks until every rank arrives. A rank that fails stops the others
at their next wait, and every wait has a timeout: a deadlock is a
`RunError`, never a hang.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from schedc.diagnostics import RunError, SchedcError, error
from schedc.runtime.manifest import Manifest, load_manifest
from schedc.runtime.primitives import Runtime
from schedc.runtime.program import load_program

_POLL = 0.02  # seconds between checks of "has another rank failed?"


class _Aborted(Exception):
    """Another rank failed: this one stops without an error of its own."""


class ThreadWorld:
    """What the rank threads share: mailboxes, stage reducers, the world barrier."""

    def __init__(self, manifest: Manifest, timeout: float):
        self.manifest = manifest
        self.timeout = timeout
        self.failed = threading.Event()
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self._cond = threading.Condition()
        self._parts: dict[tuple, dict[int, torch.Tensor]] = defaultdict(dict)
        self._sums: dict[tuple, torch.Tensor] = {}
        self._rounds: dict[tuple, int] = defaultdict(int)  # (kind, stage, rank) -> calls so far

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(src, dst, tag)]

    def collective(self, kind: str, stage: int, rank: int, members: tuple[int, ...], tensor: torch.Tensor,
                   what: str) -> None:
        """Sum `tensor` over `members` in rank order, in place; blocks until all contributed."""
        with self._cond:
            n = self._rounds[(kind, stage, rank)]
            self._rounds[(kind, stage, rank)] += 1
            key = (kind, stage, n)
            self._parts[key][rank] = tensor.detach().clone()
            if len(self._parts[key]) == len(members):
                parts = self._parts.pop(key)
                self._sums[key] = torch.stack([parts[r] for r in sorted(parts)]).sum(0)
                self._cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while key not in self._sums:
                if self.failed.is_set():
                    raise _Aborted()
                if time.monotonic() > deadline:
                    raise RunError([error("E530", f"rank {rank} waited {self.timeout:g} s for {what}")])
                self._cond.wait(_POLL)
            tensor.copy_(self._sums[key])


class ThreadTransport:
    """The `Transport` interface of `schedc.runtime.primitives`, in memory."""

    def __init__(self, world: ThreadWorld, rank: int):
        self.world = world
        self.rank = rank
        self.manifest = world.manifest

    def send(self, tensor: torch.Tensor, to: int, tag: int, what: str) -> None:
        self.world.box(self.rank, to, tag).put(tensor.detach().clone())

    def recv(self, shape, dtype, frm: int, tag: int, what: str) -> torch.Tensor:
        box = self.world.box(frm, self.rank, tag)
        deadline = time.monotonic() + self.world.timeout
        while True:
            try:
                msg = box.get(timeout=_POLL)
                break
            except queue.Empty:
                if self.world.failed.is_set():
                    raise _Aborted()
                if time.monotonic() > deadline:
                    raise RunError([error("E530", f"rank {self.rank} waited {self.world.timeout:g} s for "
                                                  f"{what} from rank {frm}")])
        if tuple(msg.shape) != tuple(shape) or msg.dtype != dtype:
            raise RunError([error("E535", f"rank {self.rank} got {what} from rank {frm} with shape "
                                          f"{tuple(msg.shape)}, expected {tuple(shape)}")])
        return msg

    def all_reduce_stage(self, stage: int, tensor: torch.Tensor) -> None:
        members = self.manifest.stage_groups[stage]
        self.world.collective("stage", stage, self.rank, members, tensor,
                              f"the gradient all-reduce of stage {stage} with ranks {list(members)}")

    def barrier(self, what: str) -> None:
        self.world.collective("barrier", -1, self.rank, self.manifest.live_ranks, torch.zeros(1), what)

    def begin_iteration(self) -> None:
        pass

    def flush(self) -> None:
        pass


def run_threads(out_dir: Path | str, *, iterations: int = 1, emulate: bool = False,
                timeout: float = 30.0) -> tuple[dict | None, list[float]]:
    """Run the programs in `out_dir` in threads: (state_dict of the whole model or None
    when emulating, mean loss per iteration). Raises `RunError` if any rank fails."""
    manifest = load_manifest(out_dir)
    world = ThreadWorld(manifest, timeout)
    programs = {r: load_program(Path(out_dir), manifest, r) for r in manifest.live_ranks}
    runtimes: dict[int, Runtime] = {}
    losses: dict[int, list[float]] = defaultdict(list)
    errors: dict[int, list] = {}

    # Built here, one after another: `model.source` seeds torch's global generator, which
    # threads building at once would share (processes each have their own).
    for rank in manifest.live_ranks:
        runtimes[rank] = Runtime(manifest, rank, ThreadTransport(world, rank), emulate=emulate)

    def body(rank: int) -> None:
        rt = runtimes[rank]
        try:
            for it in range(iterations):
                rt.begin_iteration(it)
                programs[rank].iteration(rt)
                losses[rank].append(rt.loss_sum)
        except _Aborted:
            pass
        except SchedcError as exc:
            errors[rank] = list(exc.diagnostics)
            world.failed.set()
        except Exception as exc:
            errors[rank] = [error("E590", f"rank {rank} failed: {type(exc).__name__}: {exc}")]
            world.failed.set()

    threads = [threading.Thread(target=body, args=(r,), name=f"schedc-rank-{r}", daemon=True)
               for r in manifest.live_ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RunError([d for r in sorted(errors) for d in errors[r]])
    last = manifest.stage_groups[-1]
    mean_losses = [sum(losses[r][it] for r in last) for it in range(iterations)]
    if emulate:
        return None, mean_losses
    state: dict = {}
    for group in manifest.stage_groups:
        state.update(runtimes[group[0]].state_dict())
    return state, mean_losses
