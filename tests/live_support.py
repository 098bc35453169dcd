"""Helpers for the live-run tests (no tests here): small compiled plans bound to the
shipped models, and a run checked against single-process training."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, TypeVar

import schedc
from schedc.runtime import load_manifest, reference_train
from test_runtime_support import max_weight_diff

TOLERANCE = 1e-5  # max abs weight difference from single-process training (float32)
LOSS_TOLERANCE = 1e-6
#: How long `wait_until` waits by default. Generous on purpose: a condition that holds returns at
#: once, so the bound only decides how long a broken run takes to fail, never whether a slow
#: (loaded) machine passes.
WAIT_S = 60.0

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, timeout: float | None = None, poll: float = 0.01,
               state: Callable[[], object] | None = None) -> T:
    """Poll `predicate` until it returns something true, and return that; fail the test naming
    `what` (the condition waited for), and `state()` if given (what was seen instead), if
    `timeout` seconds (default `WAIT_S`) pass first. Tests wait on a condition with this, never
    with a sleep that hopes the condition holds by then."""
    timeout = WAIT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = "" if state is None else f"; last seen: {state()!r}"
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(poll)


def spec_text(*, model: str = "mlp", dp: int = 2, pp: int = 2, optimizer: str = "sgd", microbatches: int = 3,
              gpus_per_node: int | None = None, decouple: bool = True, stagger: bool = True,
              iterations: int = 4, forward: str = "2ms", data: str | None = None) -> str:
    """A spec with explicit costs bound to `schedc.models.<model>` (pipeline_major: node n = pipeline n
    when gpus_per_node = pp)."""
    lr = "0.001" if optimizer in ("adam", "adamw") else "0.05"
    return f"""
model "m" {{ source = "schedc.models.{model}:build" {f'data = "{data}"' if data else ""} }}
cluster {{ dp = {dp}  pp = {pp}  gpus_per_node = {gpus_per_node or pp}
          gpu {{ memory = 1GiB }}  link {{ latency = 50us  bandwidth = 1GB/s }} }}
stages {{ all {{ forward = {forward}  backward_input = 2ms  backward_weight = 1ms  optimizer = 0.5ms
               activation = 4MiB  stash = 1MiB  static = 16MiB  send = 64KiB }} }}
train {{ microbatches = {microbatches}  optimizer = {optimizer}  lr = {lr}  iterations = {iterations} }}
schedule {{ solver = greedy  decouple_backward = {str(decouple).lower()}  stagger_optimizer = {str(stagger).lower()} }}
"""


def compiled(tmp_path: Path, **kw) -> Path:
    """`schedc compile` of `spec_text(**kw)` into tmp_path/out."""
    out = Path(tmp_path) / "out"
    schedc.compile(spec_text(**kw)).write(out)
    return out


def check_exact(out: Path, result, iterations: int, tolerance: float = TOLERANCE) -> float:
    """The run's weights and every iteration's loss against single-process training; the max weight diff."""
    ref, ref_losses = reference_train(load_manifest(out), iterations)
    diff = max_weight_diff(result.state_dict, ref)
    assert diff <= tolerance, f"max abs weight difference {diff:.3g} (tolerance {tolerance:g})"
    assert [r.iteration for r in result.iterations] == list(range(iterations))
    for got, want in zip(result.losses, ref_losses):
        assert abs(got - want) <= LOSS_TOLERANCE, (result.losses, ref_losses)
    return diff


def children_of(pid: int, word: str) -> list[int]:
    """Live child processes of `pid` whose command line contains `word` (from /proc: `ps`
    cuts command lines to the width of a terminal it does not have)."""
    return _live_processes(1, pid, word)


def session_members(sid: int, word: str) -> list[int]:
    """Live processes of session `sid` whose command line contains `word` (from /proc)."""
    return _live_processes(3, sid, word)


def _live_processes(field: int, value: int, word: str) -> list[int]:
    """Live processes whose /proc/PID/stat `field` (after the command name: 1 the parent,
    3 the session) is `value` and whose command line contains `word`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if stat[field] == str(value) and stat[0] != "Z" and word in cmdline:
            found.append(int(entry.name))
    return found
