"""The processes of a live run, host by host: a part of `schedc.live.supervisor.Supervisor`.

`Supervisor` inherits these from `Hosts`, which holds no state of its own: starting and
signalling workers through the hosts' agents (`schedc.live.agent.Fleet`), what each agent says
(a process started, an agent registered), fencing ranks declared failed (SIGKILL, their exits
awaited), and telling a host that is gone from one that is busy. The state they use is the
supervisor's (its `__init__` lists it).

A host's processes are watched through its agent alone. So an agent that registers while the
run goes on (the host came back from a reboot, or its agent was restarted) means the processes
its old agent ran are out of reach: gone with the host, or ending by themselves
(`membership.Heartbeat` stops a worker whose host's lease another agent holds). Each worker says
which agent started it (`Started.agent`, that agent's lease), so those of an old agent are
declared lost at once, not left looking alive until their silence is found: a kill would reach
nobody, and a rejoin would catch up a process that is not there. A process started there that
has not said so yet may be the old agent's (lost, or ending by itself) or the new one's (which
carries out the host's queued commands): it is started again, which the new agent does only if
it runs none for that rank.
"""

from __future__ import annotations

from typing import Sequence

from schedc.live.protocol import AgentUp, Phase, Started

#: Seconds between two turns of a wait inside a transition (an exit wakes it at once).
TICK = 0.005
#: Seconds to wait for the exit of a fenced (SIGKILLed) rank before the survivors go on: a local
#: kill is seen in milliseconds; this bounds a remote host whose agent does not answer.
FENCE_WAIT = 5.0
#: Seconds another host's agent has to beat once more (it beats every `agent.AGENT_BEAT`) before
#: its host counts as gone, when a replacement process would be started there.
AGENT_ANSWER = 1.0


