"""The validated spec: what a spec file means, resolved to integers.

Times are integer microseconds, sizes integer bytes, bandwidths integer
bytes per second. Every value that came from the source text keeps its span
in `Spec.spans` (keyed by a dotted path such as ``"cluster.dp"``,
``"stages.3.forward"``, ``"failures.1"``), so that a later pass can point at
the line that caused a problem. Spans never take part in equality: a spec
printed and parsed back is equal to the original.

These are the frozen dataclasses used everywhere inside schedc; pydantic only
checks user input on its way in (`schedc.validate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal, Mapping

from schedc.diagnostics import Span

Placement = Literal["pipeline_major", "stage_major"]
GpuState = Literal["live", "failed"]
OptimizerName = Literal["sgd", "adam", "adamw"]

#: Keys of a stage's costs, in the order they are printed.
STAGE_TIME_KEYS = ("forward", "backward_input", "backward_weight", "optimizer")
STAGE_SIZE_KEYS = ("activation", "stash", "static", "send")
STAGE_KEYS = STAGE_TIME_KEYS + STAGE_SIZE_KEYS


def scaled_duration(duration_us: int, speed: float) -> int:
    """Duration of an op on a GPU running at `speed` (0 < speed <= 1), rounded up."""
    if speed >= 1.0:
        return int(duration_us)
    # The small epsilon keeps exact quotients (1000 / 0.5) from rounding up on float noise.
    return int(math.ceil(duration_us / speed - 1e-9))


@dataclass(frozen=True)
class StageCosts:
    """Per-microbatch costs of one pipeline stage at full speed."""

    pp: int
    forward: int
    backward_input: int
    backward_weight: int
    optimizer: int
    activation: int
    stash: int
    static: int
    send: int

    @property
    def backward_full(self) -> int:
        """Backward when B/W are not decoupled: B lasts backward_input + backward_weight."""
        return self.backward_input + self.backward_weight


@dataclass(frozen=True)
class Gpu:
    """GPU (dp, pp): its rank, node, whether it is alive and how fast it runs."""

    rank: int
    dp: int
    pp: int
    node: int
    state: GpuState = "live"
    speed: float = 1.0

    @property
    def live(self) -> bool:
        return self.state == "live"


@dataclass(frozen=True)
class GpuSpec:
    memory: int
    flops: float | None = None  # peak FLOP/s (e.g. 312 TFLOPS -> 3.12e14)
    efficiency: float | None = None  # achieved fraction of peak, 0 < e <= 1


@dataclass(frozen=True)
class LinkSpec:
    latency: int  # microseconds
    bandwidth: int  # bytes per second

    def transfer_time(self, nbytes: int) -> int:
        """latency + nbytes / bandwidth, rounded up to whole microseconds."""
        if nbytes <= 0:
            return self.latency
        return self.latency + -(-nbytes * 1_000_000 // self.bandwidth)


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster. A schedc GPU (dp, pp) is a tensor-parallel group of `tp` real GPUs (one
    GPU when tp = 1): the unit that runs a stage's ops. Its `rank` (`rank_of`) numbers the
    groups; real GPUs are numbered ``rank * tp + t`` (the torch rank of a Megatron-style job),
    and nodes hold `gpus_per_node` real GPUs, so a group never straddles two (tp divides it)."""

    dp: int
    pp: int
    gpus_per_node: int
    placement: Placement
    gpu: GpuSpec
    link: LinkSpec
    tp: int = 1

    def rank_of(self, dp: int, pp: int) -> int:
        if self.placement == "stage_major":
            return pp * self.dp + dp
        return dp * self.pp + pp

    def coords_of(self, rank: int) -> tuple[int, int]:
        """(dp, pp) of a rank."""
        if self.placement == "stage_major":
            return rank % self.dp, rank // self.dp
        return rank // self.pp, rank % self.pp

    def node_of(self, rank: int) -> int:
        """The node of schedc GPU (TP group) `rank`."""
        return rank * self.tp // self.gpus_per_node

    @property
    def world_size(self) -> int:
        """schedc GPUs (TP groups): dp * pp."""
        return self.dp * self.pp

    @property
    def devices(self) -> int:
        """Real GPUs: dp * pp * tp (the torch world size of the job)."""
        return self.dp * self.pp * self.tp

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.gpus_per_node)

    def device_ranks(self, rank: int) -> range:
        """The real GPUs (torch ranks) of schedc GPU `rank`: ``rank * tp`` to ``rank * tp + tp - 1``."""
        return range(rank * self.tp, (rank + 1) * self.tp)

    def ranks_on_node(self, node: int) -> range:
        """The schedc GPUs (TP groups) whose real GPUs sit on `node`."""
        per = self.gpus_per_node // self.tp
        return range(node * per, min((node + 1) * per, self.world_size))


