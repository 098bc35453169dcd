"""The seam between the supervisor and its policies (fail-slow, rejoin, recovery).

A policy decides; the supervisor carries out. A policy sees the run only
through a `Controller`: a few read-only facts (phase, plans, members,
iterations completed) and a few requests (say something, plan a change,
switch to a plan at an iteration boundary, start or direct a worker). It
never holds the supervisor, so it is tested alone against a fake controller
(tests/test_live_policies.py), and it imports nothing of the supervisor.
`SupervisorControl` is the controller a `Supervisor` hands its policies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from schedc.live.protocol import Phase
    from schedc.plan import Plan
    from schedc.spec import Failure


class Controller(Protocol):
    """What a policy may see of a live run and ask of it."""

    # -- what it sees -----------------------------------------------------------------------

    @property
    def phase(self) -> "Phase":
        """Where the run is (`schedc.live.protocol.Phase`)."""

    @property
    def plan(self) -> "Plan":
        """The plan of the newest announced generation."""

    @property
    def base_plan(self) -> "Plan":
        """The plan of the last generation that became ready (what runs now): changes are planned from it."""

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of the newest generation that have not failed."""

    @property
    def completed(self) -> int:
        """The next iteration the run completes as it goes now (`Ledger.now`: after a rollback to
        an older checkpoint, behind the furthest iteration ever done until the run passes it)."""

    def is_running(self, rank: int) -> bool:
        """Whether a worker process runs for `rank` (started, its exit not seen)."""

    def now(self) -> float:
        """Seconds since the run started, on the run's clock."""

    def unreachable(self, ranks: Sequence[int]) -> dict[int, list[int]]:
        """The hosts of `ranks` that are gone (their agent no longer answers), each with its ranks
        among `ranks`: no process can be started for those (may wait up to a second to ask)."""

    def physical(self) -> dict[int, int]:
        """Each rank of the newest plan -> the job's GPU that runs it, named as the job's spec
        names its GPUs (the identity until a re-partition renumbers them; a hole of a
        re-partitioned layout, a slot no GPU runs, has none)."""

    def gpu_name(self, rank: int) -> str:
        """How a message names the GPU that runs `rank` of the newest plan: "GPU (dp=D, pp=S)", its
        place there; after a re-partition "GPU (dp=D, pp=S) of the job", as the job named it (the
        layout's own dp and pp would name another of the job's GPUs)."""

    def spares(self) -> list[int]:
        """The job's GPUs (named as its spec names them) that are healthy and unused: left out of
        the running layout by a re-partition, or back since, and on a host whose agent answers
        (asked as `unreachable` asks: may wait up to a second)."""

    # -- what it asks -----------------------------------------------------------------------

    def note(self, kind: str, message: str, **details) -> None:
        """Print `message` and log it as an event of `kind` with `details`."""

    def replan(self, base: "Plan", events: Sequence["Failure"], solver: str | None = None) -> "Plan":
        """`schedc.replan` of `base` under the run's deadline, with `solver` or the run's
        (raises `SchedcError`)."""

    def switch(self, plan: "Plan", *, kind: str, reason: str, ranks: Sequence[int]) -> str | None:
        """Announce a planned switch to `plan` at an iteration boundary a little ahead;
        None, or why it was not made."""

    def revive(self, rank: int) -> str | None:
        """Start a worker for `rank` if none runs (it waits on standby until a plan names it);
        None, or why none can be started (its GPU's host is gone: its agent does not answer)."""

    def direct(self, rank: int, directive: dict | None) -> None:
        """Give `rank` a catch-up role (``{"role": "donate"|"join", "session", ...}``), or none."""

    # -- the other policies ---------------------------------------------------------------------

    def request_rejoin(self, rank: int, reason: str) -> None:
        """Ask the rejoin policy to take `rank` back."""

    def rejoin_wanted(self, rank: int) -> bool:
        """Whether the rejoin policy is bringing `rank` back now."""


class SupervisorControl:
    """The `Controller` over a `schedc.live.supervisor.Supervisor`: what its policies get
    instead of the supervisor itself (forwarding only; the supervisor is not imported)."""

    def __init__(self, sup):
        self._sup = sup

    @property
    def phase(self) -> "Phase":
        return self._sup.phase

    @property
    def plan(self) -> "Plan":
        return self._sup.plan

    @property
    def base_plan(self) -> "Plan":
        return self._sup.base_plan

    @property
    def members(self) -> tuple[int, ...]:
        sup = self._sup
        return () if sup.gen is None else tuple(r for r in sup.gen.members if r not in sup.dead)

    @property
    def completed(self) -> int:
        return self._sup.ledger.now

    def is_running(self, rank: int) -> bool:
        return rank in self._sup.alive

    def now(self) -> float:
        return self._sup._now()

    def unreachable(self, ranks: Sequence[int]) -> dict[int, list[int]]:
        return self._sup._unreachable(ranks)

    def physical(self) -> dict[int, int]:
        sup = self._sup
        return {g.rank: sup.physical[g.rank] for g in sup.plan.spec.gpus if g.rank in sup.physical}

    def gpu_name(self, rank: int) -> str:
        return self._sup._gpu_name(rank)

    def spares(self) -> list[int]:
        sup = self._sup
        if sup.spare:
            sup._ask_hosts(sup.fleet.host_of_gpu(p) for p in sup.spare)
        return sorted(p for p in sup.spare if sup.fleet.host_of_gpu(p) not in sup.hosts_gone)

    def note(self, kind: str, message: str, **details) -> None:
        self._sup._note(kind, message, **details)

    def replan(self, base: "Plan", events: Sequence["Failure"], solver: str | None = None) -> "Plan":
        return self._sup._replan(base, events, solver)

    def switch(self, plan: "Plan", *, kind: str, reason: str, ranks: Sequence[int]) -> str | None:
        return self._sup._switch(plan, kind=kind, reason=reason, ranks=ranks)

    def revive(self, rank: int) -> str | None:
        sup = self._sup
        if rank not in sup.alive:
            gone = sup._unreachable([rank])  # (a start sent to a gone host's agent would wait there unread)
            if gone:
                return f"its host {min(gone)} is gone (its agent does not answer)"
            gpus = sup.plan.spec.gpus
            if not (rank < len(gpus) and gpus[rank].live):
                sup.dead.discard(rank)
            # (else it failed since the running plan, and the recovery under way, such as a dump
            # generation's, has yet to plan around it: it stays lost to that plan, its new process
            # on standby, until a plan takes it back)
            sup._start_workers([rank])

    def direct(self, rank: int, directive: dict | None) -> None:
        self._sup.job.direct(rank, directive)

    def request_rejoin(self, rank: int, reason: str) -> None:
        self._sup.rejoins.request(rank, reason)

    def rejoin_wanted(self, rank: int) -> bool:
        return rank in self._sup.rejoins.wanted
