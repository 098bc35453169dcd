"""The options of a live run (`schedc train`), their defaults and their checks: the one place
both the CLI and the library read them from."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from schedc.diagnostics import RunError, error
from schedc.limits import MAX_COST_SECONDS, MAX_ITERATIONS, MAX_SECONDS, count_problem, seconds_problem

RecoveryMethod = Literal["auto", "reroute", "drop-pipeline", "repartition", "restart"]
RECOVERY_METHODS = ("auto", "reroute", "drop-pipeline", "repartition", "restart")
FAIL_SLOW_MODES = ("act", "detect", "off")


@dataclass(frozen=True)
class TrainOptions:
    """How a live run goes (the options of `schedc train`)."""

    iterations: int | None = None  # default: the spec's train.iterations
    emulate: bool = False
    inject: tuple[str, ...] = ()
    checkpoint_every: int = 0  # 0: no checkpoints
    checkpoint_dir: str | None = None  # default OUT/checkpoints
    keep_checkpoints: int = 2
    resume: bool = False
    recovery: RecoveryMethod | None = None  # None: the spec's `recovery.policy`, else auto (the cheapest)
    horizon: float | None = None  # seconds to the next event assumed before two were seen (None: the spec's, else 900)
    fail_slow: str = "act"  # act: detect slow GPUs and switch plans by cost; detect: only say so; off
    detect_timeout: float = 3.0  # the least heartbeat silence before a rank can be declared hung (a floor)
    phi: float = 8.0  # ... and how improbable the silence must be given the rank's own beats (phi accrual)
    heartbeat_interval: float = 0.05
    stall_timeout: float | None = None  # default: max(10 s, 10 x the plan's iteration time)
    startup_timeout: float = 600.0  # the ceiling of a start-up (judged against the peers' start-ups below it)
    transition_timeout: float = 60.0  # seconds a new generation may take to become ready once its members are up
    replan_deadline: float = 0.5
    max_restarts: int = 3
    want_weights: bool = False
    wait_timeout: float = 600.0  # a rank's longest wait for a peer before it gives up by itself
    hosts: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    agent_timeout: float = 60.0
    device: str = "cpu"  # cpu, cuda (rank i on GPU i mod the GPUs of its host) or cuda:N (every rank on GPU N)
    backend: str = "auto"  # how ranks talk: a live run recovers over gloo (CUDA tensors go through host memory)
    shadow: bool = False  # every GPU also holds the previous stage: a stage lost on every GPU loses no work

    def with_spec(self, spec) -> "TrainOptions":
        """These options with the spec's `recovery` block filling what was not given (policy,
        horizon), checked again (E555): a spec may say `policy = restart`, which needs
        checkpoints, or `repartition`, which `schedc train` does not run yet."""
        rec = spec.recovery
        out = replace(self, recovery=self.recovery or (rec.policy if rec else "auto"),
                      horizon=self.horizon if self.horizon is not None else (rec.horizon if rec else 900.0))
        out.check()
        return out

    def check(self) -> None:
        """E555 for option values that make no sense."""
        problems = []
        for name in ("detect_timeout", "heartbeat_interval", "startup_timeout", "replan_deadline", "wait_timeout",
                     "agent_timeout", "transition_timeout"):
            problem = seconds_problem(getattr(self, name), name.replace("_", "-"))
            if problem:
                problems.append(problem)
        for name, most in (("stall_timeout", MAX_SECONDS), ("horizon", MAX_COST_SECONDS)):  # None: decided later
            value = getattr(self, name)
            problem = None if value is None else seconds_problem(value, name.replace("_", "-"), most)
            if problem:
                problems.append(problem)
        if not (isinstance(self.phi, (int, float)) and math.isfinite(self.phi) and self.phi > 0):
            problems.append(f"phi must be a positive number (8: a healthy rank's silence that long is a "
                            f"one-in-10^8 event), got {self.phi}")
        problem = None if self.iterations is None else count_problem(self.iterations, "iterations", 1, MAX_ITERATIONS)
        if problem:
            problems.append(problem)
        for name in ("checkpoint_every", "max_restarts", "store_port"):
            if getattr(self, name) < 0:
                problems.append(f"{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.store_port > 65535:
            problems.append(f"store-port must be a TCP port, 0 (any free one) to 65535, got {self.store_port}")
        if self.keep_checkpoints < 1:
            problems.append(f"keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.hosts < 1:
            problems.append(f"hosts must be at least 1, got {self.hosts}")
        if self.heartbeat_interval * 3 > self.detect_timeout:
            problems.append("detect-timeout must be at least three heartbeat intervals")
        if self.recovery is not None and self.recovery not in RECOVERY_METHODS:
            problems.append(f"unknown recovery `{self.recovery}` (auto, reroute, drop-pipeline, repartition or "
                            "restart)")
        if self.fail_slow not in FAIL_SLOW_MODES:
            problems.append(f"unknown fail-slow mode `{self.fail_slow}` (act, detect or off)")
        if self.recovery == "restart" and not self.checkpoint_every:
            problems.append("recovery `restart` restarts from checkpoints: give --checkpoint-every K")
        if self.device != "cpu" and self.emulate:
            problems.append("--emulate sleeps instead of computing: it runs on the CPU (leave out --device)")
        if self.want_weights and self.emulate:
            problems.append("weights need real compute, not --emulate")
        if problems:
            raise RunError([error("E555", p) for p in problems])

