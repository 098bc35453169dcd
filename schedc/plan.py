"""`schedc.compile(spec) -> Plan`: spec to verified, simulated schedule (docs/architecture.md).

    spec --from_spec--> Instance --solver--> Schedule --verify_schedule--> (checked)
         --simulate--> Metrics

The fault-free iteration time comes from the same solver on the same
instance with every GPU live at full speed (skipped when the instance is
fault-free already: it is the iteration time itself); it gets
`REFERENCE_SHARE` of the work budget and the plan the rest, and it is
planned once per process for every failure set of a spec. Never prints, never
exits; every problem is a `SchedcError` carrying diagnostics.

`Plan.write(dir)` writes what `schedc compile -o dir` writes: schedule.json,
trace.json, timeline.svg, the torch CSVs where expressible, spec.sched and
the per-rank programs.
Files go to a temporary directory beside `dir` first and are renamed into
place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from schedc.diagnostics import SchedcError, SpecError, did_you_mean, error
from schedc.instance import Instance, from_spec
from schedc.limits import seconds_problem
from schedc.printer import print_spec
from schedc.program_diff import changed_ranks
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
    #: Set by `schedc.replan`: the schedule of the plan it started from (for `changed_ranks`).
    previous: Schedule | None = field(default=None, repr=False, compare=False)

    @cached_property
    def changed_ranks(self) -> frozenset[int] | None:
        """The schedule ranks (GPUs) whose program changed from the plan `schedc.replan` started
        from (`program_diff.changed_ranks`), so a launcher reconfigures only those; None for a
        plan that was compiled, not replanned. Computed when first asked (a few ms at 64 GPUs),
        outside the replan's deadline."""
        if self.previous is None:
            return None
        return changed_ranks(self.previous, self.schedule)

    @property
    def instance(self) -> Instance:
        return self.schedule.instance

    def programs(self, out_name: str = "OUT") -> dict[str, str]:
        """File name -> text of the programs `write` writes (rank or class programs, main.py,
        programs.json); `out_name` is the folder their headers name. The `redundant` baseline
        models Bamboo for comparison: its holders would run another stage's layers, which the
        runtime does not do, so it gets none."""
        from schedc.codegen.generate import render_programs

        if self.instance.redundant_forward:
            return {}
        return render_programs(self.spec, self.schedule, metrics=self.metrics, out_name=out_name)

    def write(self, dir: str | os.PathLike, *, programs: dict[str, str] | None = None) -> Path:
        """Write what `schedc compile -o dir` writes into `dir`.

        schedule.json, trace.json, timeline.svg, pipeline_{d}.csv (where
        expressible), spec.sched, and the per-rank programs (rank_NN.py,
        main.py, programs.json) that `schedc run dir` or torchrun execute.
        Into an existing `dir` the switch is atomic: the new plan is written
        to a folder beside it, the user's other files there are hard-linked in,
        and the two folders are exchanged in one step, so a reader (or a kill)
        sees the old plan or the new one, never a mix; what a killed write
        left beside `dir` is removed by the next. `programs`: what `programs`
        gave for this folder, when the caller rendered them already. Returns
        the directory.
        """
        from schedc.export import write_timeline, write_torch_csvs, write_trace
        from schedc.schedule_io import write_schedule

        out = Path(dir)
        if out.is_symlink():  # the plan goes into the link's target; the link stays the user's
            out = out.resolve()
        check_output_dir(out)
        _remove_stale_temporaries(out)
        tmp = _new_folder_beside(out)
        try:
            write_schedule(tmp / "schedule.json", self.schedule, self.metrics)
            write_trace(tmp / "trace.json", self.schedule)
            write_timeline(tmp / "timeline.svg", self.schedule, self.metrics)
            write_torch_csvs(tmp, self.schedule)
            (tmp / "spec.sched").write_text(print_spec(self.spec), encoding="utf-8")
            if programs is None:
                programs = self.programs(str(out))
            for name, text in programs.items():
                (tmp / name).write_text(text, encoding="utf-8")
            if not out.exists():
                os.replace(tmp, out)
            else:
                _keep_other_files(out, tmp)
                shutil.copymode(out, tmp)  # a folder written again keeps the mode it had
                _switch(tmp, out)  # one atomic step: `out` is the old plan or the new, never a mix
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return out


#: What `Plan.write` puts in a folder; anything else there is the user's and is kept.
_WRITTEN = ("schedule.json", "trace.json", "timeline.svg", "spec.sched", "main.py", "programs.json")


#: The names of the per-pipeline and per-rank files a plan writes (`codegen.generate`): only these
#: are a plan's; a user's `rank_analysis.py` or `pipeline_results.csv` beside it is kept.
_WRITTEN_PATTERN = re.compile(r"^(?:pipeline_\d+\.csv|rank_\d+\.py|program_c\d+_\d+\.py)$")