@dataclass(frozen=True)
class ModelSpec:
    """A `model "name" { ... }` block: the architecture costs are derived from, and code bindings."""

    name: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    microbatch_size: int = 1
    precision: str = "bf16"
    source: str | None = None  # "module:callable" returning (layers, loss_fn)
    data: str | None = None  # "module:callable" batch(iteration, dp, microbatch) -> (input, target)


@dataclass(frozen=True)
class Failure:
    """One statement of the `failures` block (or a replan event).

    kind: ``fail_gpu`` (dp, pp), ``fail_rank`` (rank), ``fail_node`` (node),
    ``slow_gpu`` (dp, pp, speed), ``recover_gpu`` (dp, pp; events only).
    """

    kind: Literal["fail_gpu", "fail_rank", "fail_node", "slow_gpu", "recover_gpu"]
    dp: int | None = None
    pp: int | None = None
    rank: int | None = None
    node: int | None = None
    speed: float | None = None
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TrainSpec:
    microbatches: int
    optimizer: OptimizerName = "adam"
    lr: float = 1e-3
    iterations: int = 1


@dataclass(frozen=True)
class ScheduleOptions:
    decouple_backward: bool = True
    stagger_optimizer: bool = True
    solver: str = "cpsat"
    time_limit: float = 5.0  # seconds


#: The recovery policies a `recovery` block may name (`schedc replay` replays each; `schedc
#: train` runs all but repartition).
RECOVERY_POLICIES = ("auto", "reroute", "drop-pipeline", "repartition", "restart")


@dataclass(frozen=True)
class RecoveryOptions:
    """A `recovery { ... }` block: how the job goes on after GPUs are lost or come back, and the
    costs the cost model (`schedc.recovery_cost`) prices transitions with. Seconds."""

    policy: str = "auto"
    horizon: float = 900.0  # expected time to the next event before two were seen
    checkpoint_every: float = 1800.0  # a restore loses half of it
    restart_cost: float = 30.0  # a restart's fixed part
    reconfigure_cost: float = 1.0  # a switch's fixed part


@dataclass(frozen=True)
class Spec:
    """A validated spec. `stages` is always resolved (explicit or derived from `model`)."""

    cluster: ClusterSpec
    stages: tuple[StageCosts, ...]
    train: TrainSpec
    schedule: ScheduleOptions
    failures: tuple[Failure, ...] = ()
    gpus: tuple[Gpu, ...] = ()  # every GPU, rank order, with failures applied
    model: ModelSpec | None = None
    partition: tuple[tuple[int, int], ...] | None = None  # per stage: layers[a:b]
    costs: Literal["explicit", "derived"] = "explicit"
    recovery: RecoveryOptions | None = None  # None: no `recovery` block (the defaults)
    source_name: str = field(default="<spec>", compare=False)
    # The text the spec was read from, so that diagnostics raised after parsing
    # (a solver's E3xx, an unknown solver name) can still show the source line.
    source_text: str = field(default="", compare=False, repr=False)
    spans: Mapping[str, Span] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @property
    def dp(self) -> int:
        return self.cluster.dp

    @property
    def pp(self) -> int:
        return self.cluster.pp

    @property
    def microbatches(self) -> int:
        return self.train.microbatches

    def gpu(self, dp: int, pp: int) -> Gpu:
        return self.gpus[self.cluster.rank_of(dp, pp)]

    def span(self, path: str) -> Span | None:
        return self.spans.get(path)

    @property
    def sources(self) -> dict[str, str]:
        """`{file name: text}` for rendering diagnostics that point into this spec."""
        return {self.source_name: self.source_text} if self.source_text else {}

    def without_failures(self) -> "Spec":
        """The same spec with every GPU live at full speed (for fault-free metrics)."""
        gpus = tuple(replace(g, state="live", speed=1.0) for g in self.gpus)
        return replace(self, failures=(), gpus=gpus)
