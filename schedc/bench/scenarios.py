"""The scenarios `schedc bench` plans: a fixed, seeded matrix of clusters and failures.

GPT-3-like models (Medium, 1.3B, 2.7B; costs derived by the cost model from a
`model` block) and explicit-cost specs, 16 to 64 GPUs, 1-10% of GPUs failed at
seeded random places, whole nodes failed, and slow GPUs at 0.5-0.8 speed
(`scenarios`); scale points of 64 to 4,096 GPUs for planning latency
(`scale_scenarios`). A `Scenario` writes itself as spec text, so the parser,
validator and cost model are on every measured path. bench/scale.py and
bench/replan_latency.py build their specs from the same `Scenario`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: GPT-3 family shapes (Brown et al. 2020, table 2.1): layers, hidden, heads.
MODELS = {
    "gpt3-medium": (24, 1024, 16),
    "gpt3-1.3b": (24, 2048, 16),
    "gpt3-2.7b": (32, 2560, 32),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str  # a key of MODELS, or "explicit"
    dp: int
    pp: int
    microbatches: int
    failures: tuple[str, ...] = ()  # statements of the failures block
    seed: int = 0
    decouple_backward: bool = True
    stagger_optimizer: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.pp

    @property
    def n_failed(self) -> int:
        return sum(8 if f.startswith("fail node") else 1 for f in self.failures if f.startswith("fail"))

    @property
    def n_slow(self) -> int:
        return sum(1 for f in self.failures if f.startswith("slow"))

    def spec_text(self) -> str:
        """The scenario as spec text (so the parser, validator and cost model are on the path)."""
        head = [f"# schedc bench scenario {self.name}"]
        if self.model == "explicit":
            head.append("stages {\n    all { forward = 1.0ms  backward_input = 1.0ms  backward_weight = 0.8ms"
                        "  optimizer = 0.4ms\n          activation = 2GiB  stash = 512MiB  static = 12GiB"
                        "  send = 16MiB }\n"
                        f"    stage 0 {{ forward = 1.2ms }}\n    stage {self.pp - 1} {{ forward = 1.4ms"
                        "  backward_input = 1.5ms }\n}")
            gpu = "gpu { memory = 40GiB }"
        else:
            layers, hidden, heads = MODELS[self.model]
            head.append(f'model "{self.model}" {{\n    layers = {layers}  hidden = {hidden}  heads = {heads}'
                        "  seq_len = 2048  vocab = 50304\n    microbatch_size = 1  precision = bf16\n}")
            gpu = "gpu { memory = 80GiB  flops = 312TFLOPS  efficiency = 0.45 }"
        head.append(f"cluster {{\n    dp = {self.dp}  pp = {self.pp}  gpus_per_node = 8\n    {gpu}\n"
                    "    link { latency = 20us  bandwidth = 25GB/s }\n}")
        head.append(f"train {{ microbatches = {self.microbatches} }}")
        if self.failures:
            head.append("failures {\n" + "\n".join(f"    {f}" for f in self.failures) + "\n}")
        head.append(f"schedule {{ decouple_backward = {str(self.decouple_backward).lower()}"
                    f"  stagger_optimizer = {str(self.stagger_optimizer).lower()} }}")
        return "\n".join(head) + "\n"


# -- the matrix ------------------------------------------------------------------


def random_failures(dp: int, pp: int, n: int, rng: random.Random) -> list[str]:
    """`n` failed GPUs at random places, never a whole stage."""
    gpus = [(d, s) for d in range(dp) for s in range(pp)]
    while True:
        picked = sorted(rng.sample(gpus, n))
        lost = {s for s in range(pp) if sum(1 for _, t in picked if t == s) >= dp}
        if not lost:
            return [f"fail gpu(dp={d}, pp={s})" for d, s in picked]


def failure_sets(dp: int, pp: int, seed: int) -> list[tuple[str, tuple[str, ...]]]:
    rng = random.Random(seed * 1000 + dp * 31 + pp)
    n = dp * pp
    sets: list[tuple[str, tuple[str, ...]]] = [("fault-free", ())]
    counts = sorted({1, max(1, round(0.05 * n)), max(1, round(0.10 * n))})
    for k in counts:
        sets.append((f"{k}-failed", tuple(random_failures(dp, pp, k, rng))))
    if n >= 16 and dp >= 3:
        sets.append(("node-failed", (f"fail node {rng.randrange(n // 8)}",)))
    slow = rng.sample([(d, s) for d in range(dp) for s in range(pp)], 2)
    speeds = [rng.choice([0.5, 0.6, 0.7, 0.8]) for _ in slow]
    sets.append(("2-slow", tuple(f"slow gpu(dp={d}, pp={s}) speed = {v}" for (d, s), v in zip(slow, speeds))))
    return sets


def scenarios(quick: bool, seeds: int) -> list[Scenario]:
    """The quality matrix: (model, dp, pp, microbatches) x failure sets x seeds."""
    if quick:
        shapes = [("explicit", 4, 4, 8), ("gpt3-1.3b", 4, 4, 16)]
    else:
        shapes = [("explicit", 4, 4, 8), ("explicit", 8, 4, 16), ("gpt3-medium", 4, 4, 16),
                  ("gpt3-1.3b", 2, 8, 16), ("gpt3-1.3b", 8, 4, 16), ("gpt3-2.7b", 4, 8, 32),
                  ("gpt3-2.7b", 8, 8, 32)]
    out = []
    for model, dp, pp, mb in shapes:
        for seed in range(seeds):
            for label, fails in failure_sets(dp, pp, seed):
                if seed > 0 and label == "fault-free":
                    continue  # the fault-free point does not depend on the seed
                out.append(Scenario(f"{model}-{dp}x{pp}x{mb}-{label}-s{seed}", model, dp, pp, mb,
                                    fails, seed))
    return out


def scale_scenarios(quick: bool) -> list[Scenario]:
    """Latency points: 1% of GPUs failed, pp = 8, 16 microbatches per pipeline."""
    sizes = [64, 256] if quick else [64, 256, 1024, 4096]
    out = []
    for n in sizes:
        dp, pp = n // 8, 8
        fails = random_failures(dp, pp, max(1, n // 100), random.Random(n))
        out.append(Scenario(f"scale-{n}", "explicit", dp, pp, 16, tuple(fails)))
    return out
