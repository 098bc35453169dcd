"""Checkpoints of a live run: complete, atomic, one file per stage.

Layout under the checkpoint directory (default ``OUT/checkpoints``)::

    iter-000006/            a complete checkpoint: the state after 6 steps
        stage-0.pt ...      one per stage: weights and optimizer state
        meta.json           written last, inside the staging directory
    .partial-000008/        one being written (ignored, removed on the next start)
    latest                  "iter-000006"

How a checkpoint stays whole: after its optimizer step that completes K
steps, one GPU of each stage (the lowest live rank) saves its stage into
``.partial-K/stage-S.gG.pt``, G its generation (a temporary name, then a
rename). When every stage has reported its file, the supervisor renames the
files it was told of to ``stage-S.pt`` (a late writer of an earlier generation,
of another layout or from before a rollback, writes a file of its own name and
never replaces one of them), writes ``meta.json`` into the staging directory
and renames the directory to ``iter-K``: one atomic step,
so a reader sees either the whole checkpoint or none of it. ``latest`` is
then replaced the same way. A run killed at any moment leaves the previous
complete checkpoint as it was. On several hosts the directory must be on a
file system all of them see.

Every GPU of a stage holds the same weights, so any one of them can write
it, and any checkpoint restores any plan of the same model and stage count.
``meta.json`` also records the run's split of the model (``partition``: layers
[a, b) of each stage, ``model_layers``), ``dp`` and ``microbatches``: with
those, a checkpoint restores a plan of the same model, data-parallel width
and microbatches split into another number of stages, re-sharded by
`schedc.live.reshard` (`check_resumable` says when it cannot).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from schedc.diagnostics import RunError, error

FORMAT = "schedc.checkpoint/v1"
LATEST = "latest"
_COMPLETE = re.compile(r"^iter-(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    iteration: int  # steps applied = the next iteration to run
    meta: dict

    def stage_file(self, stage: int) -> Path:
        return self.path / f"stage-{stage}.pt"


def _name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def staging_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f".partial-{iteration:06d}"


def _staged_name(stage: int, generation: int | None) -> str:
    """A stage's file in a staging directory: tagged with the generation that wrote it."""
    return f"stage-{stage}.pt" if generation is None else f"stage-{stage}.g{generation}.pt"


def write_stage(root: Path, iteration: int, stage: int, state: dict, generation: int | None = None) -> Path:
    """Save one stage's state for the checkpoint after `iteration` steps (a worker of generation
    `generation` calls this; the file is `complete`'s to seal once the supervisor counts it)."""
    import torch

    folder = staging_dir(root, iteration)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / _staged_name(stage, generation)
    tmp = folder / f".stage-{stage}.pt.{os.getpid()}.tmp"
    torch.save({"format": FORMAT, "stage": stage, "iteration": iteration, **state}, tmp)
    os.replace(tmp, final)
    return final


def complete(root: Path, iteration: int, stages: int, meta: dict, keep: int = 2, *,
             generations: dict[int, int] | None = None, protect: frozenset[str] = frozenset()) -> Checkpoint:
    """Seal the staged checkpoint after `iteration` steps (every stage file present: stage S's
    is the one generation `generations[S]` wrote, or an untagged one), make it `latest`, and
    keep the newest `keep` complete checkpoints, and those named in `protect` (one a generation
    is restoring). Ctrl-C (or SIGTERM) waits until this is done (`_interrupts_deferred`), so it
    never leaves a checkpoint half sealed or half pruned."""
    with _interrupts_deferred():
        return _complete(Path(root), iteration, stages, meta, keep, generations or {}, protect)


