"""The simulated world a supervisor runs against: a fake clock, the store, the processes.

`SimWorld` is a `schedc.live.world.World`. Its clock moves only in
`SimFleet.step` (the one place the supervisor waits): each step advances it,
lets the network progress, resumes every runnable worker in rank order,
sends the heartbeats that are due and reports the processes that ended, as
a host's agent would. Faults are signals to processes (`signal`: kill, stop,
cont) and states of the world (`hang`, `slow`, `starved`, `pause`, a forkserver that
must be restarted); `schedc.live.sim.run` decides when they happen.
"""

from __future__ import annotations

import random
from typing import Callable

from schedc.live.membership import JobStore
from schedc.live.protocol import AgentUp, Exited, Started
from schedc.live.sim.store import MemoryStore
from schedc.live.sim.worker import Network, SimWorker

#: The simulated clock's epoch (any fixed number: runs must not depend on the real time).
EPOCH = 1_800_000_000.0
#: The least simulated time one wait of the supervisor lasts: 10 ms (a real loop turn, `TICK`, is
#: 5 ms; heartbeats come every 50 ms and iterations take 50 ms, so nothing the protocol does
#: falls between two steps, and a run needs half the steps).
QUANTUM = 0.01
#: Simulated seconds a forkserver takes to start again after it died (a worker start waits for it).
FORKSERVER_RESTART_S = 2.0


