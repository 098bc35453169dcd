"""Agents: one per host; they start, signal and watch the rank workers of that host.

As torchrun's elastic agent does for its local workers, an agent owns the
processes of its host and reports their deaths at once (it waits on each
process's own pidfd, so an exit is seen within milliseconds, and only a
worker's own end counts: a killed forkserver is no worker's death, and is
replaced, said in one line on stderr, the next time a worker starts). Unlike
torchrun it never restarts the survivors: the supervisor decides, and the
survivors reconfigure in place. Everything an agent learns or is told goes
through the job's store (`schedc.live.membership`):

* commands on ``agent/H/cmd``: `StartRanks`, `SignalRanks`, `FireInjection`
  (an injection a worker reached: signal its targets now), `StopAgent` (end
  every worker, then the agent);
* events on ``events``: `AgentUp` (registered), `Exited` (rank, status),
  `Injected` (which injection, ranks, signal, time);
* beats on ``agent/H/beats`` (a count, every AGENT_BEAT seconds, from a
  thread of its own, so an agent busy starting a process still beats): an
  agent that stops beating is gone with its host (or paused with it), and
  the supervisor starts no process there (`Fleet.answers`).

(The messages are those of `schedc.live.protocol`.)

The supervisor's host runs its agent inside the supervisor process
(`Agent.step` from the supervisor's loop); every other host runs
``schedc agent --store HOST:PORT --host H`` (`serve`). Workers are started
through `schedc.runtime.processes.LocalProcesses`, as `schedc run` starts
its ranks.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid

from schedc.diagnostics import RunError, error
from schedc.live.inject import Injection
from schedc.live.membership import JobStore
from schedc.live.protocol import (AgentLeft, AgentUp, Exited, FireInjection, Injected, ProtocolError, RenameRanks,
                                  SignalRanks, StartRanks, StopAgent)
from schedc.runtime.processes import LocalProcesses, StartError

#: Seconds between an agent's beats (`JobStore.agent_beat`): the supervisor asks for two more
#: beats before it counts on a host to start a replacement process (`Fleet.answers`).
AGENT_BEAT = 0.1

#: Seconds a host's agent may go without a beat before another agent given the same host takes
#: it over (`Agent.claim`); one that still beats keeps the host, and the second is refused. Beats
#: came 3.4 s apart on a loaded machine (before they had a thread of their own): well above that,
#: well below a human's restart.
LEASE_STALE = 5.0
#: Seconds the supervisor keeps its store up at the end for a remote agent to say it left, and for
#: one that still beats (busy: a worker start waits up to 120 s for a new forkserver's first
#: answer), at most: an agent whose store goes before it saw the stop reports a lost supervisor.
LEAVE_WAIT, LEAVE_WAIT_BUSY = 5.0, 150.0


class Agent:
    """The workers of one host (see the module docstring)."""

    def __init__(self, job: JobStore, host: int):
        self.job = job
        self.host = host
        # (its forkserver starts with the first worker; a new one if it ended, said on stderr)
        self.local = LocalProcesses(say=lambda text: print(f"host {host}: {text}", file=sys.stderr, flush=True))
        self._fired: set[int] = set()
        self._injections: dict[int, Injection] | None = None
        self.stopping = False
        self.token: str | None = None  # this host's lease, once `claim` took it (`schedc agent` only)
        # The epoch its ranks are numbered in (`RenameRanks`): the newest one, for an agent started
        # mid-run (restarted, or for a host found gone): the ranks it starts are numbered in that one.
        self.epoch = job.epoch_now()

    def register(self) -> None:
        self.job.event(AgentUp(host=self.host, pid=os.getpid(), t=time.time(), agent=self.token or ""))

    # -- processes -------------------------------------------------------------------

    def start(self, ranks) -> None:
        from schedc.live.member import worker_main

        for rank in ranks:
            try:
                self.local.start(rank, worker_main, (self.job.host, self.job.port, rank, self.host, self.token or ""),
                                 f"schedc-train-rank-{rank}")
            except StartError as exc:
                raise RunError([error("E564", f"host {self.host}: {exc}",
                                      hint="something ends the worker forkserver (a process killer, a memory "
                                           "limit: see `dmesg`); rerun once it is stopped, with --resume if "
                                           "checkpoints were written")]) from None

    def signal(self, ranks, name: str) -> list[int]:
        """Send a signal to the live workers of `ranks` on this host; returns the ranks signalled."""
        return self.local.signal(ranks, name)

    def alive(self) -> list[int]:
        return self.local.alive()

    def rename(self, epoch: int, renamed: dict[int, int]) -> None:
        """Epoch `epoch`: its processes are numbered anew (exits seen before are reported first,
        under the numbers they had)."""
        for rank, code in self.local.exits():
            self.job.event(Exited(rank=rank, code=code, host=self.host, t=time.time(), epoch=self.epoch))
        if epoch <= self.epoch:  # (queued before this agent started: its ranks are numbered in a newer one)
            return
        self.local.rename(renamed)
        self.epoch = epoch

    # -- the loop ------------------------------------------------------------------------

    def step(self, timeout: float) -> None:
        """Wait up to `timeout` for a worker to exit; report exits; carry out commands."""
        self.local.wait(timeout)
        for cmd in self.job.commands(self.host):
            self._command(cmd)
        for rank, code in self.local.exits():
            self.job.event(Exited(rank=rank, code=code, host=self.host, t=time.time(), epoch=self.epoch))

    def _command(self, cmd) -> None:
        if isinstance(cmd, StartRanks):
            self.start(cmd.ranks)
        elif isinstance(cmd, SignalRanks):
            self.signal(cmd.ranks, cmd.signal)
        elif isinstance(cmd, RenameRanks):
            self.rename(cmd.epoch, dict(zip(cmd.old, cmd.new)))
        elif isinstance(cmd, FireInjection):
            self._inject(cmd)
        elif isinstance(cmd, StopAgent):
            self.stopping = True

    def _inject(self, cmd: FireInjection) -> None:
        """A worker reached an injection's moment (or the supervisor's clock did): signal its targets."""
        if cmd.id in self._fired:
            return
        inj = self.injections().get(cmd.id)
        if inj is None:
            return
        self._fired.add(cmd.id)
        done = self.signal(inj.ranks if cmd.ranks is None else cmd.ranks, inj.action)
        self.job.event(Injected(id=cmd.id, ranks=tuple(done), signal=inj.signal_name, host=self.host, t=time.time(),
                                by=cmd.rank, iteration=cmd.iteration))

    def injections(self) -> dict[int, Injection]:
        if self._injections is None:
            self._injections = {j["index"]: Injection.from_json(j) for j in self.job.config().injections}
        return self._injections

    def stop_all(self, grace: float = 2.0) -> None:
        """End every worker this agent started: they exit by themselves once the run is stopped;
        those that have not after `grace` seconds (stopped, stuck) are killed. Waits for all."""
        self.local.stop_all(grace)

    def serve(self, poll: float = 0.005) -> None:
        """Run as a host's agent process until the supervisor stops the run. Its forkserver is
        warmed before it registers: the supervisor starts the workers once every agent has, and
        judges their start-up against host 0's, which fork from a warm one.

        Never ends silently: a run that stopped is said so to the supervisor (`AgentLeft`); a
        store that goes away before the run said stop (the supervisor's process or host is gone),
        another agent that took this host over, or a second agent given the same `--host`, is a
        `RunError` (E557), once this host's workers are stopped."""
        self.local.warm()
        checked = 0.0
        taken_by = store_lost = None  # why this agent ends before the run said stop
        saw_stop = False
        halt = threading.Event()
        try:
            self.claim()
            self._beat_until(halt)
            self.register()
            while not self.stopping and not self.job.stopped():
                self._turned = time.monotonic()
                if time.monotonic() - checked >= AGENT_BEAT:
                    checked = time.monotonic()
                    holder = self.job.agent_lease(self.host)
                    if holder != self.token:
                        taken_by = holder
                        break
                self.step(poll)
            else:
                saw_stop = True
        except ProtocolError:
            raise  # (another version of schedc on the other end: not a lost store)
        except RuntimeError as exc:  # torch's store errors: the store is gone before the run said stop
            store_lost = _first_line(exc)
        finally:
            try:
                n = len(self.alive())
                self.stop_all()
                if taken_by is None:  # (once taken over, the host's commands and exits are the new agent's)
                    try:
                        self.step(0)  # report the last exits
                        if saw_stop:
                            self.job.event(AgentLeft(host=self.host, t=time.time()))
                    except RuntimeError:
                        pass
            finally:
                halt.set()  # (it beat while it stopped its workers: the supervisor waits for its AgentLeft)
        if taken_by is not None:
            raise RunError([error("E557", f"host {self.host}: another agent ({_who(taken_by)}) took this host over, "
                                          f"as this one did not beat for {LEASE_STALE:g} s; this one stopped its "
                                          f"{n} worker(s)",
                                  hint="run one `schedc agent` per host; an agent that is paused (SIGSTOP, a "
                                       "swapped-out machine) loses its host to the next one started")])
        if store_lost is not None:
            raise RunError([error("E557", f"host {self.host}: lost the run's store at {self.job.host}:{self.job.port} "
                                          f"before the run said stop ({store_lost}); stopped this host's {n} worker(s)",
                                  hint="the supervisor (`schedc train`) ended or its host is gone: see its output; "
                                       "rerun with --resume if checkpoints were written")])

    def _beat_until(self, halt: threading.Event) -> None:
        """Beat every AGENT_BEAT seconds from a thread of its own (its own store connection) until
        `halt`: an agent busy starting a process (a new forkserver's torch import takes seconds)
        still answers `Fleet.answers`, so its host is not taken for gone; one that is paused, or
        died, does not beat, nor one whose loop has not turned for LEAVE_WAIT_BUSY seconds (longer
        than any start waits: it is wedged)."""
        job = self.job.clone()
        self._turned = time.monotonic()

        def run() -> None:
            while not halt.is_set():
                if time.monotonic() - self._turned < LEAVE_WAIT_BUSY:
                    try:
                        job.agent_beat(self.host)
                    except Exception:  # (a store that is gone: the agent's loop finds that out and says so)
                        pass
                halt.wait(AGENT_BEAT)

        threading.Thread(target=run, name=f"schedc-agent-{self.host}-beat", daemon=True).start()

    def claim(self) -> None:
        """Take this host's lease (``agent/H/lease``): one agent per host. A holder that still beats
        keeps it (the second agent is refused, E557: two agents of one host would share its command
        queue); one silent for `LEASE_STALE` seconds (it died, or its host did) is taken over."""
        self.token = f"pid {os.getpid()} on {socket.gethostname()} #{uuid.uuid4().hex[:8]}"
        holder = self.job.claim_agent(self.host, "", self.token)
        if holder == self.token:
            return
        seen = self.job.agent_beats(self.host)
        deadline = time.monotonic() + LEASE_STALE
        while time.monotonic() < deadline:
            if self.job.agent_beats(self.host) >= seen + 2:
                raise RunError([error("E557", f"host {self.host} already has an agent ({_who(holder)}), and it runs",
                                      hint="give each host its own --host H; stop the other agent first to "
                                           "replace it")])
            time.sleep(AGENT_BEAT / 4)
        taken = self.job.claim_agent(self.host, holder, self.token)
        if taken != self.token:
            raise RunError([error("E557", f"host {self.host}: another agent ({_who(taken)}) took this host first",
                                  hint="give each host its own --host H")])
        print(f"host {self.host}: took over from an agent that stopped beating ({_who(holder)})",
              file=sys.stderr, flush=True)


def _who(token: str) -> str:
    """A lease's holder as said to a user: its pid and host name (the nonce left out)."""
    return token.split(" #")[0]


def _first_line(exc: BaseException) -> str:
    """An exception's first line (torch's store errors carry C++ stacks after it)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class Fleet:
    """The supervisor's handle on every host's agent: host 0's runs inside the supervisor's
    process (`step` drives it); every other host's gets commands through the store."""

    def __init__(self, job: JobStore, spec, hosts: int):
        self.job = job
        self.hosts = hosts
        world = spec.dp * spec.pp
        nodes = -(-world // spec.cluster.gpus_per_node)
        if hosts > nodes:  # (each host runs whole nodes: a host past the last would wait for an agent in vain)
            raise RunError([error("E555", f"--hosts {hosts} is more than the job's {nodes} node(s) ({world} GPUs, "
                                          f"gpus_per_node = {spec.cluster.gpus_per_node}): each host runs whole nodes",
                                  hint=f"give --hosts from 1 to {nodes}")])
        # The host of each of the job's GPUs (a rank of the spec's plan); a re-partitioned layout's
        # rank r runs on GPU `physical[r]` (`place`), hence on that GPU's host.
        self.gpu_host = {r: spec.cluster.node_of(r) * hosts // nodes for r in range(world)}
        self.physical: dict[int, int] = {}
        self._gone_at: dict[int, int] = {}  # host found gone -> its agent's beat count then (`back`)
        self.left: set[int] = set()  # hosts whose agent said it saw the run's stop (`AgentLeft`)
        self.up: set[int] = set()  # other hosts whose agent registered (`AgentUp`)
        self.leases: dict[int, str] = {}  # ... and the lease their newest agent holds
        self.retired: set[str] = set()  # leases of agents replaced since (`schedc.live.hosts`)
        self.local = Agent(job, 0)
        self.local.register()

    def rename(self, epoch: int, renamed: dict[int, int]) -> None:
        """Every host's agent numbers its processes anew (`Agent.rename`): host 0's now, the
        others at their next step (their exits say which epoch they are numbered in)."""
        self.local.rename(epoch, renamed)
        old, new = tuple(renamed), tuple(renamed.values())
        for host in range(1, self.hosts):
            self.job.command(host, RenameRanks(epoch, old, new))

    def place(self, physical: dict[int, int]) -> None:
        """The running layout's rank -> the job's GPU it runs on (after a re-partition or a growth):
        a rank's process is started, signalled and watched by the agent of that GPU's host."""
        self.physical = {r: p for r, p in physical.items() if r != p}

    def host_of(self, rank: int) -> int:
        return self.host_of_gpu(self.physical.get(rank, rank))

    def host_of_gpu(self, gpu: int) -> int:
        """The host of the job's GPU `gpu` (a rank of the job's spec)."""
        return self.gpu_host[gpu]

    def wait_for_agents(self, timeout: float, note) -> None:
        """Until every other host's agent has registered; E557 after `timeout` seconds."""
        want = set(range(1, self.hosts))
        if not want:
            return
        job = self.job
        hosts = ", ".join(map(str, sorted(want)))
        note("agents", f"waiting for {len(want)} agent(s): on each other host run "
                       f"`schedc agent --store {job.host}:{job.port} --host H` (H = {hosts})")
        deadline = time.monotonic() + timeout
        while want and time.monotonic() < deadline:
            up = {ev.host: ev.agent for ev in job.events() if isinstance(ev, AgentUp)}
            self.up |= set(up)
            self.leases.update(up)
            want -= set(up)
            time.sleep(0.01)
        if want:
            raise RunError([error("E557", f"agents of host(s) {sorted(want)} did not register within {timeout:g} s",
                                  hint=f"start them with `schedc agent --store {job.host}:{job.port} --host H`, "
                                       "or run with fewer --hosts")])

    def answers(self, hosts, within: float, note) -> set[int]:
        """Those of `hosts` whose agent beats twice within `within` seconds (host 0's, in this
        process, always does): a host whose agent stopped beating is gone with its GPUs (a spot instance
        taken back, a dead node), and no process can be started there. `note(host)` is called
        once per host found gone."""
        # Two beats past the count read now: a beat the agent sent just before it died may reach the
        # store after this read (a store that serves many clients is slow under load), never two
        # (an agent waits for the store's answer to each beat before it sends the next).
        remote = {h: self.job.agent_beats(h) for h in hosts if h != 0}
        deadline = time.monotonic() + within
        answered = {h for h in hosts if h == 0}
        while remote:
            for h, count in list(remote.items()):
                if self.job.agent_beats(h) >= count + 2:
                    answered.add(h)
                    del remote[h]
            if not remote or time.monotonic() >= deadline:
                break
            time.sleep(AGENT_BEAT / 4)
        for h in sorted(remote):
            self._gone_at[h] = remote[h]
            note(h)
        return answered

    def back(self, hosts) -> set[int]:
        """Those of `hosts` (found gone by `answers`) whose agent beat twice since: its machine was
        paused or starved of a CPU, not gone."""
        return {h for h in hosts if h in self._gone_at and self.job.agent_beats(h) >= self._gone_at[h] + 2}

    def by_host(self, ranks) -> dict[int, list[int]]:
        by_host: dict[int, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.host_of(r), []).append(r)
        return dict(sorted(by_host.items()))

    def step(self, timeout: float) -> None:
        """Host 0's agent: wait up to `timeout` for an exit, carry out its commands, report exits."""
        self.local.step(timeout)

    def start(self, ranks) -> None:
        for r in ranks:
            self.job.forget_heartbeat(r)  # a replacement must not inherit its predecessor's last beat
        for host, rs in self.by_host(ranks).items():
            if host == 0:
                self.local.start(rs)
            else:
                self.job.command(host, StartRanks(tuple(rs)))

    def signal(self, ranks, name: str) -> None:
        for host, rs in self.by_host(ranks).items():
            if host == 0:
                self.local.signal(rs, name)
            else:
                self.job.command(host, SignalRanks(tuple(rs), name))

    def fire(self, injection: int, ranks) -> None:
        """Carry out injection `injection` now, on the hosts of `ranks`."""
        for host in self.by_host(ranks):
            self.job.command(host, FireInjection(injection, ranks=tuple(ranks)))

    def wait_left(self, alive: set[int], gone: set[int], within: float = LEAVE_WAIT,
                  busy: float = LEAVE_WAIT_BUSY) -> None:
        """After the run's stop: until every rank of `alive` has exited (each is discarded from it)
        and each other host's agent that registered and is not in `gone` has said it left
        (`AgentLeft`: it saw the stop, so the store may go), for at most `within` seconds, or
        `busy` while such an agent still beats (it is busy, e.g. starting a process, and sees
        the stop once done)."""
        waiting = self.up - {0} - set(gone) - self.left  # (host 0's agent is this process's)
        start = time.monotonic()
        beats = {h: -1 for h in waiting}
        beat_at = start
        while alive or waiting:
            now = time.monotonic()
            try:
                if now - start >= within:
                    counts = {h: self.job.agent_beats(h) for h in waiting}
                    if any(counts[h] > beats[h] for h in waiting):
                        beats, beat_at = counts, now
                    if not waiting or now - beat_at > 1.0 or now - start >= busy:
                        break
                for ev in self.job.events():
                    if isinstance(ev, Exited):
                        alive.discard(ev.rank)
                    elif isinstance(ev, AgentLeft):
                        self.left.add(ev.host)
                        waiting.discard(ev.host)
                self.step(0.05)
            except Exception:  # (the store is gone: nobody is left to wait for)
                break

    def stop(self, grace: float) -> None:
        """Every other host's agent is told to stop; host 0's workers end (killed after `grace`)."""
        try:
            for host in range(1, self.hosts):
                self.job.command(host, StopAgent())
        except Exception:  # the store is gone: the remote agents stop by themselves
            pass
        self.local.stop_all(grace=grace)