class Hosts:
    """Workers on the hosts of a `Supervisor` (see the module docstring)."""

    def _start_workers(self, ranks) -> None:
        self.fleet.start(ranks)
        self.alive.update(ranks)
        for r in ranks:
            self._started_by.pop(r, None)  # (until the new process says it runs: `_on_started`)

    def _signal(self, ranks, name: str) -> None:
        self.fleet.signal(ranks, name)

    # -- what agents and workers say ----------------------------------------------------------------

    def _on_started(self, msg: Started, now: float) -> None:
        """Logged (not printed): which host runs each rank's process, and its pid."""
        rank = msg.rank if msg.epoch == self.epoch else self._current_rank(msg.rank, msg.epoch)
        # (a process of an agent replaced since says so late: it stops by itself, and is not the rank's;
        # one of a new agent may say so before the agent's registration is read: another queue)
        if rank is not None and rank in self.alive and msg.agent not in self.fleet.retired:
            self._started_by[rank] = msg.agent
        self._note("started", f"rank {msg.rank} runs on host {msg.host} (pid {msg.pid})", quiet=True,
                   rank=msg.rank, host=msg.host, pid=msg.pid, gpu=self.physical.get(msg.rank, msg.rank))

    def _on_agent_up(self, msg: AgentUp, now: float) -> None:
        """An agent registered: every other host's first before any worker starts, or a new one
        of a host whose agent died, whose old processes are lost (the module docstring)."""
        self.fleet.up.add(msg.host)
        old = self.fleet.leases.get(msg.host)
        if old not in (None, msg.agent):
            self.fleet.retired.add(old)
        self.fleet.leases[msg.host] = msg.agent
        self.fleet.left.discard(msg.host)  # (an agent started anew: it has yet to see the stop)
        if msg.host in self.hosts_gone:  # (an agent registered again for a host found gone)
            self.hosts_gone.discard(msg.host)
            self._note("host", f"host {msg.host}'s agent is back: processes can be started there again",
                       host=msg.host)
        if msg.host == 0:
            return  # (host 0's agent runs in this process: it never registers anew)
        here = [r for r in sorted(self.alive) if self.fleet.host_of(r) == msg.host]
        unsaid = [r for r in here if r not in self._started_by]
        if unsaid and self.phase not in (Phase.FINISHING, Phase.DONE):
            self.fleet.start(unsaid)  # (the new agent starts those it does not run already)
        lost = [r for r in here if self._started_by.get(r, msg.agent) != msg.agent]
        if not lost:
            return
        self.alive -= set(lost)
        self._note("host", f"host {msg.host} has a new agent (pid {msg.pid}): the process(es) of rank(s) {lost} "
                           "that its old agent ran are lost with it", host=msg.host, ranks=lost)
        if self.phase in (Phase.FINISHING, Phase.DONE):
            return
        watched = self.detector.watching()
        for r in lost:
            if r in watched:
                s = self.detector.lost(r, f"its process is lost with host {msg.host}'s old agent", now,
                                       out_of_reach=f"its process was lost with host {msg.host}'s old agent")
                if s:
                    self._suspect(s)
            else:  # (fenced already, or a standby process)
                self.rejoins.lost(r)
                self.slowness.lost(r)

    # -- fencing --------------------------------------------------------------------------------------

    def _fence(self, ranks: Sequence[int]) -> None:
        """Ranks declared failed while their processes may still run (silent, stuck) are killed
        for sure before the survivors move on: their exits are awaited (FENCE_WAIT at most; a
        process that outlives a SIGKILL that long is on a host that does not answer: said so; one
        whose host is gone is gone with it, so a rejoin does not wait for it to catch up)."""
        unseen = self._kill_and_wait(ranks, FENCE_WAIT) if ranks else set()
        gone = {r: h for h, rs in self._unreachable(unseen).items() for r in rs} if unseen else {}
        self.alive -= set(gone)
        for r in sorted(unseen):
            why = f": its host {gone[r]} is gone" if r in gone else ""
            self._note("warning", f"warning: rank {r}'s process was killed but its exit is not seen after "
                                  f"{FENCE_WAIT:g} s{why}: going on without it")

    def _kill_and_wait(self, ranks: Sequence[int], seconds: float = 10.0) -> set[int]:
        """SIGKILL `ranks`' processes and wait (`seconds` at most) until their exits are seen;
        those exits are expected (the ranks are no longer watched), not failures. Returns the
        ranks whose exit was not seen."""
        for r in ranks:
            self.detector.forget(r)
        self._signal(ranks, "kill")
        deadline = self._now() + seconds
        while self.alive & set(ranks) and self._now() < deadline:
            self.fleet.step(TICK)
            for ev in self.job.events():
                self._dispatch(ev, self._now())
        return self.alive & set(ranks)

    # -- hosts gone, and back -------------------------------------------------------------------------

    def _unreachable(self, ranks) -> dict[int, list[int]]:
        """The hosts of `ranks` that are gone, with their ranks: a host found gone once stays so
        until its agent registers again; any other asks its agent for two more beats
        (`Fleet.answers`, AGENT_ANSWER seconds at most)."""
        by_host = self.fleet.by_host(ranks)
        self._ask_hosts(by_host)
        return {h: rs for h, rs in by_host.items() if h in self.hosts_gone}

    def _ask_hosts(self, hosts) -> None:
        """Ask the agents of `hosts` not known gone for two more beats; those that do not beat
        within AGENT_ANSWER seconds join `hosts_gone` (said once each)."""
        def gone(host: int) -> None:
            self.hosts_gone.add(host)
            self._note("host", f"host {host} is gone: its agent has not answered for {AGENT_ANSWER:g} s, so no "
                               "process can be started on its GPUs", host=host)

        hosts = set(hosts)
        for h in sorted(self.fleet.back(self.hosts_gone & hosts)):
            self.hosts_gone.discard(h)
            self._note("host", f"host {h} answers again: its agent beats (paused or starved of a CPU, not gone)",
                       host=h)
        self.fleet.answers([h for h in sorted(hosts) if h not in self.hosts_gone], AGENT_ANSWER, gone)
