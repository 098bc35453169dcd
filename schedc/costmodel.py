"""Stage costs derived from a `model` block: an analytic model of GPT-style transformers.

The formulas and their sources are in docs/costmodel.md; in short, per layer
and microbatch (b = microbatch_size, s = seq_len, h = hidden, a = heads,
V = vocab, e = bytes per element of `precision`):

* FLOPs (Narayanan et al. 2021): forward ``24bsh^2 + 4bs^2h``; backward-input
  ``24bsh^2 + 8bs^2h`` and backward-weight ``24bsh^2`` (the Zero Bubble split:
  attention scores have no weights). The LM head adds ``2bshV`` to each of
  F, B and W on the last stage.
* Activation bytes (Korthikanti et al. 2022): ``sbh(34 + 5as/h) * e/2``;
  stash (what W still needs after B) ``16sbh*e``.
* Parameters ``12h^2 + 13h`` per layer; embedding ``Vh + sh`` on the first
  stage, an untied LM head ``Vh + 2h`` on the last; static bytes per parameter
  16 for Adam in mixed precision (ZeRO's accounting).
* Optimizer: memory-bound step (all state read and written once at
  `HBM_BANDWIDTH`) plus a ring all-reduce of the gradients over `dp` GPUs.

Times are ``FLOPs / (gpu.flops * gpu.efficiency)`` rounded up to whole
microseconds. Everything is integer or exact-fraction arithmetic, so the same
model gives the same costs on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from schedc.spec import ClusterSpec, ModelSpec, StageCosts

#: Assumed HBM bandwidth for the memory-bound optimizer step (A100-80GB class), bytes/s.
HBM_BANDWIDTH = 2_000_000_000_000
#: Used when `cluster.gpu.efficiency` is not given (a typical achieved fraction of peak).
DEFAULT_EFFICIENCY = 0.5
#: Bytes per element of each supported precision.
BYTES_PER_ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Optimizer state bytes per parameter (fp32 moments).
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 0}


@dataclass(frozen=True)
class PartCosts:
    """FLOPs, parameters and bytes of one part of the model (a layer, the embedding, the head)."""

    forward: int = 0
    backward_input: int = 0
    backward_weight: int = 0
    params: int = 0
    activation: int = 0
    stash: int = 0

    def __add__(self, other: "PartCosts") -> "PartCosts":
        return PartCosts(*(a + b for a, b in zip(self._tuple(), other._tuple())))

    def _tuple(self) -> tuple[int, ...]:
        return (self.forward, self.backward_input, self.backward_weight, self.params, self.activation,
                self.stash)

    @property
    def flops(self) -> int:
        return self.forward + self.backward_input + self.backward_weight


def _dims(model: ModelSpec) -> tuple[int, int, int, int, int, int]:
    assert None not in (model.hidden, model.heads, model.seq_len, model.vocab), "validated model only"
    return (model.microbatch_size, model.seq_len, model.hidden, model.heads, model.vocab,  # type: ignore[return-value]
            BYTES_PER_ELEMENT[model.precision])


def layer_costs(model: ModelSpec) -> PartCosts:
    """One transformer layer for one microbatch."""
    b, s, h, a, _, e = _dims(model)
    matmul = 24 * b * s * h * h
    return PartCosts(
        forward=matmul + 4 * b * s * s * h,
        backward_input=matmul + 8 * b * s * s * h,
        backward_weight=matmul,
        params=12 * h * h + 13 * h,
        activation=b * s * (34 * h + 5 * a * s) * e // 2,
        stash=16 * b * s * h * e,
    )


def embedding_costs(model: ModelSpec) -> PartCosts:
    """Token and position embedding (first stage): no matmul FLOPs; its dropout mask is sbh bytes."""
    b, s, h, _, v, _ = _dims(model)
    return PartCosts(params=v * h + s * h, activation=b * s * h)


def head_costs(model: ModelSpec) -> PartCosts:
    """Final layernorm, LM head and cross-entropy (last stage)."""
    b, s, h, _, v, e = _dims(model)
    logits = 2 * b * s * h * v
    return PartCosts(
        forward=logits, backward_input=logits, backward_weight=logits,
        params=v * h + 2 * h,
        activation=4 * b * s * v + b * s * h * e,  # fp32 logits for the loss + the head's input
        stash=b * s * h * e + b * s * v * e,  # W of the head needs its input and output gradient
    )


def static_bytes_per_param(model: ModelSpec, optimizer: str) -> int:
    """Weights + gradients (+ fp32 master copy in mixed precision) + optimizer state."""
    e = BYTES_PER_ELEMENT[model.precision]
    master = 4 if e < 4 else 0
    return 2 * e + master + OPTIMIZER_STATE_BYTES[optimizer]


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def flops_time(flops: int, cluster: ClusterSpec) -> int:
    """Microseconds to run `flops` at the GPU's achieved rate, rounded up."""
    assert cluster.gpu.flops is not None, "derived costs need cluster.gpu.flops"
    eff = cluster.gpu.efficiency if cluster.gpu.efficiency is not None else DEFAULT_EFFICIENCY
    rate = Fraction(cluster.gpu.flops) * Fraction(eff)
    return _ceil(Fraction(flops * 1_000_000) / rate)