class SimWorld:
    def __init__(self, seed: int, *, iteration_s: float = 0.05, startup_s: tuple[float, float] = (0.2, 1.5),
                 queue_delay_s: float = 0.0, beat_jitter: float = 0.0):
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0  # simulated seconds since the world began
        self.iteration_s = iteration_s
        self.startup_s = startup_s
        self.beat_jitter = beat_jitter
        delays = random.Random(f"{seed}/delays")
        self.job = JobStore.hosting(MemoryStore(lambda: self.now, lambda key: delays.uniform(0, queue_delay_s)), "sim", 0)
        self.net = Network(self)
        self.workers: dict[int, SimWorker] = {}
        self.slow: dict[int, float] = {}  # rank -> slowdown factor now
        self.starved: dict[int, float] = {}  # rank -> how much longer its compute takes for waiting for a CPU
        self.link_delay: dict[int, float] = {}  # rank -> seconds added to every message it sends
        self._later: list[tuple[float, int, Callable[[], None]]] = []  # (when, order, what): side work
        self.forkserver_down_until = -1.0
        self.pause_s = 0.0  # a pause of the whole machine, to happen at the next step
        self.agents: SimFleet | None = None  # the run's agents (`fleet`)
        self.on_step: list[Callable[[], None]] = []
        self.log: list[tuple[float, str]] = []  # what the world did, for a failure's replay
        self.violations: list[str] = []
        self.taken: dict[tuple[int, int], set[int]] = {}  # (generation, iteration) -> stages that took its step
        self.on_rename: list[Callable[[dict[int, int]], None]] = []  # (the checker re-keys what it keeps by rank)

    # -- World --------------------------------------------------------------------------------

    def time(self) -> float:
        return EPOCH + self.now

    def serve(self, host: str, port: int) -> JobStore:
        return self.job

    def fleet(self, job: JobStore, spec, hosts: int) -> "SimFleet":
        self.agents = SimFleet(self, spec, hosts)
        return self.agents

    # -- what the workers see -------------------------------------------------------------------

    def slowdown(self, rank: int) -> float:
        return self.slow.get(rank, 1.0)

    def starvation(self, rank: int) -> float:
        """How much longer `rank`'s compute takes because its thread waits for a CPU (a loaded
        host's scheduler running it less than its peers; its GPU is healthy)."""
        return self.starved.get(rank, 1.0)

    def noise(self) -> float:
        """A measured op time's spread around its true length (timers, caches, the OS): +-3%."""
        return 1.0 + 0.03 * (2 * self.rng.random() - 1)

    def runs(self, rank: int) -> bool:
        w = self.workers.get(rank)
        return w is not None and w.runs()

    def applied(self, worker: SimWorker, it: int) -> None:
        """A worker applied iteration `it`'s update: its state must hold every earlier one, once."""
        if worker.history != list(range(len(worker.history))):
            self.violations.append(f"t={self.now:.3f}: rank {worker.rank} applied iteration {it} onto a state "
                                   f"holding {worker.history[:-1][-5:]} (an update skipped or applied twice)")

    def restored(self, worker: SimWorker, iteration: int) -> None:
        if worker.history != list(range(iteration)):
            self.violations.append(f"t={self.now:.3f}: rank {worker.rank} restored a checkpoint of {iteration} steps "
                                   "that does not hold exactly iterations 0..{iteration - 1}")

    # -- processes and faults -------------------------------------------------------------------

    def start(self, rank: int) -> None:
        old = self.workers.get(rank)
        if old is not None and old.alive:
            return  # one process per rank, as LocalProcesses (a killed one here exits at once)
        startup = self.rng.uniform(*self.startup_s) + max(0.0, self.forkserver_down_until - self.now)
        self.workers[rank] = SimWorker(self, rank, startup)
        self.note(f"start rank {rank} (up in {startup:.2f} s)")

    def signal(self, ranks, name: str) -> list[int]:
        done = []
        for r in ranks:
            w = self.workers.get(r)
            if w is None or not w.alive:
                continue
            done.append(r)
            if name == "kill":
                w.exit(-9)
            elif name == "stop":
                if not w.stopped:
                    w.stopped, w.stopped_at = True, self.now
            elif name == "cont":
                if w.stopped:
                    w.stalled += self.now - w.stopped_at  # (what its stall clock sees: schedc.live.stall)
                w.stopped = False
        if done:
            self.note(f"{name} rank(s) {done}")
        return done

    def rename(self, epoch: int, renamed: dict[int, int]) -> None:
        """An in-place re-partition numbers the survivors' processes anew (as a host's agent does,
        `schedc.live.agent.Agent.rename`): exits seen before are reported under the old numbers;
        a process with no place must have ended (the supervisor ends those first)."""
        old_epoch = epoch - 1
        moved: dict[int, SimWorker] = {}
        for r, w in sorted(self.workers.items()):
            if not w.alive and not w.exit_reported:
                w.exit_reported = True
                self.job.event(Exited(rank=r, code=w.exit_code, host=0, t=self.time(), epoch=old_epoch))
            if r in renamed:
                moved[renamed[r]] = w
            elif w.alive:
                self.violations.append(f"t={self.now:.3f}: rank {r}'s process is still running, yet the "
                                       f"re-partition of epoch {epoch} gives it no place")
        self.workers = moved
        for faults in (self.slow, self.starved, self.link_delay):
            kept = {renamed[r]: v for r, v in faults.items() if r in renamed}
            faults.clear()
            faults.update(kept)
        for hook in self.on_rename:
            hook(renamed)
        self.note(f"epoch {epoch}: ranks renamed {sorted(renamed.items())}")

    def later(self, seconds: float, fn: Callable[[], None]) -> None:
        """Run `fn` `seconds` from now (a side thread's work: a checkpoint write)."""
        self._later.append((self.now + seconds, len(self._later), fn))

    def note(self, what: str) -> None:
        self.log.append((round(self.now, 4), what))

    def advance(self, dt: float) -> None:
        if self.pause_s:  # the whole machine stood still (load, a VM paused): nobody ran, nothing was seen
            self.note(f"pause of the whole machine for {self.pause_s:.2f} s")
            self.now += self.pause_s
            self.pause_s = 0.0
        self.now += dt
        for hook in self.on_step:
            hook()
        due = sorted(x for x in self._later if x[0] <= self.now)
        self._later = [x for x in self._later if x[0] > self.now]
        for _, _, fn in due:
            fn()
        self.net.advance(dt)
        for r in sorted(self.workers):
            self.workers[r].step()
        for r in sorted(self.workers):
            w = self.workers[r]
            # (a process beats under the epoch it follows: until it read the rename, under keys the
            # supervisor no longer reads)
            if w.alive and not w.stopped and w.beating and self.now >= w.next_beat and w.epoch == self.job.epoch:
                self.job.beat(w.rank, w.payload())
                w.next_beat = self.now + w.config.heartbeat_interval * (1 + self.beat_jitter * self.rng.random())
        for r in sorted(self.workers):
            w = self.workers[r]
            if not w.alive and not w.exit_reported:
                w.exit_reported = True
                if self.agents is None or self.agents.host_of(r) not in self.agents.agentless:  # (else: unseen)
                    self.job.event(Exited(rank=r, code=w.exit_code, host=0, t=self.time(), epoch=self.job.epoch))


