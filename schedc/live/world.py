"""What a supervisor runs against: a clock, the job's store, and the processes of every host.

`Supervisor` never reads the time, opens a store or starts a process itself:
it asks its `World`. `LocalWorld` is the real one (the wall clock, a c10d
TCP store served by this process, agents that fork worker processes). The
deterministic simulation (`schedc.live.simulation`) hands the same
supervisor a world of its own: a fake clock that moves only when the
supervisor waits, an in-memory store, and simulated workers, so that a run
with any schedule of faults replays exactly from a seed.

Time passes for the supervisor in one place only, `Fleet.step(timeout)`
(wait up to `timeout` for something to happen); everything else it does is
instantaneous on the world's clock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from schedc.live.agent import Fleet
    from schedc.live.membership import JobStore


class World(Protocol):
    def time(self) -> float:
        """Seconds since the epoch, on this world's clock."""

    def serve(self, host: str, port: int) -> "JobStore":
        """The job's store, served by the supervisor."""

    def fleet(self, job: "JobStore", spec, hosts: int) -> "Fleet":
        """The handle on every host's agent (`schedc.live.agent.Fleet`)."""


class LocalWorld:
    """The real world: wall clock, a TCP store on this machine, worker processes.

    Its clock is the wall clock read once, advanced by the monotonic clock: epoch seconds, as the
    workers' reports carry, but a step of the system clock (NTP, an operator) neither delays nor
    hastens the supervisor's bounds (a step back of a minute would else hide a dead rank for a
    minute more)."""

    def __init__(self) -> None:
        self._wall0, self._mono0 = time.time(), time.monotonic()

    def time(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0)

    def serve(self, host: str, port: int) -> "JobStore":
        from schedc.live.membership import JobStore

        return JobStore.serve(host, port)

    def fleet(self, job: "JobStore", spec, hosts: int) -> "Fleet":
        from schedc.live.agent import Fleet

        return Fleet(job, spec, hosts)
