"""Schedulers: every one takes an `Instance` and returns a `Schedule` (docs/baselines.md).

A solver is a callable ``solve(instance, options) -> Schedule``. It raises
`schedc.diagnostics.InfeasibleError` (E3xx) when the instance is outside what
it can do. No solver-specific object (e.g. a `cp_model`) leaves this package.

Solvers are looked up by name with `get_solver`; `solver_names()` lists them.
One module per solver (`cpsat`, `greedy`, `gpipe`, `one_f_one_b`, `zb_h1`,
`zb_h2`, `reroute`, `drop_pipeline`, `redundant`), and what they share:

- `common`: memory arithmetic, errors, finishing a schedule;
- `assign`: who executes each microbatch at each stage;
- `static_programs`: the fixed per-stage programs of GPipe, 1F1B, ZB-H1, ZB-H2;
- `listsched`: the event-driven list scheduler behind `reroute-1f1b` and `greedy`;
- `improve`: greedy's local search;
- `cpsat_bound`: lower bounds on the steady-state period;
- `sandbox`: one CP-SAT solve in a child process, so that a crash of OR-Tools falls back.

`partition_cpsat` is of another kind: it chooses a re-partitioned layout
(`schedc.repartition`), found by name with `get_layout_solver`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

from schedc.instance import Instance
from schedc.schedule import Schedule


@dataclass(frozen=True)
class SolveOptions:
    """How long and how a solver searches.

    `time_limit` is a *work* budget, in calibrated seconds (about the wall time
    on 2 idle cores; the calibrations are `cpsat._WALL_MODEL` and
    `greedy.UNITS_PER_S`): CP-SAT gets `cpsat.deterministic_budget(time_limit, ...)`
    units of its deterministic time, greedy tries its counted list of candidates and then
    spends up to `greedy.polish_work(time_limit)` counted units in its local search. No
    search stops on the clock, so the same input gives the same plan on a quiet
    or a loaded machine, fast or slow (on a busy machine it just takes longer).
    `deadline` (a `time.monotonic()` instant) is for callers that must answer
    in time (`schedc.replan`): searches also stop there, and a plan a deadline
    cut short says so (`SolverInfo.stopped_by == "deadline"`).
    """

    time_limit: float = 5.0  # work budget (calibrated seconds), not wall time
    seed: int = 0
    workers: int = 2  # fixed, so results do not depend on the machine (determinism)
    hint: Schedule | None = None  # a schedule to warm-start from (replan)
    deadline: float | None = None  # time.monotonic() instant every search must end by (replan)


class Solver(Protocol):
    def __call__(self, instance: Instance, options: SolveOptions) -> Schedule: ...


# name -> "module:function", imported lazily so `schedc check` never loads OR-Tools.
_REGISTRY: dict[str, str] = {
    "cpsat": "schedc.solvers.cpsat:solve",
    "greedy": "schedc.solvers.greedy:solve",
    "gpipe": "schedc.solvers.gpipe:solve",
    "1f1b": "schedc.solvers.one_f_one_b:solve",
    "zb-h1": "schedc.solvers.zb_h1:solve",
    "zb-h2": "schedc.solvers.zb_h2:solve",
    "reroute-1f1b": "schedc.solvers.reroute:solve",
    "drop-pipeline": "schedc.solvers.drop_pipeline:solve",
    "redundant": "schedc.solvers.redundant:solve",
}

# Layout solvers `schedc.repartition` may choose a shape's layout with (its own greedy rule is
# the default): name -> "module:function", found by name so that repartition imports no solver.
_LAYOUT_REGISTRY: dict[str, str] = {
    "cpsat": "schedc.solvers.partition_cpsat:solve_layout",
}


def solver_names() -> list[str]:
    return list(_REGISTRY)


def get_solver(name: str) -> Solver:
    """The solve function registered under `name`; KeyError if there is none."""
    module, func = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), func)


def get_layout_solver(name: str):
    """The layout solver registered under `name` (`partition_cpsat.solve_layout`'s signature);
    KeyError if there is none."""
    module, func = _LAYOUT_REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), func)


def solve(instance: Instance, name: str, options: SolveOptions | None = None) -> Schedule:
    return get_solver(name)(instance, options or SolveOptions())


def __getattr__(name: str):
    """`schedc.solvers.cpsat` (and every other solver module) without importing it first:
    ``import schedc.solvers; schedc.solvers.cpsat.warm_up()`` works, and OR-Tools still loads
    only when a module that needs it is touched."""
    modules = {ref.split(":")[0].rsplit(".", 1)[1] for ref in (*_REGISTRY.values(), *_LAYOUT_REGISTRY.values())}
    if name in modules:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