def _is_written(name: str) -> bool:
    return name in _WRITTEN or _WRITTEN_PATTERN.match(name) is not None


def _temporary_prefix(out: Path) -> str:
    return f".{out.name}.schedc-{os.getpid()}-"


def _new_folder_beside(out: Path) -> Path:
    """A new empty folder beside `out` (named by `_temporary_prefix`) that becomes `out`, made as
    `mkdir` makes any folder: 0777 less the umask (0755 under umask 022). `tempfile.mkdtemp`
    makes it 0700 whatever the umask, and the rename would hand that to `out`."""
    prefix = _temporary_prefix(out)
    for _ in range(100):  # (a name taken: a left-over of this pid, or a 1-in-4-billion clash)
        path = out.parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free name for a temporary folder", str(out.parent))


def _remove_stale_temporaries(out: Path) -> None:
    """Delete what a killed `Plan.write` into `out` left beside it (its process is gone)."""
    for stale in out.parent.glob(f".{out.name}.schedc-*-*"):
        pid = stale.name[len(f".{out.name}.schedc-"):].split("-", 1)[0]
        if not pid.isdigit() or not stale.is_dir() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # another compile is writing into the same folder right now
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            continue


def _keep_other_files(out: Path, new: Path) -> None:
    """Hard-link (or copy) into `new` what the user keeps in `out` beside a plan (saved weights,
    notes), so that the switch keeps them; files of the old plan are left behind."""
    for entry in out.iterdir():
        if _is_written(entry.name) or (new / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _switch(new: Path, out: Path) -> None:
    """Make `new` the folder `out`, atomically: exchange the two (Linux's renameat2), then delete
    the old one, now at `new`. Where exchange is not supported: two renames, during which `out`
    is briefly missing (never mixed)."""
    if _exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=_temporary_prefix(out), dir=out.parent))
    old.rmdir()
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def check_output_dir(out: Path) -> None:
    """E558 unless `out` is (or can be made) a directory schedc can write into: before a compile,
    not after its solve."""
    from schedc.diagnostics import RunError, error

    if out.exists() and not out.is_dir():
        raise RunError([error("E558", f"cannot write the plan to `{out}`: it is a file, not a directory",
                              hint="give -o a directory (it is created if missing)")])
    if out.is_dir() and (out.resolve() == Path.cwd().resolve() or out.resolve() in Path.cwd().resolve().parents):
        raise RunError([error("E558", f"cannot write the plan to `{out}`: it is the folder you are in (or holds "
                                      "it), and a plan's folder is switched as a whole",
                              hint="give -o a folder of its own, e.g. -o out")])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        probe.rmdir()
    except OSError as exc:
        raise RunError([error("E558", f"cannot write the plan to `{out}`: {exc.strerror or exc}",
                              hint="give -o a directory you can write to")]) from None


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """E558 before anything runs when the file `path` cannot be written (not after an hour of
    training or a solve): a directory, a missing or read-only folder, a folder that is a file."""
    from schedc.diagnostics import RunError, error

    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        problem = "is a directory"
    elif not parent.exists():
        problem = f"is in `{parent}`, which does not exist"
    elif not parent.is_dir():
        problem = f"is under `{parent}`, which is not a directory"
    elif not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        problem = f"cannot be written (`{parent}` or the file is read-only)"
    else:
        return
    raise RunError([error("E558", f"{what} `{path}` {problem}", hint="choose a file in a writable directory")])


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
                                   fault_free_iteration_time=raw.get("fault_free_iteration_time"),
                                   fault_free_solver=raw.get("fault_free_solver")))


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
            time_limit: float | None = None, seed: int = 0, symmetric: bool | None = None) -> Plan:
    """Compile a spec (a `Spec`, spec text, or a path) into a verified, simulated `Plan`.

    `solver` overrides `spec.schedule.solver`; `time_limit` (seconds)
    overrides `spec.schedule.time_limit`. Deterministic for the same input.
    `symmetric`: plan by classes of alike pipelines (`schedc.decompose`) whenever at
    least one pipeline repeats another: None (the default) from 1,024 GPUs on, True at
    any size, False never (every pipeline op by op).

    >>> plan = compile("specs/example.sched", solver="1f1b")  # doctest: +SKIP
    >>> plan.metrics.iteration_time  # doctest: +SKIP
    """
    problem = None if time_limit is None else seconds_problem(time_limit, "the time limit")
    if problem:  # (the spec's `schedule.time_limit` range)
        from schedc.diagnostics import RunError, error

        raise RunError([error("E206", problem,
                              hint="e.g. --time-limit 2 (or leave it out: the spec's `schedule.time_limit`)")])
    spec = _load(spec)
    try:
        return _compile(spec, solver, time_limit, seed, symmetric)
    except SchedcError as exc:
        # Diagnostics raised past the parser may point into the spec: let them show its lines.
        for file, text in spec.sources.items():
            exc.sources.setdefault(file, text)
        raise


