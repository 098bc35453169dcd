"""`schedc.compile(spec) -> Plan`: spec to verified, simulated schedule (design.md §2, §8).

    spec --from_spec--> Instance --solver--> Schedule --verify_schedule--> (checked)
         --simulate--> Metrics

The fault-free iteration time comes from the same solver on the same
instance with every GPU live at full speed (skipped when the instance is
fault-free already: it is the iteration time itself). Never prints, never
exits; every problem is a `SchedcError` carrying diagnostics.

`Plan.write(dir)` writes what `schedc compile -o dir` writes: schedule.json,
trace.json, timeline.svg, the torch CSVs where expressible, spec.sched and
the per-rank programs.
Files go to a temporary directory beside `dir` first and are renamed into
place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.diagnostics import SchedcError, SpecError, did_you_mean, error
from schedc.instance import Instance, from_spec
from schedc.printer import print_spec
from schedc.schedule import Schedule
from schedc.simulate import Metrics, metrics_of, simulate
from schedc.spec import Spec
from schedc.verify import verify_schedule


@dataclass(frozen=True)
class Plan:
    """A compiled spec: the verified schedule and its metrics."""

    spec: Spec
    schedule: Schedule
    metrics: Metrics

    @property
    def instance(self) -> Instance:
        return self.schedule.instance

    def write(self, dir: str | os.PathLike) -> Path:
        """Write what `schedc compile -o dir` writes into `dir`.

        schedule.json, trace.json, timeline.svg, pipeline_{d}.csv (where
        expressible), spec.sched, and the per-rank programs (rank_NN.py,
        main.py, programs.json) that `schedc run dir` or torchrun execute.
        Files of the same names already in `dir` are replaced, stale CSVs and
        rank programs of an earlier schedule are removed, other files are left
        alone. Returns the directory.
        """
        from schedc.codegen.generate import render_programs
        from schedc.export import write_timeline, write_torch_csvs, write_trace
        from schedc.schedule_io import write_schedule

        out = Path(dir)
        check_output_dir(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            write_schedule(tmp / "schedule.json", self.schedule, self.metrics)
            write_trace(tmp / "trace.json", self.schedule)
            write_timeline(tmp / "timeline.svg", self.schedule, self.metrics)
            write_torch_csvs(tmp, self.schedule)
            (tmp / "spec.sched").write_text(print_spec(self.spec), encoding="utf-8")
            programs = render_programs(self.spec, self.schedule, metrics=self.metrics, out_name=str(out))
            for name, text in programs.items():
                (tmp / name).write_text(text, encoding="utf-8")
            if not out.exists():
                os.replace(tmp, out)
            else:
                # Everything is written; moving the files in is the only step left.
                for p in [*out.glob("pipeline_*.csv"), *out.glob("rank_*.py")]:
                    p.unlink()  # stale CSVs or programs of an earlier schedule would mislead
                for p in sorted(tmp.iterdir()):
                    os.replace(p, out / p.name)
                tmp.rmdir()
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return out


def check_output_dir(out: Path) -> None:
    """E558 unless `out` is (or can be made) a directory schedc can write into: before a compile,
    not after its solve."""
    from schedc.diagnostics import RunError, error

    if out.exists() and not out.is_dir():
        raise RunError([error("E558", f"cannot write the plan to `{out}`: it is a file, not a directory",
                              hint="give -o a directory (it is created if missing)")])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        probe.rmdir()
    except OSError as exc:
        raise RunError([error("E558", f"cannot write the plan to `{out}`: {exc.strerror or exc}",
                              hint="give -o a directory you can write to")]) from None


def read_plan(dir: str | os.PathLike) -> Plan:
    """The plan `schedc compile -o dir` (or `Plan.write`) wrote: its spec.sched and schedule.json,
    re-verified and re-simulated. E550 when `dir` holds no compiled plan."""
    from schedc.diagnostics import RunError
    from schedc.load import load
    from schedc.schedule_io import read_schedule

    folder = Path(dir)
    missing = [name for name in ("spec.sched", "schedule.json") if not (folder / name).is_file()]
    if missing:
        what = "does not exist" if not folder.exists() else (
            "is not a directory" if not folder.is_dir() else f"has no {' and no '.join(missing)}")
        raise RunError([error("E550", f"`{folder}` {what}: it is not a compiled plan",
                              hint="compile one first: `schedc compile SPEC -o " + str(folder) + "`")])
    spec = load(folder / "spec.sched")
    schedule, raw = read_schedule(folder / "schedule.json")
    if (schedule.instance.dp, schedule.instance.pp) != (spec.dp, spec.pp):
        raise RunError([error("E550", f"`{folder}`: schedule.json is for {schedule.instance.dp}x"
                                      f"{schedule.instance.pp} GPUs but spec.sched for {spec.dp}x{spec.pp}",
                              hint="recompile the spec into a fresh directory")])
    verify_schedule(schedule)
    return Plan(spec=spec, schedule=schedule,
                metrics=metrics_of(schedule, simulate(schedule),
                                   fault_free_iteration_time=raw.get("fault_free_iteration_time")))


def _load(spec: Spec | str | os.PathLike) -> Spec:
    if isinstance(spec, Spec):
        return spec
    from schedc.load import load

    return load(spec)


def _solver(spec: Spec, name: str | None):
    from schedc.solvers import get_solver, solver_names

    chosen = name or spec.schedule.solver
    known = solver_names()
    if chosen not in known:
        hint = did_you_mean(chosen, known)
        span = spec.span("schedule.solver") if name is None else None
        raise SpecError([error(
            "E215", f"unknown solver `{chosen}`", span, label=hint or "unknown solver",
            hint=(hint + " " if hint else "") + "known solvers: " + ", ".join(known))],
            sources=spec.sources)
    return chosen, get_solver(chosen)


def compile(spec: Spec | str | os.PathLike, *, solver: str | None = None,
            time_limit: float | None = None, seed: int = 0) -> Plan:
    """Compile a spec (a `Spec`, spec text, or a path) into a verified, simulated `Plan`.

    `solver` overrides `spec.schedule.solver`; `time_limit` (seconds)
    overrides `spec.schedule.time_limit`. Deterministic for the same input.

    >>> plan = compile("specs/example.sched", solver="1f1b")  # doctest: +SKIP
    >>> plan.metrics.iteration_time  # doctest: +SKIP
    """
    if time_limit is not None and not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit)
                                       and time_limit > 0):
        from schedc.diagnostics import RunError, error

        raise RunError([error("E206", f"the time limit must be a positive number of seconds, got {time_limit}",
                              hint="e.g. --time-limit 2 (or leave it out: the spec's `schedule.time_limit`)")])
    spec = _load(spec)
    try:
        return _compile(spec, solver, time_limit, seed)
    except SchedcError as exc:
        # Diagnostics raised past the parser may point into the spec: let them show its lines.
        for file, text in spec.sources.items():
            exc.sources.setdefault(file, text)
        raise


def _compile(spec: Spec, solver: str | None, time_limit: float | None, seed: int) -> Plan:
    from schedc.solvers import SolveOptions

    name, solve = _solver(spec, solver)
    options = SolveOptions(time_limit=spec.schedule.time_limit if time_limit is None else time_limit,
                           seed=seed)
    instance = from_spec(spec)
    started = time.perf_counter()
    schedule = solve(instance, options)
    if schedule.solver.wall_s == 0.0:
        schedule = replace(schedule, solver=replace(schedule.solver, wall_s=time.perf_counter() - started))
    verify_schedule(schedule)
    sim = simulate(schedule)
    fault_free = sim.iteration_time  # a fault-free instance is its own fault-free reference
    if not instance.fault_free:
        ff = solve(instance.without_failures(), options)
        verify_schedule(ff)
        fault_free = simulate(ff).iteration_time
    return Plan(spec=spec, schedule=schedule,
                metrics=metrics_of(schedule, sim, fault_free_iteration_time=fault_free))
