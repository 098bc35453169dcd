"""`schedc.Replanner(plan)`: the likely next events of a plan, planned ahead on a background thread.

A launcher that holds a current plan asks for the replans it will most likely
need (every single-GPU failure and every node failure, by default) while the
cluster runs, and answers the event when it comes from what was prepared:

    >>> replanner = schedc.Replanner(plan, deadline=0.1)   # doctest: +SKIP
    >>> replanner.prepare()                                 # doctest: +SKIP
    >>> new = replanner.replan("fail gpu(dp=2, pp=1)")      # doctest: +SKIP

A prepared event is answered in microseconds with a verified plan, the very plan
`schedc.replan(plan, event, deadline=None, time_limit=work_budget(deadline))`
gives: planned on the work budget alone, so it is the plan a quiet machine
returns under `deadline` whenever its `stopped_by` is "work", whatever the
load was while it was prepared (docs/planner.md, work budgets and deadlines).
An event not prepared yet is planned then and there by `schedc.replan` under the
call's deadline (a cold call), without waiting for the background.

The background never delays a foreground call by more than the interpreter's
thread switch interval (`sys.getswitchinterval()`, 5 ms by default, the most a
thread waits for the interpreter lock): the background thread checks, at every
function it calls (Python's or C's), whether a foreground call (`replan`) is running,
and then waits, without the lock, until none is (not while it holds one of
schedc's own locks, which the foreground may need, nor for longer than the
foreground call's deadline and a second). The events are planned in order,
one at a time; an event whose replan raises (e.g. E301: a stage loses its last
GPU) keeps its error, which `replan` raises as a cold call would. `close()`
stops the preparing (the replan under way finishes on the thread, unused); a
`Replanner` is also a context manager. Prepared plans are kept until then: at 64 GPUs
one holds 3.3 MB (its 6,208 ops), the 72 likely events 240 MB. It does not lower the thread's CPU
priority (a thread that holds the interpreter lock while the kernel leaves it
waiting would hold up the foreground): preparing uses a core while the
foreground is idle.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Sequence

from schedc.diagnostics import SchedcError
from schedc.events import parse_events
from schedc.failures import describe_failure
from schedc.plan import Plan
from schedc.replan import _pause_lock, replan, work_budget
from schedc.solvers import sandbox
from schedc.spec import Failure

Events = "str | Failure | Sequence[str | Failure]"


def likely_events(plan: Plan) -> list[tuple[Failure, ...]]:
    """The events a `Replanner` prepares by default: each live GPU failing alone (rank order),
    then each node with a live GPU failing (node order)."""
    gpus = [g for g in plan.instance.gpus if g.live]
    out = [(Failure("fail_gpu", dp=g.dp, pp=g.pp),) for g in gpus]
    out += [(Failure("fail_node", node=n),) for n in sorted({g.node for g in gpus})]
    return out


class Replanner:
    """Replans of `plan` prepared ahead (see the module docstring).

    `deadline` is the deadline a foreground call gets by default and the one whose work
    budget (`schedc.replan.work_budget`) prepared plans are planned on; `solver`, `seed` and
    `symmetric` as for `schedc.replan`.
    """

    def __init__(self, plan: Plan, deadline: float = 1.0, *, solver: str = "cpsat", seed: int = 0,
                 symmetric: bool | None = None):
        self.plan = plan
        self.deadline = deadline
        self.time_limit = work_budget(deadline)
        self._args = dict(solver=solver, seed=seed, symmetric=symmetric)
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._queue: list[tuple[Failure, ...]] = []
        self._results: dict[tuple[Failure, ...], Plan | SchedcError] = {}
        self._planning: tuple[Failure, ...] | None = None
        self._foreground = 0  # foreground calls running now
        self._until = 0.0  # time.monotonic() by which the latest of them is due to end
        self._clear = threading.Event()  # set while no foreground call runs
        self._clear.set()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._texts: dict[str, tuple[Failure, ...]] = {}  # event text -> its parse

    # -- the launcher's side ------------------------------------------------------------------

    def prepare(self, events: Sequence[Events] | None = None) -> None:
        """Queue events to plan in the background (each one an event or a list of events applied
        together), after those queued before; by default `likely_events(plan)`. Events prepared
        or queued already are not queued again."""
        keys = likely_events(self.plan) if events is None else [self._key(e) for e in events]
        for key in keys:
            if len(key) == 1:  # the event's text as `describe_failure` writes it needs no parsing
                self._texts.setdefault(describe_failure(key[0]), key)
        with self._lock:
            if self._closed:
                raise RuntimeError("this Replanner is closed")
            for key in keys:
                if key not in self._results and key not in self._queue and key != self._planning:
                    self._queue.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="schedc-replanner", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def prepared(self, event: Events) -> Plan | None:
        """The plan prepared for `event`, or None when it is not ready (or its replan raised)."""
        found = self._results.get(self._key(event))
        return found if isinstance(found, Plan) else None

    def replan(self, event: Events, deadline: float | None = None) -> Plan:
        """The new plan for `event`: the prepared one when it is ready, else `schedc.replan(plan,
        event, deadline)` planned now (`deadline` defaults to the Replanner's), the background
        waiting meanwhile. Raises what `schedc.replan` raises."""
        key = self._key(event)
        found = self._results.get(key)
        if found is not None:
            if isinstance(found, SchedcError):
                raise found
            return found
        deadline = self.deadline if deadline is None else deadline
        with self._lock:
            self._foreground += 1
            self._until = max(self._until, time.monotonic() + deadline)
            self._clear.clear()
        try:
            return replan(self.plan, key, deadline, **self._args)
        finally:
            with self._lock:
                self._foreground -= 1
                if self._foreground == 0:
                    self._clear.set()

    def _key(self, event: Events) -> tuple[Failure, ...]:
        """The events as `Failure`s (`parse_events`); a text seen before is not parsed again."""
        if isinstance(event, str):
            key = self._texts.get(event)
            if key is None:
                key = self._texts[event] = parse_events(event)
            return key
        if isinstance(event, Failure):
            return (event,)
        return tuple(f for e in event for f in self._key(e))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued event is prepared; False if `timeout` seconds passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and self._planning is None, timeout)

    def close(self, wait: float | None = 0.0) -> bool:
        """Stop preparing: nothing more is planned, and the replan under way, if any, is not kept.
        Waits up to `wait` seconds (None: until it ends) for the thread to end; whether it did."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(wait)
        return not thread.is_alive()

    def __enter__(self) -> "Replanner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the background thread ----------------------------------------------------------------

    def _work(self) -> None:
        sys.setprofile(self._yield)  # this thread only: a check at every function it enters
        try:
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: self._queue or self._closed)
                    if self._closed:
                        return
                    key = self._planning = self._queue.pop(0)
                result: Plan | SchedcError | None
                try:
                    result = replan(self.plan, key, None, time_limit=self.time_limit, **self._args)
                except SchedcError as exc:
                    result = exc
                except Exception:  # a bug: the event is left to a cold call, which raises it there
                    result = None
                with self._lock:
                    if not self._closed and result is not None:
                        self._results[key] = result
                    self._planning = None
                    self._lock.notify_all()
        finally:
            sys.setprofile(None)
            with self._lock:
                self._planning = None
                self._lock.notify_all()

    def _yield(self, frame, event: str, arg) -> None:
        """The background thread's profile hook: on calling a function (Python's or C's: the
        planner's inner loops call few Python functions, but many C ones, such as a heap's push)
        while a foreground call runs, wait (without the interpreter's lock) until none does. Not while this thread
        holds a lock of schedc's that a foreground call takes (the Replanner's, the replans'
        collector pause, the CP-SAT sandbox's) or runs a module's top level (an import, whose
        lock the foreground may need), and not past the foreground calls' deadlines and
        `_WAIT_MARGIN_S`: a wait never deadlocks, whatever else this thread holds."""
        if not self._foreground or event not in _WAITS_AT or frame.f_code.co_name == "<module>":
            return
        if self._mutex.locked() or _held():
            return
        while self._foreground and not self._closed:
            left = self._until + _WAIT_MARGIN_S - time.monotonic()
            if left <= 0:
                return
            self._clear.wait(left)


#: The profile events at which the background waits for a foreground call to end: every call.
_WAITS_AT = frozenset({"call", "c_call"})

#: Seconds past the due end of the foreground calls after which the background goes on even if
#: one still runs (one that waits for something this thread holds would otherwise never end).
_WAIT_MARGIN_S = 1.0


def _held() -> bool:
    """Whether a lock that a foreground replan takes is held (by any thread)."""
    return _pause_lock.locked() or sandbox._LOCK.locked()