class SimFleet:
    """`schedc.live.agent.Fleet` over simulated processes: `hosts` hosts (the spec's nodes spread
    over them as `schedc train --hosts` does), every agent in this process. Host 0 is the
    supervisor's; another can be lost (`lose`: its agent and processes are gone at once, and no
    exit is ever reported), after which its agent answers no more and nothing starts there."""

    def __init__(self, world: SimWorld, spec, hosts: int = 1):
        self.world = world
        nodes = max(1, -(-len(spec.gpus) // spec.cluster.gpus_per_node))
        self._gpu_host = {g.rank: spec.cluster.node_of(g.rank) * hosts // nodes for g in spec.gpus}
        self.physical: dict[int, int] = {}
        self.gone: set[int] = set()  # hosts lost (`lose`)
        self.agentless: set[int] = set()  # hosts whose agent alone died, their workers running on (`agent_dies`)
        self.back_at: dict[int, float] = {}  # host -> when its new agent registered (`restore`)
        self.lease = {h: f"sim agent {h}.0" if h else "" for h in range(hosts)}  # each host's agent now
        self.queued: dict[int, list[int]] = {}  # a lost host's commands: its next agent starts these
        self.up: set[int] = set()  # (no agent registers through the store, none leaves)
        self.leases = dict(self.lease)  # (what the supervisor was told: as if each agent had registered)
        self.retired: set[str] = set()
        self.left: set[int] = set()

    def wait_for_agents(self, timeout: float, note) -> None:
        pass

    def wait_left(self, alive: set[int], gone: set[int]) -> None:
        pass  # (every agent is in this process)

    def lose(self, host: int) -> list[int]:
        """Host `host` is gone with its agent: its processes die and no exit is reported."""
        self.gone.add(host)
        lost = sorted(r for r, w in self.world.workers.items() if w.alive and self.host_of(r) == host)
        for r in lost:
            w = self.world.workers[r]
            w.exit(-9)
            w.exit_reported = w.host_lost = True  # (nobody is left there to report it)
        self.world.note(f"host {host} lost with rank(s) {lost}")
        return lost

    def restore(self, host: int) -> None:
        """Host `host` is back (the instance returned): a new agent registers there, with no process."""
        self.gone.discard(host)
        self.back_at[host] = self.world.now
        self._register(host)
        self.world.note(f"host {host} is back: its agent registers")
        self.start(self.queued.pop(host, []))  # (the host's commands are the new agent's)

    def agent_dies(self, host: int) -> None:
        """Host `host`'s agent alone dies: its workers run on, but nobody reports their exits,
        carries out signals, or beats for the host (`answers` finds it gone); starts sent there
        wait in its queue until another agent takes the host over (`replace_agent`)."""
        self.agentless.add(host)
        self.world.note(f"host {host}'s agent dies; its workers run on")

    def replace_agent(self, host: int) -> list[int]:
        """Another agent took host `host`'s lease: the workers the old one started stop when they
        read the new lease (`membership.Heartbeat`: before their next beat and before they would
        join a generation, taken here to be at once), and no exit of theirs is ever reported; the
        new agent registers and carries out the host's queued starts. Returns their ranks."""
        old = sorted(r for r, w in self.world.workers.items() if w.alive and self.host_of(r) == host)
        for r in old:
            w = self.world.workers[r]
            w.exit(3)
            w.exit_reported = w.host_lost = True  # (lost with its agent: nobody reports it)
        self.back_at[host] = self.world.now
        self.agentless.discard(host)
        self.gone.discard(host)
        self._register(host)
        self.world.note(f"host {host}'s agent is replaced; its workers {old} stop by themselves")
        self.start(self.queued.pop(host, []))
        return old

    def _register(self, host: int) -> None:
        """A new agent of `host` takes its lease and registers."""
        self.lease[host] = f"sim agent {host}.{int(self.lease[host].rsplit('.', 1)[1]) + 1}"
        self.world.job.event(AgentUp(host=host, pid=200000 + host, t=self.world.time(), agent=self.lease[host]))

    def started(self, rank: int, epoch: int) -> Started:
        """What the worker of `rank` says once it runs (started by its host's agent now)."""
        host = self.host_of(rank)
        return Started(rank, 100000 + rank, host, agent=self.lease[host], epoch=epoch)

    def gpus_of(self, host: int) -> list[int]:
        """The job's GPUs (ranks of its spec) on `host`."""
        return sorted(g for g, h in self._gpu_host.items() if h == host)

    def by_host(self, ranks) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r in sorted(ranks):
            out.setdefault(self.host_of(r), []).append(r)
        return out

    def place(self, physical: dict[int, int]) -> None:
        self.physical = {r: p for r, p in physical.items() if r != p}

    def host_of(self, rank: int) -> int:
        return self.host_of_gpu(self.physical.get(rank, rank))

    def host_of_gpu(self, gpu: int) -> int:
        return self._gpu_host.get(gpu, 0)

    def rename(self, epoch: int, renamed: dict[int, int]) -> None:
        self.world.rename(epoch, renamed)

    def answers(self, hosts, within: float, note) -> set[int]:
        """The real one waits up to `within` for two beats of each agent: a lost one costs that."""
        hosts, silent = set(hosts), self.gone | self.agentless
        if hosts & silent:
            self.world.advance(within)
        for h in sorted(hosts & silent):
            note(h)
        return hosts - silent

    def back(self, hosts) -> set[int]:
        return set()  # (a lost host comes back only by registering anew: `restore`)

    def step(self, timeout: float) -> None:
        self.world.advance(max(timeout, QUANTUM))

    def start(self, ranks) -> None:
        for r in ranks:
            if self.host_of(r) in self.gone | self.agentless:
                self.world.note(f"start of rank {r} on host {self.host_of(r)}, with no agent: queued there, unread")
                self.queued.setdefault(self.host_of(r), []).append(r)
                continue
            self.world.job.forget_heartbeat(r)
            self.world.start(r)

    def signal(self, ranks, name: str) -> None:
        self.world.signal([r for r in ranks if self.host_of(r) not in self.gone | self.agentless], name)

    def fire(self, injection: int, ranks) -> None:
        pass

    def stop(self, grace: float) -> None:
        for w in self.world.workers.values():
            w.exit(0 if w.runs() else -9)
