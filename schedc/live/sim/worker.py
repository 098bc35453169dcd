"""A simulated rank's process: the worker protocol of `schedc.live.member`, as a coroutine.

`SimWorker` follows `LiveWorker` step by step (wait for a generation that
names it, join, connect, agree where to resume and roll back one step if it
is ahead, run iterations, leave at a planned switch, stop at an abort, catch
up on standby, write its stage's checkpoint), talking to the supervisor
through the same `JobStore` and typed messages. What it computes is
replaced by bookkeeping: its stage's state is `history`, the iterations
whose update it holds, in order, so exactness is checkable at every step
(an update applied twice, or skipped, shows at once). With `--shadow` it
also holds the previous stage's `shadow`, a step behind its own state as a
real holder's is (`schedc.live.shadow`): the update of iteration k is
applied at its own step of iteration k + 1, and a generation that ends keeps
it only if a GPU of the shadowed stage took that step (its gradient was
sent). Dump generations save both as a real worker does.

`Network` stands for the process groups: a barrier per collective, and per
pipeline iteration an amount of work that advances only while every member
runs (a dead, stopped or hung member blocks the others, as a real
pipeline's receives would). A rank finishes an iteration when the progress
reaches its own share (members end a little apart, so a failure can land
after some have applied the step and before others have).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from schedc.live import checkpoint
from schedc.live.member import CONNECT_TIMEOUT, EXIT_ERROR
from schedc.live.protocol import (Aborted, CaughtUp, CheckpointFailed, CheckpointWritten, Done, IterationDone, Left,
                                  Ready, Started, WorkerError)

if TYPE_CHECKING:  # pragma: no cover
    from schedc.live.membership import Generation

# (`world` below is a `schedc.live.sim.world.SimWorld`, which imports this module: not imported here)

#: Simulated seconds between two polls of a waiting worker (a real one sleeps 5-10 ms).
POLL = 0.01
#: Simulated seconds a joiner needs to copy its donor's state before it follows its steps.
CATCH_UP_S = 0.3
#: Messages on an iteration's critical path that a slow link delays (a 3-stage pipeline's
#: forward and backward sends of a few microbatches).
SENDS_PER_ITERATION = 6
#: Simulated seconds a stage's checkpoint file takes to write (on the side: training goes on; a
#: worker killed meanwhile leaves it unwritten, and the checkpoint incomplete).
CHECKPOINT_WRITE_S = 0.15
#: Simulated seconds the layers of an in-place re-partition take to move among the members.
MOVE_S = 0.1

Wait = Callable[[], bool]


class Interrupted(Exception):
    """The generation was aborted, or a peer was lost: report `Aborted`, wait for the next."""


class Exit(Exception):
    def __init__(self, code: int):
        self.code = code


class Network:
    """Collectives and pipeline iterations among simulated ranks (see the module docstring)."""

    def __init__(self, world):
        self.world = world
        self.arrived: dict[tuple, dict[int, object]] = {}  # barrier -> rank -> its value
        self.iterations: dict[tuple[int, int], dict] = {}  # (generation, iteration) -> its progress
        self.active: list[tuple[int, int]] = []  # the iterations started and not finished by every member

    def arrive(self, key: tuple, rank: int, value: object = None) -> None:
        self.arrived.setdefault(key, {})[rank] = value

    def complete(self, key: tuple, members) -> bool:
        return set(members) <= set(self.arrived.get(key, {}))

    def values(self, key: tuple) -> list:
        return list(self.arrived[key].values())

    def enter_iteration(self, gen: int, it: int, rank: int, members: tuple[int, ...]) -> None:
        state = self.iterations.setdefault((gen, it), {"members": members, "in": set(), "work": None,
                                                       "progress": 0.0, "need": {}})
        state["in"].add(rank)
        if state["work"] is None and state["in"] >= set(members):
            work = (self.world.iteration_s * max(self.world.slowdown(r) for r in members)
                    + SENDS_PER_ITERATION * max(self.world.link_delay.get(r, 0.0) for r in members))
            rng = random.Random(f"{self.world.seed}/{gen}/{it}")
            state["work"] = work
            state["need"] = {r: work * (1 + 0.1 * rng.random()) for r in members}
            state["end"] = max(state["need"].values())
            self.active.append((gen, it))

    def progressing(self, gen: int, it: int) -> bool:
        state = self.iterations.get((gen, it))
        if state is None or state["work"] is None:
            return False
        return all(self.world.runs(r) for r in state["members"])

    def done(self, gen: int, it: int, rank: int) -> bool:
        state = self.iterations.get((gen, it))
        return bool(state and state["work"] is not None and state["progress"] >= state["need"][rank])

    def advance(self, dt: float) -> None:
        for key in list(self.active):
            state = self.iterations[key]
            if state["progress"] >= state["end"]:
                self.active.remove(key)
            elif self.progressing(*key):
                state["progress"] += dt
                for r in state["members"]:
                    w = self.world.workers.get(r)
                    if w is not None and (w.generation, w.iteration) == key:
                        w.ops += 1


class SimWorker:
    """One simulated worker process (see the module docstring)."""

    def __init__(self, world, rank: int, startup_s: float):
        self.world = world
        self.job = world.job
        self.net = world.net
        self.rank = rank
        self.epoch = self.job.epoch  # the epoch its rank is numbered in (`_follow_renames`)
        self.config = self.job.config()
        self.generation = -1
        self.iteration = -1
        self.ops = 0
        self.state = "starting"
        self.steps = 0
        self.history: list[int] = []  # the iterations whose update this rank's stage state holds
        self.alive = True
        self.stopped = False  # SIGSTOP
        self.stopped_at = 0.0  # when it was last stopped
        self.stalled = 0.0  # seconds it was held stopped so far (its stall clock, as `schedc.live.stall` keeps it)
        self.hung = False  # stuck (in an op, a connect, a wait): alive, beating, no progress
        self.exit_code: int | None = None
        self.exit_reported = False  # (its agent reported the exit)
        self.host_lost = False  # (died with its host: no exit reported, ever)
        self.beating = False
        self.next_beat = 0.0
        self._seq = 0
        self._session: int | None = None
        self._writing = 0  # checkpoint files being written on the side
        # --shadow: the iterations whose update this rank's copy of the previous stage holds (None:
        # no shadow), whether it is exact, and the iteration whose update comes with its next step
        # (`pending`, in this generation) or came before the last generation ended (`received`).
        pp = len({c[1] for c in self.config.coords.values()})
        self.shadow: list[int] | None = [] if self.config.shadow and pp > 1 else None
        self.shadow_stage = (self.config.coords[str(rank)][1] - 1) % pp
        self.shadow_valid = True
        self.pending: int | None = None
        self.received: int | None = None
        # What it held before an in-place move (stage, shadow), kept until the move's first
        # iteration is done everywhere, as `LiveWorker._held` (a retried move takes it from there).
        self.held: tuple | None = None
        self.held_until = -1
        self._session_at = 0.0
        self._co = self._main(startup_s)
        self._wait: Wait | None = None

    # -- the scheduler's side ------------------------------------------------------------------

    def step(self) -> None:
        """Run until the coroutine waits for something that does not hold yet (a stopped or hung
        process runs nothing; a hung one still beats: its heartbeat thread is alive)."""
        while self.alive and not self.stopped and not self.hung:
            if self._wait is not None and not self._wait():
                return
            try:
                self._wait = next(self._co)
            except StopIteration:
                self.exit(0)
            except Exit as exc:
                self.exit(exc.code)

    def exit(self, code: int) -> None:
        if self.alive:
            self.alive = False
            self.exit_code = code

    def payload(self) -> str:
        self._seq += 1
        state = self.state
        if state == "run" and not self.hung and not self.net.progressing(self.generation, self.iteration):
            state = "wait"
        tail = f" {round(self.stalled * 1000)}" if self.config.stall_clock else ""
        return f"{self._seq} {self.generation} {self.iteration} {self.ops} {state}{tail}"

    # -- helpers -------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.world.now

    def _sleep(self, seconds: float) -> Iterator[Wait]:
        until = self.now + seconds
        yield lambda: self.now >= until

    def aborted(self) -> bool:
        return self.job.aborted() >= self.generation >= 0

    def _stage(self, gen: "Generation") -> int:
        coords = gen.manifest["coords"]
        return coords[str(self.rank)][1] if str(self.rank) in coords else gen.coords_of(self.rank, self.config.coords)[1]

    # -- the process -----------------------------------------------------------------------------

    def _main(self, startup_s: float) -> Iterator[Wait]:
        yield from self._sleep(startup_s)  # interpreter, imports, the model
        self.beating, self.state = True, "idle"
        self.next_beat = self.now
        fleet = self.world.agents
        self.job.report(fleet.started(self.rank, self.epoch) if fleet else Started(self.rank, 100000 + self.rank, 0))
        after = -1
        while True:
            yield lambda: self.job.stopped() or self.job.latest_generation() > after
            if self.job.stopped():
                return
            gen = self.job.generation(self.job.latest_generation())
            if not self._follow_renames(gen):
                return  # re-partitioned in place without this process (it is ended anyway)
            if self.rank in gen.members:
                yield from self._serve(gen)
            else:
                yield from self._standby(gen)
            after = gen.number

    def _follow_renames(self, gen: "Generation") -> bool:
        """Take the rank this process has in `gen`'s epoch, as `LiveWorker._follow_renames`."""
        while self.epoch < gen.epoch:
            renamed = self.job.rename(self.epoch + 1)
            if self.rank not in renamed:
                return False
            self.rank, self.epoch = renamed[self.rank], self.epoch + 1
        return True

    def _serve(self, gen: "Generation") -> Iterator[Wait]:
        n, members = gen.number, gen.members
        self.generation, self.state = n, "join"
        stage = self._stage(gen)
        if gen.moved is None:  # (a move takes the old shadow as a source first: `_move`)
            self._shadow_for(gen, stage)
        if gen.moved is None or gen.restore is not None:
            self.held = None
        try:
            directive = self.job.directive(self.rank)
            if gen.start_at is not None and directive and directive.get("role") == "join" \
                    and self.steps < gen.start_at:
                yield from self._catch_up_to(gen)
            self.job.join(n, self.rank)
            yield lambda: self.job.all_joined(n, members) or self.aborted()
            if not self.job.all_joined(n, members):
                raise Interrupted(f"generation {n} was aborted while its members joined")
            self.net.arrive(("connect", n), self.rank)
            since = self.now
            yield lambda: (self.net.complete(("connect", n), members) or self.aborted()
                           or self.now - since > CONNECT_TIMEOUT)
            if not self.net.complete(("connect", n), members):
                raise Interrupted(f"generation {n} was aborted while its groups formed" if self.aborted()
                                  else f"rank {self.rank} could not connect generation {n}")
            if gen.restore is not None:
                self._shadow_for(gen, stage)
                self._restore(gen.restore, stage)
                start, undone = self.steps, False
            elif gen.moved is not None:
                start, undone = yield from self._move(gen, stage)
                self.held_until = start
            else:
                values = yield from self._gather(gen, "resume", self.steps, "where to resume")
                low, high = min(values), max(values)
                if gen.dump:  # (the lost stages' shadows may hold fewer steps: `LiveWorker._dump_target`)
                    low = min((yield from self._gather(gen, "dump", self._dump_candidate(gen, low, high),
                                                       "what to save")))
                if high - low > 1:
                    self._error("E552", f"survivors are more than one step apart ({low}..{high})")
                start = low
                undone = self.steps > start
                if undone:
                    self.history.pop()
                    self.steps = start
                self._shadow_catch_up(start)
            if gen.dump:
                yield from self._dump(gen, stage)
                self.job.report(Ready(rank=self.rank, gen=n, start=start, undone=undone, t=self.world.time(),
                                      shadow=self._shadow_exact()))
                return
            self.job.report(Ready(rank=self.rank, gen=n, start=start, undone=undone, t=self.world.time(),
                                  shadow=self._shadow_exact()))
            self.state = "run"
            for it in range(start, self.config.iterations):
                if self.aborted():
                    raise Interrupted("aborted between iterations")
                done, by = self.job.progress_of()
                if self.held is not None and by == n and done >= self.held_until:
                    self.held = None
                if self._switch_at(gen, it):
                    self.job.report(Left(rank=self.rank, gen=n, steps=self.steps, t=self.world.time()))
                    return
                self.iteration = it
                self.net.enter_iteration(n, it, self.rank, members)
                t0 = self.world.time()
                since = self.now
                yield lambda: (self.net.done(n, it, self.rank) or self.aborted()
                               or self.now - since > self.config.wait_timeout)
                if not self.net.done(n, it, self.rank):
                    raise Interrupted("aborted during an iteration" if self.aborted() else "a wait for a peer ran out")
                self._shadow_step(gen)
                self.steps += 1
                self.history.append(it)
                self.world.applied(self, it)
                self.world.taken.setdefault((n, it), set()).add(stage)
                if self.shadow is not None:
                    self.pending = it
                planned = self.world.iteration_s * 0.6
                starved = self.world.starvation(self.rank)
                compute = planned * self.world.slowdown(self.rank) * self.world.noise() * starved
                self.job.report(IterationDone(rank=self.rank, it=it, t0=t0, t1=self.world.time(), gen=n,
                                              steps=self.steps, compute=compute, planned=planned,
                                              queued=compute * (1 - 1 / starved)))
                self._maybe_checkpoint(gen, stage)
            self.state = "finish"
            yield lambda: self._writing == 0  # (a real worker waits for its side thread)
            self.job.report(Done(rank=self.rank, gen=n, steps=self.steps, t=self.world.time()))
        except Interrupted as exc:
            self.job.report(Aborted(rank=self.rank, gen=n, steps=self.steps, reason=str(exc), t=self.world.time()))
        finally:
            self._shadow_settle(n)
            self.state = "idle"

    # -- the shadow of the previous stage (--shadow) ---------------------------------------------

    def _shadow_for(self, gen: "Generation", stage: int) -> None:
        """The shadow this rank keeps in `gen`'s plan (`LiveWorker._link_shadow`): none in a plan
        without room for it or of one stage; a new, not yet exact one when the plan shadows
        another stage here (its state comes from the generation's restore or move)."""
        pp = int(gen.manifest["pp"])
        new_stage = (stage - 1) % pp
        if not (self.config.shadow and gen.shadow and pp > 1):
            self.shadow = None
        elif self.shadow is None or new_stage != self.shadow_stage or gen.moved is not None:
            self.shadow, self.shadow_valid, self.pending, self.received = [], False, None, None
        self.shadow_stage = new_stage

    def _shadow_exact(self) -> bool:
        return self.shadow is not None and self.shadow_valid and len(self.shadow) == self.steps

    def _shadow_step(self, gen: "Generation") -> None:
        """Just before this rank's own step: apply the update that came (a step behind)."""
        if self.shadow is None:
            return
        if self.pending is not None and self.pending == len(self.shadow):
            self.shadow.append(self.pending)
        self.pending = None
        if len(self.shadow) != self.steps:
            self.shadow_valid = False

    def _shadow_settle(self, n: int) -> None:
        """The generation ended: the last update came if a GPU of the shadowed stage took that step."""
        if self.shadow is None or self.pending is None:
            return
        self.received = self.pending if self.shadow_stage in self.world.taken.get((n, self.pending), ()) else None
        self.pending = None

    def _shadow_catch_up(self, target: int) -> None:
        if self.shadow is None:
            return
        got, self.received = self.received, None
        if got is not None and got == len(self.shadow) and got + 1 == target:
            self.shadow.append(got)
        if len(self.shadow) != target:
            self.shadow_valid = False

    def _shadow_reach(self) -> int:
        got = self.received
        return len(self.shadow) + (1 if got is not None and got == len(self.shadow) else 0)

    def _dump_candidate(self, gen: "Generation", low: int, high: int) -> int:
        coords = gen.manifest["coords"]
        if any(coords[str(r)][1] == self.shadow_stage for r in gen.members):
            return low  # (its stage has a survivor: the copy does not matter)
        return self._steps_to_keep(low, high)

    def _steps_to_keep(self, low: int, high: int) -> int:
        """`ShadowStage.steps_to_keep` of this rank's copy, whose stage is lost."""
        if self.shadow is None or not self.shadow_valid:
            return low
        reach = self._shadow_reach()
        if reach >= high - 1:
            return min(low, reach)
        self.shadow_valid = False
        return low

    def _gather(self, gen: "Generation", what: str, value, agreeing: str) -> Iterator[Wait]:
        """A collective of `gen`'s members (an all-reduce, an all-gather): every member's value,
        once all gave theirs; `Interrupted` if the generation is aborted first."""
        key = (what, gen.number)
        self.net.arrive(key, self.rank, value)
        yield lambda: self.net.complete(key, gen.members) or self.aborted()
        if not self.net.complete(key, gen.members):
            raise Interrupted(f"aborted while the members agreed {agreeing}")
        return self.net.values(key)

    def _dump(self, gen: "Generation", stage: int) -> Iterator[Wait]:
        """Save this rank's stage (the lowest member of it) and a lost stage's shadow (its first
        holder with an exact one), as `LiveWorker._dump` does; it takes CHECKPOINT_WRITE_S."""
        coords = gen.manifest["coords"]
        writes = []
        if self.rank == min(r for r in gen.members if coords[str(r)][1] == stage):
            writes.append((stage, list(self.history)))
        if self._shadow_exact() and not any(coords[str(r)][1] == self.shadow_stage for r in gen.members) \
                and self.job.store.add(f"g{gen.number}/dump/stage{self.shadow_stage}", 1) == 1:
            writes.append((self.shadow_stage, list(self.shadow)))
        if not writes:
            return
        yield from self._sleep(CHECKPOINT_WRITE_S)
        if self.aborted():
            raise Interrupted(f"generation {gen.number} was aborted while rank {self.rank} saved its state")
        for s, history in writes:
            where = dict(rank=self.rank, stage=s, iteration=self.steps, gen=gen.number)
            checkpoint.write_stage(Path(self.config.checkpoint_dir), self.steps, s,
                                   {"history": history, "pp": gen.manifest["pp"]},
                                   gen.number)
            self.job.report(CheckpointWritten(**where))

    def _move(self, gen: "Generation", stage: int) -> Iterator[Wait]:
        """An in-place re-partition (`schedc.live.move.move_in`): agree on the steps (lowered to
        what a lost stage's shadows reach), say which old stages this rank holds exactly there,
        then take the new stage's state (and the new shadow's) from the holders, in MOVE_S.
        What a stage holds is its history, so the state taken is checked against the steps."""
        n, members = gen.number, gen.members
        old_stage = {int(r): int(t) for r, t in gen.moved["stage"].items()}
        old_pp = int(gen.moved["pp"])
        lost = set(range(old_pp)) - set(old_stage.values())
        new = self.rank not in old_stage  # (a process started for this layout: a GPU back, the job grows)
        if gen.moved.get("retry") and self.held is not None:  # (the move before was aborted: from what it held)
            self.history, self.steps, self.shadow, self.shadow_stage, self.shadow_valid, self.received = \
                self._held_copy(self.held)
            self.pending = None
        values = yield from self._gather(gen, "resume", None if new else self.steps, "where to resume")
        low, high = min(v for v in values if v is not None), max(v for v in values if v is not None)
        mine = self._steps_to_keep(low, high) if not new and self.shadow_stage in lost else low
        target = min((yield from self._gather(gen, "move-steps", mine, "on the steps to move")))
        if high - target > 1:
            self._error("E552", f"survivors are more than one step apart ({target}..{high})")
        undone = not new and self.steps > target
        if undone:
            self.history.pop()
            self.steps = target
        if not new:
            self._shadow_catch_up(target)
            self.held = self._held_copy((self.history, self.steps, self.shadow, self.shadow_stage, self.shadow_valid,
                                         self.received))
        held = {} if new else {old_stage[self.rank]: list(self.history)}
        if not new and self._shadow_exact():
            held[self.shadow_stage] = list(self.shadow)
        holders: dict[int, list[list[int]]] = {}
        for got in (yield from self._gather(gen, "move-held", held, "on what they hold")):
            for t, history in got.items():
                holders.setdefault(t, []).append(history)
        for t in range(old_pp):
            if t not in holders:
                self._error("E552", f"no survivor holds stage {t} of the layout before the re-partition")
            for history in holders[t]:
                if history != list(range(target)):
                    self.world.violations.append(
                        f"t={self.now:.3f}: generation {n} moves stage {t} from a holder of {len(history)} updates "
                        f"{history[-3:]} at {target} steps ({'a lost stage' if t in lost else 'a survivor'})")
        # The transfers: point to point among the members; a lost member or an abort ends them.
        # (every member must run while it lasts: a stopped or dead peer holds it up)
        self.net.arrive(("move", n), self.rank)
        since = self.now

        def moved() -> bool:
            return (self.net.complete(("move", n), members) and self.now - since >= MOVE_S
                    and all(self.world.runs(r) for r in members))

        yield lambda: moved() or self.aborted() or self.now - since > self.config.wait_timeout
        if not moved():
            raise Interrupted("aborted during the move" if self.aborted() else "a transfer of the move ran out")
        self.history, self.steps = list(holders[0][0]), target
        self._shadow_for(gen, stage)
        if self.shadow is not None:
            self.shadow, self.shadow_valid = list(holders[0][0]), True
        return target, undone

    @staticmethod
    def _held_copy(held: tuple) -> tuple:
        history, steps, shadow, shadow_stage, valid, received = held
        return list(history), steps, (list(shadow) if shadow is not None else None), shadow_stage, valid, received

    def _switch_at(self, gen: "Generation", it: int) -> bool:
        latest = self.job.latest_generation()
        if latest <= gen.number:
            return False
        start_at = self.job.generation(latest).start_at
        return start_at is not None and it >= start_at

    def _standby(self, gen: "Generation") -> Iterator[Wait]:
        self.generation, self.state = gen.number, "standby"
        reported = None
        while not self.job.stopped() and self.job.latest_generation() <= gen.number:
            if self._follow() and self.steps != reported:
                reported = self.steps
                self.job.report(CaughtUp(rank=self.rank, session=self._session, steps=self.steps, bytes=1,
                                         t=self.world.time()))
            yield from self._sleep(POLL)

    def _follow(self) -> bool:
        """A joiner copies its donor's state once the session has run CATCH_UP_S, then keeps up
        with its steps; whether it holds a copy now."""
        d = self.job.directive(self.rank)
        if not d or d.get("role") != "join":
            self._session = None
            return False
        if d["session"] != self._session:
            self._session, self._session_at = d["session"], self.now
        donor = self.world.workers.get(d["donor"])
        if donor is None or not donor.runs() or self.now - self._session_at < CATCH_UP_S:
            return False
        self.steps, self.history = donor.steps, list(donor.history)
        self.shadow_valid = False  # (the donor's state, not stepped with this rank's shadow)
        return True

    def _catch_up_to(self, gen: "Generation") -> Iterator[Wait]:
        while self.steps < gen.start_at:
            if self.aborted() or self.job.stopped():
                raise Interrupted(f"generation {gen.number} was aborted while rank {self.rank} caught up")
            self._follow()
            yield from self._sleep(POLL)
        self.job.report(CaughtUp(rank=self.rank, session=self._session, steps=self.steps, bytes=1,
                                 t=self.world.time()))

    def runs(self) -> bool:
        return self.alive and not self.stopped and not self.hung

    # -- state on disk ---------------------------------------------------------------------------

    def _restore(self, restore: str, stage: int) -> None:
        self.pending = self.received = None
        self.shadow_valid = True
        if restore == "initial":
            self.steps, self.history = 0, []
            if self.shadow is not None:
                self.shadow = []
            return
        found = checkpoint.read(Path(restore))
        history = self._restored_stage(found, stage)
        self.steps, self.history = found.iteration, history
        self.world.restored(self, found.iteration)
        if self.shadow is not None:
            self.shadow = self._restored_stage(found, self.shadow_stage)
            if self.shadow != list(range(found.iteration)):
                self.world.violations.append(f"t={self.now:.3f}: rank {self.rank} restored a shadow of stage "
                                             f"{self.shadow_stage} that does not hold iterations 0..{found.iteration - 1}")

    def _restored_stage(self, found, stage: int) -> list[int]:
        """What `stage` of the running layout restores from `found`: its own file, or re-sharded
        from a checkpoint of another layout (`schedc.live.reshard`), whose stages then must all
        hold the same updates (a stage of the new layout is made of some of them)."""
        stages = int(found.meta.get("stages", 0))
        if stages == int(self.job.generation(self.generation).manifest["pp"]):
            return list(checkpoint.load_stage(found, stage)["history"])
        held = [list(checkpoint.load_stage(found, s)["history"]) for s in range(stages)]
        if any(h != held[0] for h in held):
            self.world.violations.append(f"t={self.now:.3f}: rank {self.rank} re-shards checkpoint {found.path.name}, "
                                         "whose stages hold different updates")
        return held[0]

    def _maybe_checkpoint(self, gen: "Generation", stage: int) -> None:
        every = self.config.checkpoint_every
        coords = gen.manifest["coords"]
        writers = [r for r in gen.members if coords[str(r)][1] == stage]
        if not every or self.steps % every or self.rank != min(writers):
            return
        where = dict(rank=self.rank, stage=stage, iteration=self.steps, gen=gen.number)
        steps, state = self.steps, {"history": list(self.history), "pp": gen.manifest["pp"]}  # (a copy)
        self._writing += 1

        def save() -> None:
            self._writing -= 1
            if not self.alive:
                return  # killed while it wrote: no file, no report
            try:
                checkpoint.write_stage(Path(self.config.checkpoint_dir), steps, stage, state, gen.number)
            except OSError as exc:
                self.job.report(CheckpointFailed(reason=str(exc), **where))
                return
            self.job.report(CheckpointWritten(**where))

        self.world.later(CHECKPOINT_WRITE_S, save)

    def _error(self, code: str, message: str) -> None:
        self.job.report(WorkerError(rank=self.rank, diagnostics=({"code": code, "message": message},)))
        raise Exit(EXIT_ERROR)
