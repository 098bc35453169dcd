"""The messages of a live run, typed: what workers report, what agents tell, what they are told.

Every role talks through the job's store queues (`schedc.live.membership`):

| queue | from -> to | messages |
|---|---|---|
| ``reports`` | worker -> supervisor | `Started`, `Ready`, `IterationDone`, `Aborted`, `Left`, `Done`, `CheckpointWritten`, `CheckpointFailed`, `CaughtUp`, `Probe`, `WorkerError`; `RejoinAsked` from `schedc rejoin` |
| ``events`` | agent -> supervisor | `AgentUp`, `Exited`, `Injected`, `AgentLeft` |
| ``agent/H/cmd`` | supervisor, worker -> agent H | `StartRanks`, `SignalRanks`, `RenameRanks`, `FireInjection`, `StopAgent` |

`schedc run` uses the same `IterationDone`, `Weights` and `WorkerError`
over each rank's pipe. Messages are frozen dataclasses; `encode`/`decode`
are the one place they become bytes (JSON with a ``kind`` tag, the tag
names below) and back. A message of an unknown kind is a `ProtocolError`:
two versions of schedc in one job, not something to guess about.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields

class Phase(str, enum.Enum):
    """Where a live run is (the supervisor's state)::

        new -> starting --every member ready--> running --every iteration done--> finishing -> done
                                                  |  ^
                         failure: recovering -----+  +----- switching (a planned change at a boundary)
    """

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    SWITCHING = "switching"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class ProtocolError(RuntimeError):
    """A message that no message type of this version describes."""


_KINDS: dict[str, type] = {}


def message(kind: str):
    """Register a frozen dataclass as the message of wire kind `kind`."""

    def register(cls):
        cls = dataclass(frozen=True)(cls)
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return register


def encode(msg) -> bytes:
    """A message as the bytes a store queue carries."""
    body = {"kind": msg.kind}
    for f in fields(msg):
        value = getattr(msg, f.name)
        body[f.name] = list(value) if isinstance(value, tuple) else value
    return json.dumps(body, separators=(",", ":")).encode()


def decode(blob: bytes | str):
    """The message `encode` made (tuples come back as tuples)."""
    body = json.loads(blob)
    cls = _KINDS.get(body.pop("kind", None))
    if cls is None:
        raise ProtocolError(f"unknown message {blob[:80]!r}")
    args = {}
    for f in fields(cls):
        if f.name in body:
            value = body[f.name]
            args[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**args)


# -- worker -> supervisor -------------------------------------------------------------------


@message("started")
class Started:
    """A worker's process runs: on `host`, started by the agent whose lease is `agent` ("": host
    0's, which holds none), its rank numbered in `epoch`."""

    rank: int
    pid: int
    host: int
    agent: str = ""
    epoch: int = 0


@message("ready")
class Ready:
    """The rank built generation `gen`'s groups and agreed where to resume (`start`)."""

    rank: int
    gen: int
    start: int
    undone: bool  # it undid its last optimizer step (it was one ahead)
    t: float
    shadow: bool = False  # --shadow: it holds an exact shadow of the previous stage, at `start` steps
    moved: int = 0  # bytes of layers it received from other members (an in-place re-partition)


@message("iter")
class IterationDone:
    """One rank finished one iteration (both `schedc run` and `schedc train` send it).

    `t0`/`t1` are `time.time()` in a live run, `time.monotonic()` in `schedc run`
    (one clock per run, shared by the processes of a machine). `loss` is this
    rank's part: the sum of loss/(D*M) over its last-stage microbatches, or the
    whole iteration's loss where the stage reduced it. `compute`/`planned` are
    seconds of measured and planned compute (waits excluded), for the fail-slow
    detector; `queued` the part of `compute` this rank's thread waited for a CPU
    (a CPU rank on a loaded host; 0 on a GPU or where the kernel does not say).
    """

    rank: int
    it: int
    t0: float
    t1: float
    loss: float | None = None
    gen: int = 0
    steps: int = 0
    compute: float = 0.0
    planned: float = 0.0
    queued: float = 0.0


@message("aborted")
class Aborted:
    rank: int
    gen: int
    steps: int
    reason: str
    t: float


@message("left")
class Left:
    """The rank finished its part of `gen` at a planned switch (nothing undone)."""

    rank: int
    gen: int
    steps: int
    t: float


@message("done")
class Done:
    rank: int
    gen: int
    steps: int
    t: float


@message("ckpt")
class CheckpointWritten:
    rank: int
    stage: int
    iteration: int  # the steps the stage's state has applied
    gen: int
    layers: tuple[int, int] | None = None  # the model's layers [a, b) the stage holds (None: emulated)
    model_layers: int | None = None  # how many layers the whole model has (None: emulated)


@message("ckpt_error")
class CheckpointFailed:
    rank: int
    stage: int
    iteration: int
    gen: int
    reason: str


@message("caughtup")
class CaughtUp:
    """A joiner applied `steps` steps of catch-up session `session` (`bytes` received)."""

    rank: int
    session: int | None
    steps: int
    bytes: int
    t: float


@message("probe")
class Probe:
    """A rank's speed now, against its healthy speed (a GPU on standby, or one with no compute)."""

    rank: int
    speed: float
    t: float


@message("error")
class WorkerError:
    """The rank stopped on an error of its own; `diagnostics` are `Diagnostic.to_json()` dicts."""

    rank: int
    diagnostics: tuple[dict, ...]


@message("weights")
class Weights:
    """A stage's final weights (`torch.save` bytes): over a pipe only, never through the store."""

    rank: int
    blob: bytes


@message("rejoin")
class RejoinAsked:
    """`schedc rejoin`: a user asks for a GPU back (`event` is its `recover gpu(...)` text)."""

    event: str
    t: float


# -- agent -> supervisor ----------------------------------------------------------------------


@message("agent")
class AgentUp:
    """A host's agent registered, holding the lease `agent` ("": host 0's, in the supervisor)."""

    host: int
    pid: int
    t: float
    agent: str = ""


@message("agent_left")
class AgentLeft:
    """A host's agent saw the run's stop and ended every worker of its host: the supervisor keeps the
    store up until each remote agent has said so (an agent whose store goes before it saw the stop
    counts that as the supervisor lost, and exits with a diagnostic)."""

    host: int
    t: float


@message("exit")
class Exited:
    """A worker process ended; `code` as `multiprocessing` gives it (negative: killed by a signal)."""

    rank: int
    code: int
    host: int
    t: float
    epoch: int = 0  # the epoch `rank` is numbered in (the agent's, when it saw the exit)


@message("injected")
class Injected:
    id: int  # the injection's index
    ranks: tuple[int, ...]  # those signalled
    signal: str
    host: int
    t: float
    by: int | None = None  # the rank that reached the moment (None: the supervisor's clock)
    iteration: int | None = None


# -- to an agent ------------------------------------------------------------------------------


@message("start")
class StartRanks:
    ranks: tuple[int, ...]


@message("rename")
class RenameRanks:
    """Epoch `epoch` begins: the process of rank ``old[i]`` is rank ``new[i]`` from now on (the
    survivors of an in-place re-partition); the agent's other processes have ended."""

    epoch: int
    old: tuple[int, ...]
    new: tuple[int, ...]


@message("signal")
class SignalRanks:
    ranks: tuple[int, ...]
    signal: str  # kill, stop, cont, term


@message("inject")
class FireInjection:
    """Carry out injection `id` on its targets now (sent by the rank that reached its moment,
    or by the supervisor for a moment in time)."""

    id: int
    rank: int | None = None
    iteration: int | None = None
    t: float | None = None
    # Its targets as the layout that runs numbers them (`Injection.on_layout`: after a re-partition
    # a GPU's rank is not the one the first plan gave it); None: the injection's own.
    ranks: tuple[int, ...] | None = None


@message("stop")
class StopAgent:
    """End every worker of the host, then the agent."""


# -- the run's settings, as every role reads them from the store ---------------------------------


@dataclass(frozen=True)
class RunConfig:
    """What every worker and agent of a run needs to know, written once by the supervisor."""

    iterations: int
    emulate: bool
    heartbeat_interval: float  # seconds between a worker's heartbeats
    wait_timeout: float  # a rank's longest wait for a peer
    checkpoint_every: int  # 0: none
    checkpoint_dir: str
    want_weights: bool
    injections: tuple[dict, ...]  # `Injection.to_json()` of every injection of the run
    coords: dict[str, tuple[int, int]]  # rank -> (dp, pp) of every GPU, live or not
    probe: bool  # standby and compute-less ranks probe their speed (--fail-slow act)
    cluster: tuple[int, int]  # (dp, pp): what `schedc rejoin` checks a GPU against
    stall_clock: bool = False  # workers time their stops (`schedc.live.stall`; --fail-slow act or detect)
    device: str = "cpu"  # --device: where workers compute (`schedc.runtime.placement.rank_device`)
    shadow: bool = False  # --shadow: every GPU also holds the previous stage (`schedc.live.shadow`)

    def encode(self) -> bytes:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes | str) -> "RunConfig":
        body = json.loads(blob)
        body["injections"] = tuple(body["injections"])
        body["coords"] = {r: tuple(c) for r, c in body["coords"].items()}
        body["cluster"] = tuple(body["cluster"])
        return cls(**body)
