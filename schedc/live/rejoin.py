"""Rejoin, the supervisor's side: bring a repaired (or replaced, or excluded and healed) GPU back.

A rejoin is asked for by an injection (``at iteration 9: recover gpu(dp=1, pp=2)``),
by a user (``schedc rejoin --store HOST:PORT "recover gpu(dp=1, pp=2)"``), or by
the slowdown ladder when an excluded GPU is healthy again. Then:

1. a worker process is started for the GPU if none runs (it waits on standby);
2. a catch-up session pairs it with a donor, the lowest live rank of its
   stage not donating already (`schedc.live.catchup`: a donor serves one
   session at a time; a GPU whose stage has none free waits for one): the
   donor streams its state and then every step's gradient while training goes on;
3. once the joiner is at most one step behind what the run has completed,
   the supervisor plans `recover gpu(...)` and announces a planned switch a
   couple of iterations ahead; the joiner replays up to it and enters there.

A failure while a session runs cancels it (the donor may roll back); the
session starts again, with a fresh state, once the run has recovered.
"""

from __future__ import annotations

from schedc.live.control import Controller
from schedc.live.protocol import CaughtUp, Phase
from schedc.spec import Failure


#: Bytes per second a joiner's first state is assumed to arrive at, at the least: a joiner says
#: nothing until its whole first state is loaded, so the no-progress bound grows by the stage's
#: state (`static` bytes) at this rate (a 2.6 GB stage: 130 s more). Below what both transfers
#: measure on one 2-core machine (`python bench/catchup_transfer.py`): a slower link needs a
#: longer --transition-timeout.
FIRST_STATE_RATE = 20e6


