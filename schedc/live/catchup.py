"""Catch-up: a GPU that (re)joins a running job fetches its stage's state from a live peer
while the others keep training, then enters at an iteration boundary.

A session S pairs a donor D (a member of the joiner's stage) with a joiner J:

1. at an iteration boundary, after k steps, D copies its stage's state
   (weights, optimizer state, k) and sends it as ``state``: another thread
   moves the bytes, D's training only pays the copy;
2. after each later step j, D sends the step's summed gradient as
   ``grad/j``;
3. J loads the state, then replays step after step from those gradients with
   its own optimizer: the same code on the same state as D, hence the same
   bits (no approximation, whatever the optimizer);
4. once J is close behind, the supervisor announces a planned switch at
   iteration k' whose plan includes J (`schedc.replan(..., "recover gpu(...)")`);
   D streams until step k'-1, J replays it and joins with k' steps, like
   every member. The survivors stall only for the switch (the pipeline
   drains at k', new process groups), never for the transfer.

The bytes go through a `schedc.live.transfer.StateTransfer` of session
``cu/S``: by default a two-rank gloo group between donor and joiner (the
direct one, about ten times the store's rate on one host), or the job's
store (``transfer="store"``, or $SCHEDC_TRANSFER=store), whose keys are
``cu/S/state`` and ``cu/S/grad/K``. Either way the donor's training only
queues: the transfer's own thread (direct) or the side thread (store) moves
the bytes. A failure during a session cancels it; the supervisor starts
another once the run has recovered. A transfer that breaks (its peer died)
ends that session's stream; the supervisor's cancelling of the session, or
a new one, follows from the peer's loss.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from schedc.live.membership import JobStore
from schedc.live.transfer import StateTransfer, TransferClosed, TransferError, open_transfer, warn


class Donor:
    """The donor side, driven by a member's iteration loop (`boundary` before each iteration,
    `after_step` after it). The main thread only copies the state and queues it; the bytes move on
    the transfer's thread (direct) or on `side` (a one-thread executor, over `job`: store)."""

    def __init__(self, job: JobStore, side: Callable[[], ThreadPoolExecutor], *, transfer: str | None = None,
                 timeout: float | None = None):
        self.job = job
        self.side = side
        self.kind = transfer  # "direct" or "store"; None: the default (`schedc.live.transfer.open_transfer`)
        self.timeout = timeout
        self.session: int | None = None
        self._out: StateTransfer | None = None  # this session's sending end (None: it broke)

    def boundary(self, rt, directive: dict | None) -> None:
        """Start (or stop) donating as this rank's directive says; the state is that after
        `rt.steps_done` steps, i.e. at this iteration boundary."""
        wanted = directive.get("session") if directive and directive.get("role") == "donate" else None
        if wanted == self.session:
            return
        if self._out is not None:  # the session ended (joined, or cancelled): free what it holds
            self._out.close()
            self._out = None
        self.session = wanted
        rt.keep_step_grad = wanted is not None
        if wanted is None:
            return
        self._out = open_transfer(self.kind, self.job, f"cu/{wanted}", sending=True, side=self.side,
                                  timeout=self.timeout)
        self._send("state", rt.stage_state())  # copies, taken now; sent while training goes on

    def after_step(self, rt) -> None:
        if self.session is None:
            return
        # Wrapped: a step's gradient is None when emulating, and a transfer sends no bare None.
        grad = rt.last_step_grad
        # In host memory: a joiner loads it wherever its own GPU is (a CUDA tensor would name the donor's).
        self._send(f"grad/{rt.steps_done - 1}", {"grad": None if grad is None else grad.to("cpu")})

    def _send(self, key: str, obj) -> None:
        if self._out is None:
            return
        try:
            self._out.send(key, obj)
        except TransferError as exc:  # the joiner is gone: stop streaming; the session will be cancelled
            if not isinstance(exc, TransferClosed):
                warn(f"catch-up session {self.session}: {exc}; the donor stops sending")
            self._out.close()
            self._out = None


class Joiner:
    """The joiner side: load the donor's state, replay its steps as their gradients arrive."""

    def __init__(self, job: JobStore, *, transfer: str | None = None, timeout: float | None = None):
        self.job = job
        self.kind = transfer
        self.timeout = timeout
        self.session: int | None = None
        self.steps: int | None = None  # steps applied (None: no state loaded yet in this session)
        self.received = 0  # bytes
        self._in: StateTransfer | None = None  # this session's receiving end (None: none, or it broke)

    def follow(self, rt, directive: dict | None) -> bool:
        """Catch up as far as the donor has gone; True when something was applied."""
        wanted = directive.get("session") if directive and directive.get("role") == "join" else None
        if wanted != self.session:
            if self._in is not None:
                self._in.close()
            self.session, self.steps, self.received, self._in = wanted, None, 0, None
            if wanted is not None:
                self._in = open_transfer(self.kind, self.job, f"cu/{wanted}", sending=False, timeout=self.timeout)
        if self._in is None:
            return False
        try:
            return self._follow(rt)
        except TransferError as exc:  # the donor is gone: wait for the supervisor's next session
            if not isinstance(exc, TransferClosed):
                warn(f"catch-up session {self.session}: {exc}; the joiner waits for another session")
            self._in.close()
            self._in = None
            return False

    def _follow(self, rt) -> bool:
        progressed = False
        if self.steps is None:
            state = self._in.recv("state")
            if state is None:
                return False
            rt.load_stage_state(state)
            self.steps, self.received, progressed = rt.steps_done, self._in.received, True
        while True:
            step = self._in.recv(f"grad/{self.steps}")
            if step is None:
                return progressed
            rt.apply_step(step["grad"])
            self.steps, self.received, progressed = rt.steps_done, self._in.received, True
