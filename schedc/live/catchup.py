"""Catch-up: a GPU that (re)joins a running job fetches its stage's state from a live peer
while the others keep training, then enters at an iteration boundary.

A session S pairs a donor D (a member of the joiner's stage) with a joiner J:

1. at an iteration boundary, after k steps, D copies its stage's state
   (weights, optimizer state, k) and a side thread stores it as
   ``cu/S/state``: D's training only pays the copy;
2. after each later step j, D's side thread stores the step's summed
   gradient as ``cu/S/grad/j``;
3. J loads the state, then replays step after step from those gradients with
   its own optimizer: the same code on the same state as D, hence the same
   bits (no approximation, whatever the optimizer);
4. once J is close behind, the supervisor announces a planned switch at
   iteration k' whose plan includes J (`schedc.replan(..., "recover gpu(...)")`);
   D streams until step k'-1, J replays it and joins with k' steps, like
   every member. The survivors stall only for the switch (the pipeline
   drains at k', new process groups), never for the transfer.

The bytes go through the job's store: simple, and enough for the models of
the tests and benchmarks (the figures are in docs/live.md). For large models
a direct channel between donor and joiner is the way; it is not built.
A failure during a session cancels it; the supervisor starts another once
the run has recovered.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from schedc.live.membership import JobStore


def _dump(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes):
    import torch

    return torch.load(io.BytesIO(blob), weights_only=True)


class Donor:
    """The donor side, driven by a member's iteration loop (`boundary` before each iteration,
    `after_step` after it); the stores happen on `side` (a one-thread executor) over `job`."""

    def __init__(self, job: JobStore, side: Callable[[], ThreadPoolExecutor]):
        self.job = job
        self.side = side
        self.session: int | None = None
        self._keys: list[str] = []  # what this session stored

    def boundary(self, rt, directive: dict | None) -> None:
        """Start (or stop) donating as this rank's directive says; the state is that after
        `rt.steps_done` steps, i.e. at this iteration boundary."""
        wanted = directive.get("session") if directive and directive.get("role") == "donate" else None
        if wanted == self.session:
            return
        if self.session is not None:  # the session ended (joined, or cancelled): free what it stored
            keys, self._keys = self._keys, []
            self.side().submit(lambda: [self.job.drop_blob(k) for k in keys])  # after the stores queued
        self.session = wanted
        rt.keep_step_grad = wanted is not None
        if wanted is None:
            return
        state = rt.stage_state()  # copies, taken now; stored while training goes on
        self._store(f"cu/{wanted}/state", state)

    def after_step(self, rt) -> None:
        if self.session is None:
            return
        grad = rt.last_step_grad
        self._store(f"cu/{self.session}/grad/{rt.steps_done - 1}", None if grad is None else grad)

    def _store(self, key: str, obj) -> None:
        job = self.job
        self._keys.append(key)
        self.side().submit(lambda: job.put_blob(key, _dump(obj)))


class Joiner:
    """The joiner side: load the donor's state, replay its steps as their gradients arrive."""

    def __init__(self, job: JobStore):
        self.job = job
        self.session: int | None = None
        self.steps: int | None = None  # steps applied (None: no state loaded yet in this session)
        self.received = 0  # bytes

    def follow(self, rt, directive: dict | None) -> bool:
        """Catch up as far as the donor has gone; True when something was applied."""
        wanted = directive.get("session") if directive and directive.get("role") == "join" else None
        if wanted != self.session:
            self.session, self.steps, self.received = wanted, None, 0
        if self.session is None:
            return False
        progressed = False
        if self.steps is None:
            blob = self.job.blob(f"cu/{self.session}/state")
            if blob is None:
                return False
            rt.load_stage_state(_load(blob))
            self.job.drop_blob(f"cu/{self.session}/state")
            self.steps, self.received, progressed = rt.steps_done, len(blob), True
        while True:
            blob = self.job.blob(f"cu/{self.session}/grad/{self.steps}")
            if blob is None:
                return progressed
            rt.apply_step(_load(blob))
            self.job.drop_blob(f"cu/{self.session}/grad/{self.steps}")
            self.steps, self.received, progressed = rt.steps_done, self.received + len(blob), True