@contextlib.contextmanager
def _interrupts_deferred():
    """SIGINT and SIGTERM held back while the block runs (in the main thread, where Python
    delivers them), then delivered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _complete(root: Path, iteration: int, stages: int, meta: dict, keep: int, generations: dict[int, int],
              protect: frozenset[str]) -> Checkpoint:
    folder = staging_dir(root, iteration)
    files = {s: folder / _staged_name(s, generations.get(s)) for s in range(stages)}
    missing = [s for s, f in files.items() if not f.exists()]
    if missing:
        raise RunError([error("E571", f"checkpoint after {iteration} steps lacks stages {missing}")])
    for s, f in files.items():
        os.replace(f, folder / f"stage-{s}.pt")
    for stray in folder.glob("stage-*.g*.pt"):  # late files of other generations: never part of it
        stray.unlink(missing_ok=True)
    meta = {"format": FORMAT, "iteration": iteration, "stages": stages, **meta}
    tmp = folder / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / "meta.json")
    final = root / _name(iteration)
    old = root / f".replaced-{iteration:06d}"
    if final.exists():  # the same boundary sealed before a rollback: the newer files replace it
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # moved aside, not deleted, until the new one is in place
    os.replace(folder, final)
    shutil.rmtree(old, ignore_errors=True)
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)
    for old in [c for c in complete_checkpoints(root)[:-keep] if c.path.name not in protect] if keep > 0 else []:
        # Renamed first (one atomic step), then removed: a run killed meanwhile leaves a
        # `.replaced-` folder the next start removes, never an `iter-` folder without its meta.json.
        gone = root / f".replaced-{old.iteration:06d}"
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(old.path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return Checkpoint(final, iteration, meta)


def complete_checkpoints(root: Path) -> list[Checkpoint]:
    """Every complete checkpoint under `root`, oldest first."""
    return scan(root)[0]


def scan(root: Path) -> tuple[list[Checkpoint], list[tuple[Path, str]]]:
    """Every complete checkpoint under `root`, oldest first, and each `iter-` folder that is not
    one (its meta.json missing, unreadable, not JSON, or not a checkpoint's) with the reason."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    out, damaged = [], []
    for p in root.iterdir():
        m = _COMPLETE.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            meta = json.loads((p / "meta.json").read_text())
        except FileNotFoundError:
            damaged.append((p, "it has no meta.json"))
            continue
        except OSError as exc:
            damaged.append((p, f"its meta.json cannot be read ({exc.strerror or exc})"))
            continue
        except ValueError as exc:
            damaged.append((p, f"its meta.json is not valid JSON ({exc})"))
            continue
        if isinstance(meta, dict) and meta.get("format") == FORMAT:
            out.append(Checkpoint(p, int(m.group(1)), meta))
        else:
            damaged.append((p, f"its meta.json is not a {FORMAT} checkpoint's"))
    return sorted(out, key=lambda c: c.iteration), sorted(damaged)


def latest(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read(path: Path) -> Checkpoint:
    """The checkpoint in directory `path` (E570 when it is not a complete one)."""
    path = Path(path)
    m = _COMPLETE.match(path.name)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise RunError([error("E570", f"`{path}` is not a complete schedc checkpoint ({exc})",
                              hint="pass a directory `iter-NNNNNN` that holds meta.json")])
    if not m or not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RunError([error("E570", f"`{path}` is not a {FORMAT} checkpoint")])
    return Checkpoint(path, int(m.group(1)), meta)


def load_stage(checkpoint: Checkpoint, stage: int) -> dict:
    import torch

    path = checkpoint.stage_file(stage)
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # a missing, truncated or foreign file (torch raises many kinds)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights only" in reason.lower() or "weights_only" in reason:  # (torch's advice to load it unsafely)
            reason = "it is damaged, or not a file schedc wrote (it does not load as plain tensors)"
        raise RunError([error("E570", f"cannot read stage {stage} of checkpoint `{checkpoint.path}`: {reason}",
                              hint="move this checkpoint's folder out of the checkpoint directory: --resume "
                                   "takes the newest complete one left")])
    if not isinstance(state, dict):
        raise RunError([error("E570", f"`{path}` is not stage {stage} of a {FORMAT} checkpoint")])
    if state.get("format") != FORMAT or state.get("stage") != stage:
        raise RunError([error("E570", f"`{path}` is not stage {stage} of a {FORMAT} checkpoint")])
    return state


def clean_partials(root: Path) -> list[Path]:
    """Remove staging directories a killed run left behind; returns what was removed. A run
    killed while it sealed a step again (between moving the old `iter-K` aside and renaming the
    new one into place) leaves two complete copies and no `iter-K`: the newer goes back in place."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = []
    for p in sorted(root.iterdir()):  # (".partial-" before ".replaced-": the newer copy first)
        m = re.match(r"^\.(?:partial|replaced)-(\d{6,})$", p.name)
        if m and (p / "meta.json").is_file() and not (root / _name(int(m.group(1)))).exists():
            os.replace(p, root / _name(int(m.group(1))))
            continue
        if p.name.startswith((".partial-", ".replaced-")) or (p.name.startswith(".") and p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p)
    return gone


class RunCheckpoints:
    """The supervisor's side of one run's checkpoints: the folder, the checkpoint it resumes
    from, and those it completes. It hears of each stage file as it is written and seals a
    checkpoint once every stage of it is there (`complete`).

    A stage file of step k written by generation g is void when a later generation resumed
    from fewer than k steps (a rollback undid step k): it will be written again. One written
    before the layout changed (`relayout`) is never part of a checkpoint of the new layout: its
    stage numbers and layers are the old layout's. A checkpoint a generation restores stays as
    it is until that generation is ready (`announced`): never pruned, nor sealed again.
    """

    def __init__(self, root: Path, stages: int, keep: int):
        self.root = Path(root)
        self.stages = stages
        self.keep = keep
        self.paths: list[str] = []  # this run's complete checkpoints (and the one it resumed from)
        self.written: dict[int, dict[int, tuple]] = {}  # steps -> stage -> (layers [a, b), model layers, generation)
        self.starts: dict[int, int] = {}  # generation -> the steps it resumed from
        self.restoring: dict[int, str] = {}  # generation, not yet ready -> the checkpoint folder it restores
        self.layout_from = 0  # the first generation of the current layout (`relayout`)

    def relayout(self, stages: int, generation: int) -> None:
        """From generation `generation` on, the run has another layout, of `stages` stages (a
        re-partition, a growth back): stage files of the layout before no longer count, nor do
        those that reach the supervisor later (a writer's side thread, a late queue)."""
        self.stages = stages
        self.layout_from = generation
        self.written.clear()

    def prepare(self, *, resume: bool, every: int, **plan) -> tuple[Checkpoint | None, list[str]]:
        """Before the run: the checkpoint to resume from (`resume`; E556/E570 when there is none
        that fits `plan`, as `check_resumable` takes it), refusing another run's checkpoints and
        an unwritable folder when `every` > 0; removes unfinished files. Returns the checkpoint
        and what to tell: a warning for each damaged checkpoint newer than it (passed over for
        an older one: that fallback said nothing), and the unfinished files removed."""
        found, notes = None, []
        if resume:
            complete, damaged = scan(self.root)
            found = complete[-1] if complete else None
            if found is None:
                raise RunError([_none_to_resume(self.root, damaged)])
            notes = [f"warning: skipped checkpoint `{p}`: {why}; resuming from the older `{found.path.name}`"
                     for p, why in damaged if int(_COMPLETE.match(p.name).group(1)) > found.iteration]
            check_resumable(found, stages=self.stages, **plan)
            self.paths.append(str(found.path))
        elif every and latest(self.root) is not None:
            # Another run's checkpoints: mixing them would make `latest` and pruning lie.
            raise RunError([error("E556", f"`{self.root}` holds checkpoints of an earlier run",
                                  hint="continue that run with --resume, or give this one another "
                                       "--checkpoint-dir (or remove the old checkpoints)")])
        if every:
            check_writable(self.root)
        removed = clean_partials(self.root)
        if removed:
            notes.append(f"removed {len(removed)} unfinished checkpoint file(s) of an earlier run")
        return found, notes

    def announced(self, generation: int, restore: str | None) -> None:
        """Generation `generation` is announced, restoring `restore` (a checkpoint folder, or
        "initial" or None): until it is ready (`resumed`), a late seal (a stage file of an earlier
        generation) neither prunes that checkpoint nor replaces it while its workers read it."""
        if restore not in (None, "initial"):
            self.restoring[generation] = Path(restore).name

    def resumed(self, generation: int, steps: int) -> None:
        """Generation `generation` resumed from `steps` steps: files of later steps are void."""
        self.starts[generation] = steps
        self.written = {k: v for k, v in self.written.items() if k <= steps}
        self.restoring = {g: name for g, name in self.restoring.items() if g > generation}

    def stage_written(self, generation: int, steps: int, stage: int, meta: dict, *,
                      layers: tuple[int, int] | None = None, model_layers: int | None = None) -> Checkpoint | None:
        """Stage `stage` of the checkpoint after `steps` steps is written (holding the model's
        layers [a, b) = `layers` of `model_layers`, as its writer resolved the split; None when
        emulated); the sealed checkpoint when it was the last stage missing. Its meta.json is
        `meta` and the split the stages reported (`partition`, `model_layers`)."""
        if generation < self.layout_from:
            return None  # the layout before's: its stages are not this layout's
        if any(start < steps for g, start in self.starts.items() if g > generation):
            return None  # written before a rollback undid step `steps`: it is written again
        protect = frozenset(self.restoring.values())
        if _name(steps) in protect:
            return None  # the checkpoint being restored: it holds these steps already
        stages = self.written.setdefault(steps, {})
        stages[stage] = (layers, model_layers, generation)
        if len(stages) < self.stages:
            return None
        del self.written[steps]
        ranges = [stages[s][0] for s in range(self.stages)]
        counts = {stages[s][1] for s in range(self.stages)}
        split = {"partition": [list(r) for r in ranges] if None not in ranges else None,
                 "model_layers": counts.pop() if len(counts) == 1 else None}
        done = complete(self.root, steps, self.stages, {**meta, **split}, keep=self.keep,
                        generations={s: stages[s][2] for s in range(self.stages)}, protect=protect)
        self.paths.append(str(done.path))
        return done

    def latest_own(self) -> Checkpoint | None:
        """The newest complete checkpoint this run wrote (or resumed from) that still exists."""
        for path in reversed(self.paths):
            if Path(path, "meta.json").is_file():
                return read(Path(path))
        return None


def _none_to_resume(root: Path, damaged: list[tuple[Path, str]]):
    """E556 when `root` holds no checkpoint; E570 naming each one that is damaged."""
    if not damaged:
        return error("E556", f"no complete checkpoint in `{root}` to resume from",
                     hint="train with --checkpoint-every K first, or drop --resume")
    lines = [f"  = note: skipped `{p.name}`: {why}" for p, why in damaged[:10]]
    if len(damaged) > 10:
        lines.append(f"  ... and {len(damaged) - 10:,} more")
    return error("E570", f"no checkpoint in `{root}` can be resumed: {len(damaged)} damaged one(s), none complete",
                 detail="\n".join(lines), hint="move the damaged folders out of the way and resume an intact "
                                                "copy, or train afresh without --resume")


def check_resumable(found: Checkpoint, *, stages: int, emulate: bool, optimizer: str, iterations: int,
                    dp: int | None = None, microbatches: int | None = None,
                    partition: tuple[tuple[int, int], ...] | None = None,
                    model_layers: Callable[[], int | None] | None = None) -> None:
    """E570/E556 when a run of this plan cannot resume from `found`.

    `partition` is the plan's own split when its spec gives one (else the even split is
    assumed). When that split differs from the checkpoint's, the checkpoint must record its
    split and match the plan's `dp`, `microbatches` and model layer count (`model_layers()`,
    called only then: it may build the model); workers then re-shard it (`schedc.live.reshard`).
    """
    for key, mine, what in (("emulate", emulate, "--emulate"), ("optimizer", optimizer, "optimizer")):
        if key in found.meta and found.meta[key] != mine:
            raise RunError([error("E570", f"checkpoint `{found.path}` was written with {key} = "
                                          f"{found.meta[key]!r}, this run has {mine!r}",
                                  hint=f"resume with the same {what} as the run that wrote it")])
    if split_differs(found.meta, stages, partition):
        _check_reshardable(found, stages=stages, emulate=emulate, dp=dp, microbatches=microbatches,
                           model_layers=model_layers)
    else:  # the same split: still the same data only with the same dp and microbatches (another batch: E570)
        _check_same_batch(found, dp=dp, microbatches=microbatches)
    if found.iteration >= iterations:
        raise RunError([error("E556", f"checkpoint `{found.path}` is after iteration {found.iteration - 1}: "
                                      f"nothing is left of the {iterations} iterations to run",
                              hint="run more iterations (--iterations)")])


def split_differs(meta: dict, stages: int, partition) -> bool:
    """Whether a plan of `stages` stages split as `partition` (None: the even split) holds other
    layers per stage than the checkpoint of `meta`: then its stage files must be re-sharded."""
    if meta.get("stages") != stages:
        return True
    recorded = meta.get("partition")
    if recorded is None:  # emulated, or written before checkpoints recorded their split
        return False
    if partition is None:
        from schedc.runtime.manifest import even_partition

        n = meta.get("model_layers")
        if not isinstance(n, int) or n < stages:
            return False  # no even split to compare with: the plan cannot run this model anyway
        partition = even_partition(n, stages)
    return [list(p) for p in partition] != [list(p) for p in recorded]


def _check_reshardable(found: Checkpoint, *, stages: int, emulate: bool, dp: int | None, microbatches: int | None,
                       model_layers: Callable[[], int | None] | None) -> None:
    """E570 unless `found` can be re-sharded onto a plan of `stages` stages: it records its split,
    and the plan trains the same model on the same data (dp, microbatches)."""
    meta, where = found.meta, f"checkpoint `{found.path}`"
    have = meta.get("stages")
    if "dp" not in meta or (not emulate and meta.get("partition") is None):
        raise RunError([error("E570", f"{where} has {have} stages but the plan has {stages}, and it does not "
                                      "record how its model was split into stages (written by an older schedc)",
                              hint=f"resume it with a plan of {have} stages, write a checkpoint there "
                                   f"(--checkpoint-every), then resume that one onto {stages} stages")])
    _check_same_batch(found, dp=dp, microbatches=microbatches)
    if emulate:
        return  # nothing but step counts to carry over
    recorded = meta["partition"]
    n = meta.get("model_layers")
    if not isinstance(n, int) or recorded[0][0] != 0 or recorded[-1][1] != n or any(
            a[1] != b[0] for a, b in zip(recorded, recorded[1:])):
        raise RunError([error("E570", f"{where} records a split {recorded} that does not cover its model's "
                                      f"{n} layers in order", hint="resume from another checkpoint")])
    mine = model_layers() if model_layers is not None else None
    if mine is not None and mine != n:
        raise RunError([error("E570", f"{where} holds a model of {n} layers, the plan's model has {mine}",
                              hint="resume with the same model (model.source and the model block's sizes); "
                                   "only the number of stages may change")])


def _check_same_batch(found: Checkpoint, *, dp: int | None, microbatches: int | None) -> None:
    """E570 unless the plan trains the checkpoint's data: the same dp and microbatches per
    pipeline, where the checkpoint records them (older ones do not: nothing to compare)."""
    meta, where = found.meta, f"checkpoint `{found.path}`"
    wrong = []
    if dp is not None and meta.get("dp") is not None and meta["dp"] != dp:
        wrong.append(error("E570", f"{where} has dp {meta['dp']}, the plan dp {dp}",
                           hint=f"resume onto the same data-parallel width: compile the new plan with "
                                f"cluster.dp = {meta['dp']} (only the number of stages may change)"))
    if microbatches is not None and meta.get("microbatches") is not None and meta["microbatches"] != microbatches:
        wrong.append(error("E570", f"{where} has {meta['microbatches']} microbatches per pipeline, "
                                   f"the plan {microbatches}",
                           hint=f"compile the new plan with train.microbatches = {meta['microbatches']}: "
                                "the same global batch, so the same training"))
    if wrong:
        raise RunError(wrong)


def check_writable(root: Path) -> None:
    """E558 unless checkpoints can be written under `root` (made if missing)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunError([error("E558", f"checkpoints cannot be written to `{root}`: {exc.strerror or exc}",
                              hint="give a writable --checkpoint-dir")])