class Rejoins:
    """The rejoin policy (see the module docstring)."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl
        self.wanted: dict[int, str] = {}  # rank -> why it should come back
        self.sessions: dict[int, dict] = {}  # rank -> {session, donor, started, steps, bytes}
        self._next = 0
        self._waiting: set[int] = set()  # wanted ranks waiting for a donor of their stage to be free (said once)

    def request(self, rank: int, reason: str) -> None:
        ctl = self.ctl
        if rank in ctl.members:
            ctl.note("rejoin", f"{ctl.gpu_name(rank)} runs already: nothing to take back", rank=rank)
            return
        if rank in self.wanted:
            return
        self.wanted[rank] = reason
        ctl.note("rejoin", f"taking {ctl.gpu_name(rank)} (rank {rank}) back: {reason}", rank=rank, reason=reason)
        why = ctl.revive(rank)
        if why is not None:
            del self.wanted[rank]
            ctl.note("rejoin", f"cannot take {ctl.gpu_name(rank)} back: {why}; start `schedc agent` on that host, "
                               "then ask again", rank=rank)
            return
        if ctl.phase == Phase.RUNNING:
            self._start_session(rank)

    def resume(self) -> None:
        """After a recovery or a switch: sessions for every rank still wanted back (one the
        recovery took back itself, as a replacement process, is back). A session whose donor
        left the plan (a switch excluded it: on standby it sends nothing) starts again from
        another donor."""
        members = set(self.ctl.members)
        for rank in [r for r, s in self.sessions.items() if s["donor"] not in members and s["caught"] is None]:
            self._end_session(rank)
        for rank in sorted(self.wanted):
            if rank in members and rank not in self.sessions:
                del self.wanted[rank]
            elif rank not in self.sessions and self.ctl.is_running(rank):
                self._start_session(rank)

    def _start_waiting(self) -> None:
        """A donor is free again: the ranks that waited for one get their sessions (`resume`)."""
        if self.ctl.phase == Phase.RUNNING:
            self.resume()

    def _start_session(self, rank: int) -> None:
        ctl = self.ctl
        gpus = ctl.plan.spec.gpus
        stage = gpus[rank].pp
        peers = [r for r in ctl.members if gpus[r].pp == stage]
        if not peers:
            ctl.note("rejoin", f"rank {rank} cannot catch up: stage {stage} has no live GPU to copy from")
            return
        donating = {s["donor"] for s in self.sessions.values()}
        free = [r for r in peers if r not in donating]
        if not free:  # (a donor serves one session: its directive names one joiner)
            if rank not in self._waiting:
                ctl.note("catch-up", f"rank {rank} waits for a donor: every live GPU of stage {stage} is donating "
                                     "to another GPU coming back", rank=rank)
            self._waiting.add(rank)
            return
        self._waiting.discard(rank)
        donor = min(free)
        self._next += 1
        n = self._next
        ctl.direct(donor, {"role": "donate", "session": n, "joiner": rank})
        ctl.direct(rank, {"role": "join", "session": n, "donor": donor})
        now = ctl.now()
        self.sessions[rank] = {"session": n, "donor": donor, "started": now, "moved": now, "steps": None, "bytes": 0,
                               "caught": None}
        ctl.note("catch-up", f"rank {rank} catches up from rank {donor} (session {n}) while training goes on",
                 rank=rank, donor=donor, session=n)

    def caught_up(self, rep: CaughtUp) -> None:
        s = self.sessions.get(rep.rank)
        if s is None or rep.session != s["session"]:
            return
        now = self.ctl.now()
        if rep.steps != s["steps"]:
            s["moved"] = now
        s["steps"], s["bytes"] = rep.steps, rep.bytes
        lag = self.ctl.completed - rep.steps  # (iterations behind training)
        if s.get("lag") is None or lag < s["lag"]:
            s["lag"], s["gained"] = lag, now

    def check_progress(self, bound: float) -> None:
        """A catch-up that has not moved for `bound` seconds (no new step: the joiner or its donor
        is stuck; before its first state, `bound` plus that state's transfer at `FIRST_STATE_RATE`),
        or that has come no closer to training for `bound` seconds (it cannot keep up), ends; the
        GPU stays out, said once, instead of waiting (and its donor queueing gradients) forever."""
        now = self.ctl.now()
        for r, s in sorted(self.sessions.items()):
            allowed = bound if s["steps"] is not None else bound + self._state_bytes(r) / FIRST_STATE_RATE
            if s["caught"] is None and now - s["moved"] > allowed:
                first = "" if s["steps"] is not None else " (no first state yet)"
                self._give_up([r], f"its catch-up made no progress in {allowed:.3g} s{first}")
            elif s["caught"] is None and s.get("gained") is not None and now - s["gained"] > bound:
                # It moves, but no closer to training: the gradients come slower than training makes
                # them (a slow link), and the donor's backlog of them would grow for good.
                self._give_up([r], f"its catch-up does not gain on training: {s['lag']} or more iterations "
                                   f"behind for {bound:g} s (the gradients come slower than training makes them)")

    def _state_bytes(self, rank: int) -> int:
        """The state a joiner of `rank`'s stage receives first: the stage's weights and optimizer
        state, as the plan counts them (its `static` bytes)."""
        spec = self.ctl.plan.spec
        return spec.stages[spec.gpus[rank].pp].static

    def ready(self, completed: int) -> list[int]:
        """Joiners at most one step behind `completed` iterations: ready for the switch."""
        return sorted(r for r, s in self.sessions.items() if s["steps"] is not None and s["steps"] >= completed - 1)

    def switch_if_ready(self, completed: int) -> None:
        ctl = self.ctl
        ready = self.ready(completed)
        if not ready or ctl.phase != Phase.RUNNING:
            return
        from schedc.diagnostics import SchedcError
        from schedc.events import describe_events

        gpus = ctl.plan.spec.gpus
        events = [Failure("recover_gpu", dp=gpus[r].dp, pp=gpus[r].pp) for r in ready]
        try:
            plan = ctl.replan(ctl.base_plan, events)
        except SchedcError as exc:  # e.g. no plan with it fits: it stays out
            self._give_up(ready, f"no plan takes it back: {exc.diagnostics[0].message}")
            return
        for r in ready:
            self.sessions[r]["caught"] = ctl.now()
        reason = "; ".join(f"{describe_events([e])}: {self.wanted.get(r, 'asked for')}" for e, r in zip(events, ready))
        refused = ctl.switch(plan, kind="rejoin", reason=reason, ranks=ready)
        if refused is not None:
            self._give_up(ready, refused)

    def _give_up(self, ranks: list[int], why: str) -> None:
        """These joiners cannot come back in this run: say why once, end their sessions."""
        for rank in ranks:
            self.ctl.note("rejoin", f"rank {rank} stays out: {why}", rank=rank)
            self.wanted.pop(rank, None)
            self._end_session(rank)
        self._start_waiting()

    def _end_session(self, rank: int) -> None:
        s = self.sessions.pop(rank, None)
        self.ctl.direct(rank, None)
        if s is not None:
            self.ctl.direct(s["donor"], None)

    def catch_up_figures(self, ranks) -> tuple[float | None, int | None]:
        """(seconds from the session's start to caught up, bytes received), for the switch record."""
        ss = [self.sessions[r] for r in ranks if r in self.sessions and self.sessions[r]["caught"]]
        if not ss:
            return None, None
        return max(s["caught"] - s["started"] for s in ss), sum(s["bytes"] for s in ss)

    def joined(self, members) -> None:
        """A generation with these members is running: joiners in it are back; their sessions end."""
        for rank in [r for r in self.wanted if r in members]:
            self.wanted.pop(rank)
            self._waiting.discard(rank)
            self._end_session(rank)

    def cancel_all(self) -> None:
        """A failure: every session stops (a donor may roll back); `resume` starts them again."""
        for rank, s in self.sessions.items():
            self.ctl.direct(rank, None)
            self.ctl.direct(s["donor"], None)
        self.sessions.clear()

    def drop_all(self, why: str) -> list[int]:
        """Give up every GPU being taken back (said, with `why`); the ranks given up."""
        dropped = sorted(self.wanted)
        for rank in dropped:
            self.ctl.note("rejoin", f"rank {rank} was being taken back: {why}", rank=rank)
        self.cancel_all()
        self.wanted.clear()
        return dropped

    def drop_for_growth(self) -> list[int]:
        """The job grows onto another layout, killing the processes on standby: a GPU being taken
        back into the layout that ran counts as lost (said, instead of "its process died")."""
        return self.drop_all("the job grows onto another layout first: its GPU counts as lost; ask for it again "
                             "to grow the job onto it")

    def lost(self, rank: int) -> None:
        """A standby process died: it does not come back (a new request can start another)."""
        if rank in self.wanted:
            self.ctl.note("rejoin", f"the process rejoining rank {rank} died; it stays out", rank=rank)
            self.wanted.pop(rank)
        s = self.sessions.pop(rank, None)
        if s is not None:
            self.ctl.direct(s["donor"], None)
            self._start_waiting()
