"""Deterministic simulation of a live run: the real supervisor against simulated processes.

`Supervisor` (and its policies, detector, ledger, checkpoints) runs unchanged
in one process; what it talks to is simulated (`schedc.live.world`):

- `schedc.live.sim.store`: the job's store in memory, its queues delivering
  after a seeded delay;
- `schedc.live.sim.worker`: a rank's process as a coroutine that follows the
  worker protocol of `schedc.live.member` (join, connect, agree where to
  resume, iterate, abort, leave at a planned switch, catch up, checkpoint),
  with pipeline iterations and collectives modelled by `Network`;
- `schedc.live.sim.world`: the fake clock, the fleet of simulated processes
  and the faults applied to them (kills, stops, hangs, slowdowns, pauses of
  the whole machine, a forkserver that must be restarted);
- `schedc.live.sim.run`: seeded fault schedules, the invariants checked at
  every step, `simulate(seed)`, and ``python -m schedc.live.sim`` for long
  campaigns.

Time moves only when the supervisor waits (`Fleet.step`), so a run is a pure
function of its seed: every failure replays from it.
"""
