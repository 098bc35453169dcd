"""`schedc.Replanner`: prepared replans equal cold ones, and a foreground call never waits for them."""

from __future__ import annotations

import importlib
import threading
import time

import pytest

import schedc
from schedc.diagnostics import InfeasibleError
from schedc.plan import compile
from schedc.replanner import Replanner, likely_events
from schedc.solvers.cpsat import warm_up
from schedc.verify import verify_schedule
from test_replan import SPEC  # (the 3 x 3 cluster the replan tests use)


replanner_module = importlib.import_module("schedc.replanner")
replan_module = importlib.import_module("schedc.replan")  # (`schedc.replan` is the function)
DEADLINE = 0.3
#: Bounds every wait of these tests (a hung background thread fails them, never hangs them).
WAIT_S = 120.0


@pytest.fixture(scope="module")
def plan():
    warm_up()
    return compile(schedc.load(SPEC), time_limit=0.5)


def cold(plan, event):
    """What a cold replan on the work budget of `DEADLINE` alone gives."""
    return schedc.replan(plan, event, deadline=None, time_limit=replan_module.work_budget(DEADLINE))


def same(a, b) -> bool:
    return (a.schedule.ops == b.schedule.ops and a.spec == b.spec and a.metrics.iteration_time == b.metrics.iteration_time
            and a.schedule.solver.detail == b.schedule.solver.detail and a.schedule.solver.stopped_by == "work")


def test_prepared_replans_equal_cold_ones_on_the_work_budget(plan):
    """Every likely event (each GPU, each node) is prepared; the plan a foreground call gets
    for it is verified and the very plan a cold replan on the same work budget gives, for the
    event as text, as a `Failure` or in a list."""
    events = likely_events(plan)
    assert len(events) == 9 + 3
    with schedc.Replanner(plan, deadline=DEADLINE) as rp:
        rp.prepare()
        assert rp.wait(WAIT_S)
        for ev in ["fail gpu(dp=1, pp=2)", "fail node 2"]:
            got = rp.prepared(ev)
            assert got is not None and rp.replan(ev) is got and rp.replan([ev]) is got
            verify_schedule(got.schedule)
            assert same(got, cold(plan, ev))
        for (f,) in events[:3]:
            assert same(rp.replan(f), cold(plan, f))


def test_an_event_whose_replan_raises_keeps_its_error(plan):
    """Both GPUs of a stage failing (two events together) loses the stage: E301, prepared as
    the error a cold call raises."""
    evs = ["fail gpu(dp=0, pp=1)", "fail gpu(dp=1, pp=1)", "fail gpu(dp=2, pp=1)"]
    with Replanner(plan, deadline=DEADLINE) as rp:
        rp.prepare([evs])
        assert rp.wait(WAIT_S)
        assert rp.prepared(evs) is None
        with pytest.raises(InfeasibleError) as got:
            rp.replan(evs)
    assert "E301" in got.value.codes


def test_a_foreground_call_never_waits_for_the_background(plan, monkeypatch):
    """The background is held inside its replan of an event (a stalled thread); a foreground
    call for that very event returns a plan of its own, planned cold under its deadline and
    verified, while the background still holds. Released, the background prepares the event,
    and the prepared plan is the cold one on the work budget."""
    real = replanner_module.replan
    inside, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        if threading.current_thread().name == "schedc-replanner":
            inside.set()
            release.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(replanner_module, "replan", held)
    ev = "fail gpu(dp=2, pp=0)"
    rp = Replanner(plan, deadline=DEADLINE)
    try:
        rp.prepare([ev])
        assert inside.wait(WAIT_S)
        now = rp.replan(ev)
        assert not release.is_set() and rp.prepared(ev) is None  # planned while the background held
        verify_schedule(now.schedule)
        release.set()
        assert rp.wait(WAIT_S)
        assert same(rp.prepared(ev), cold(plan, ev))
    finally:
        release.set()
        assert rp.close(WAIT_S)


def test_the_background_waits_while_a_foreground_call_runs_but_never_holding_a_lock(plan):
    """The background thread's hook: entering a function while a foreground call runs, it
    waits until the call ends; holding the Replanner's lock or the collector pause's (which a
    foreground call takes), it goes on."""
    rp = Replanner(plan, deadline=WAIT_S)
    frame = __import__("sys")._getframe()
    passed = threading.Event()

    def enter():
        rp._yield(frame, "call", None)
        passed.set()

    waiting = threading.Event()

    class Noted(threading.Event):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    rp._clear = Noted()
    rp._foreground, rp._until = 1, time.monotonic() + WAIT_S
    thread = threading.Thread(target=enter)
    thread.start()
    assert waiting.wait(WAIT_S)
    assert not passed.is_set()  # it waits for the call to end
    rp._foreground = 0
    rp._clear.set()
    thread.join(WAIT_S)
    assert passed.is_set()

    rp._foreground = 1
    rp._clear.clear()
    for lock in (rp._mutex, replan_module._pause_lock):
        with lock:
            rp._yield(frame, "call", None)  # returns at once: a wait here could deadlock
    rp._clear.set()
    rp.close()


def test_a_replan_without_a_deadline_needs_a_work_budget(plan):
    with pytest.raises(InfeasibleError) as got:
        schedc.replan(plan, "fail gpu(dp=0, pp=0)", deadline=None)
    assert "E320" in got.value.codes


def test_a_closed_replanner_prepares_nothing_more(plan):
    rp = Replanner(plan, deadline=DEADLINE)
    rp.prepare(["fail gpu(dp=0, pp=0)"])
    assert rp.close(WAIT_S)
    with pytest.raises(RuntimeError):
        rp.prepare()
    assert rp.replan("fail gpu(dp=0, pp=2)").schedule.ops  # a cold call still plans