def optimizer_time(params: int, model: ModelSpec, cluster: ClusterSpec, optimizer: str) -> int:
    """All-reduce of the gradients among `dp` replicas (ring) + a memory-bound optimizer step."""
    step = optimizer_step_time(params * static_bytes_per_param(model, optimizer))
    return step + ring_allreduce_time(params * BYTES_PER_ELEMENT[model.precision], cluster)


def optimizer_step_time(static_bytes: int) -> int:
    """Microseconds of the optimizer step alone (no all-reduce) on a stage whose static state is
    `static_bytes`: memory-bound, every byte read and written once at `HBM_BANDWIDTH`."""
    return _ceil(Fraction(2 * static_bytes * 1_000_000, HBM_BANDWIDTH))


def gradient_bytes(static_bytes: int, model: ModelSpec, optimizer: str) -> int:
    """Bytes of the gradient of a stage whose static state is `static_bytes`: its parameters
    (``static / static_bytes_per_param``) x the bytes of an element, as the all-reduce moves it."""
    return static_bytes * BYTES_PER_ELEMENT[model.precision] // static_bytes_per_param(model, optimizer)


def ring_allreduce_time(grad_bytes: int, cluster: ClusterSpec) -> int:
    """Microseconds of a ring all-reduce of `grad_bytes` over the `dp` GPUs of a stage (0 with dp = 1)."""
    d = cluster.dp
    if d <= 1:
        return 0
    ring = _ceil(Fraction(2 * (d - 1) * grad_bytes * 1_000_000, d * cluster.link.bandwidth))
    return ring + 2 * (d - 1) * cluster.link.latency


def part_of_stage(model: ModelSpec, start: int, stop: int) -> PartCosts:
    """Costs of the layers [start:stop], with the embedding / head if the slice holds the first / last layer."""
    total = PartCosts()
    layer = layer_costs(model)
    for _ in range(start, stop):
        total = total + layer
    if start == 0:
        total = total + embedding_costs(model)
    if stop == model.layers:
        total = total + head_costs(model)
    return total


def stage_costs(model: ModelSpec, cluster: ClusterSpec, optimizer: str, pp: int,
                layers: tuple[int, int]) -> StageCosts:
    """The `StageCosts` of stage `pp` holding `layers` = (start, stop)."""
    part = part_of_stage(model, *layers)
    b, s, h, _, _, e = _dims(model)
    return StageCosts(
        pp=pp,
        forward=flops_time(part.forward, cluster),
        backward_input=flops_time(part.backward_input, cluster),
        backward_weight=flops_time(part.backward_weight, cluster),
        optimizer=optimizer_time(part.params, model, cluster, optimizer),
        activation=part.activation,
        stash=part.stash,
        static=part.params * static_bytes_per_param(model, optimizer),
        send=b * s * h * e,
    )


def balanced_partition(model: ModelSpec, stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous split of the layers into `stages` non-empty slices minimising the largest stage FLOPs.

    The embedding and LM head count on the first and last stage. Among optimal
    splits, the one that fills earlier stages first is returned (deterministic).
    """
    n = model.layers or 0
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    layer = layer_costs(model).flops
    head = head_costs(model).flops
    cost = [layer] * n
    cost[-1] += head  # embedding has no FLOPs

    def split(bound: int) -> list[tuple[int, int]] | None:
        out, start, acc = [], 0, 0
        for i, c in enumerate(cost):
            remaining_stages = stages - len(out) - 1  # after the current one
            must_close = n - i == remaining_stages  # leave one layer for each later stage
            if c > bound:
                return None
            if start < i and (acc + c > bound or must_close):
                out.append((start, i))
                start, acc = i, 0
            acc += c
        out.append((start, n))
        return out if len(out) == stages else None

    lo, hi = max(cost), sum(cost)
    while lo < hi:
        mid = (lo + hi) // 2
        if split(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    result = split(lo)
    assert result is not None  # `hi` (every layer in few stages) is always feasible
    return tuple(result)


def derive_stages(model: ModelSpec, cluster: ClusterSpec, optimizer: str,
                  partition: tuple[tuple[int, int], ...] | None) -> tuple[tuple[StageCosts, ...], tuple[tuple[int, int], ...]]:
    """Every stage's costs and the partition used (the given one, or a balanced one)."""
    if partition is None:
        partition = balanced_partition(model, cluster.pp)
    stages = tuple(stage_costs(model, cluster, optimizer, s, sl) for s, sl in enumerate(partition))
    return stages, partition