#: Share of a compile's work budget (`time_limit`) that the fault-free reference gets when it
#: must be planned (a spec with failed or slow GPUs); the plan gets the rest, so that the whole
#: compile, reference included, costs about `time_limit` (it took twice that when each got all of
#: it). The reference is planned once per process for every failure set of a spec
#: (`_REFERENCES`). Check: `python bench/compile_budget.py`, whose `wall / limit` column should stay
#: near 1 on a quiet machine for compiles whose every search spends its budget.
REFERENCE_SHARE = 0.25
#: Fault-free references planned in this process: (instance, solver, work budget, seed,
#: symmetric) -> (iteration time, solver). Deterministic like the planning it saves, so a hit
#: gives what planning again would; small, as a grid or a bench compiles a few specs at a time.
_REFERENCES: dict[tuple, tuple[int, str]] = {}
_REFERENCES_KEPT = 32


def _compile(spec: Spec, solver: str | None, time_limit: float | None, seed: int,
             symmetric: bool | None) -> Plan:
    from schedc.solvers import SolveOptions

    name, solve = _solver(spec, solver)
    budget = spec.schedule.time_limit if time_limit is None else time_limit
    instance = from_spec(spec)
    share = 1.0 if instance.fault_free else 1.0 - REFERENCE_SHARE
    options = SolveOptions(time_limit=budget * share, seed=seed)
    started = time.perf_counter()
    solve = _by_classes(solve, name, symmetric)
    schedule = solve(instance, options)
    verify_schedule(schedule)
    sim = simulate(schedule)
    fault_free, reference = _fault_free_reference(instance, name, solve, SolveOptions(
        time_limit=budget if instance.fault_free else budget * REFERENCE_SHARE, seed=seed),
        sim.iteration_time, symmetric)
    # The whole planning time, the reference's (or its lookup) and the checks included: what a
    # user waits for, and what `time_limit` is calibrated against.
    schedule = replace(schedule, solver=replace(schedule.solver, wall_s=time.perf_counter() - started))
    return Plan(spec=spec, schedule=schedule,
                metrics=metrics_of(schedule, sim, fault_free_iteration_time=fault_free,
                                   fault_free_solver=reference))


def _by_classes(solve, name: str, symmetric: bool | None):
    """`solve`, planning by classes of alike pipelines where `symmetric` asks for it
    (`decompose.classes_for`)."""
    from schedc.decompose import classes_for, plan_by_classes
    from schedc.solvers import get_solver

    if symmetric is False:
        return solve

    def solve_by_classes(instance, options):
        dec = classes_for(instance, symmetric, name)
        if dec is None:
            return solve(instance, options)
        return plan_by_classes(instance, dec, solve, options, name, fallback=get_solver("greedy"))
    return solve_by_classes


def _fault_free_reference(instance, name: str, solve, options, own_time: int,
                          symmetric: bool | None = None) -> tuple[int, str]:
    """(iteration time, solver) of the reference every slowdown is measured against: the best of
    this solver's fault-free plan and greedy's, so that a faster plan never shows a larger
    slowdown than a slower one because its solver's own fault-free plan was better. (CP-SAT
    starts from greedy's plan and never returns a worse one: for cpsat its own plan is the best.)
    `options` is the reference's own work budget; what is planned here is kept (`_REFERENCES`):
    it is the same for every failure set of a spec."""
    from schedc.solvers import get_solver

    if instance.fault_free and name in ("greedy", "cpsat"):
        return own_time, name
    plain = instance if instance.fault_free else instance.without_failures()
    key = (plain, name, options.time_limit, options.seed, symmetric,
           own_time if instance.fault_free else None)
    if key in _REFERENCES:
        return _REFERENCES[key]
    times = {}
    if instance.fault_free:
        times[name] = own_time
    else:
        own = solve(plain, options)
        verify_schedule(own)
        times[name] = simulate(own).iteration_time
    if name not in ("greedy", "cpsat"):
        ref = _by_classes(get_solver("greedy"), "greedy", symmetric)(plain, options)
        verify_schedule(ref)
        times["greedy"] = simulate(ref).iteration_time
    best = min(times, key=lambda n: (times[n], n != name))
    _REFERENCES[key] = (times[best], best)
    while len(_REFERENCES) > _REFERENCES_KEPT:
        del _REFERENCES[next(iter(_REFERENCES))]
    return times[best], best
