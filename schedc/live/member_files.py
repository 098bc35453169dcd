"""A live member's state on disk (`StageFiles`, a mixin of `schedc.live.member.LiveWorker`):
its stage's periodic checkpoints (written by a side thread while training goes on), the dump
generation's files (the survivors' states before every process restarts, `--shadow`), and
restores (the initial weights, or a checkpoint: of this rank's split, or of another split,
re-sharded onto its layers, `schedc.live.reshard`). The lowest live rank of each stage writes
for it: every member of a stage holds the same state."""

from __future__ import annotations

from pathlib import Path

from schedc.diagnostics import RunError
from schedc.live import checkpoint, reshard
from schedc.live.membership import Generation
from schedc.live.protocol import CheckpointFailed, CheckpointWritten


class StageFiles:
    """Checkpoints, dumps and restores of a `LiveWorker` (the module docstring)."""

    def _dump(self, gen: Generation) -> None:
        """A dump generation (a stage lost on every GPU, --shadow): the lowest member of each stage
        writes its stage, and for a stage no member holds, the first holder with a valid shadow
        of it writes the shadow, as the run's checkpoint after this many steps. Written here, not
        on the side thread: the generation is ready once they are on disk."""
        if self._side_pool is not None:
            self._side_pool.shutdown(wait=True)  # (a periodic checkpoint still being saved comes first)
            self._side_pool = None
        coords = gen.manifest["coords"]
        if self._stage_writer(gen):
            layers = None if self.rt.partition is None else self.rt.partition[self.rt.stage]
            self._write_stage(gen, self.rt.stage, self.rt.stage_state(), layers, self.rt.model_layers)
        copy = self.shadow
        if copy is None or not self._shadow_valid():
            return
        owners = [r for r in gen.members if coords[str(r)][1] == copy.stage]
        if not owners and self.job.store.add(f"g{gen.number}/dump/stage{copy.stage}", 1) == 1:
            self._write_stage(gen, copy.stage, copy.state(), copy.layers, copy.model_layers)

    def _write_stage(self, gen: Generation, stage: int, state: dict, layers, model_layers) -> None:
        steps = int(state["steps"])
        where = dict(rank=self.rank, stage=stage, iteration=steps, gen=gen.number)
        try:
            checkpoint.write_stage(Path(self.config.checkpoint_dir), steps, stage, state, gen.number)
        except Exception as exc:  # a full or read-only disk: the supervisor says so and restores an older one
            self.job.report(CheckpointFailed(reason=_reason(exc), **where))
            return
        self.job.report(CheckpointWritten(**where, layers=layers, model_layers=model_layers))

    def _restore(self, restore: str) -> None:
        if restore == "initial":
            state = self.rt.initial_stage_state()
        else:
            found = checkpoint.read(Path(restore))
            if checkpoint.split_differs(found.meta, self.rt.manifest.pp, self.rt.partition):
                layers = None if self.rt.partition is None else self.rt.partition[self.rt.stage]
                state = reshard.reshard_stage(found, layers, self.rt.module)
            else:
                state = checkpoint.load_stage(found, self.rt.stage)
        try:
            self.rt.load_stage_state(state)
        except RuntimeError as exc:  # torch's load_state_dict: a checkpoint of another model
            if restore == "initial":
                raise
            raise _not_this_model(restore, self.rt.stage, exc) from None
        self.snapshot.invalidate()
        if self.shadow is not None:  # the shadowed stage, from the same state
            copy = self.shadow
            if restore == "initial":
                copy.load(self.rt.initial_stage_state(copy.stage))
            elif checkpoint.split_differs(found.meta, self.rt.manifest.pp, copy.partition):
                copy.load(reshard.reshard_stage(found, copy.layers, copy.module))
            else:
                copy.load(checkpoint.load_stage(found, copy.stage))

    def _maybe_checkpoint(self, gen: Generation) -> None:
        every = self.config.checkpoint_every
        steps = self.rt.steps_done
        if not every or steps % every or not self._stage_writer(gen):
            return
        state = self.rt.stage_state()  # copies: training goes on while a thread saves them
        root, stage = Path(self.config.checkpoint_dir), self.rt.stage  # (as now: a move may replace `rt` first)
        where = dict(rank=self.rank, stage=stage, iteration=steps, gen=gen.number)
        split = dict(layers=None if self.rt.partition is None else self.rt.partition[self.rt.stage],
                     model_layers=self.rt.model_layers)

        def save() -> None:
            try:
                checkpoint.write_stage(root, steps, stage, state, gen.number)
            except Exception as exc:  # a full or read-only disk: the supervisor says so; training goes on
                self._side_job.report(CheckpointFailed(reason=_reason(exc), **where))
                return
            self._side_job.report(CheckpointWritten(**where, **split))

        self._side().submit(save)

    def _stage_writer(self, gen: Generation) -> bool:
        """The lowest live rank of this stage writes for it (every member holds the same state)."""
        coords = gen.manifest["coords"]
        mine = [r for r in gen.members if coords[str(r)][1] == self.rt.stage]
        return self.rank == min(mine)


def _not_this_model(restore: str, stage: int, exc: RuntimeError) -> RunError:
    """E570 for a checkpoint whose stage does not load into the plan's model (other shapes,
    other layers: the model changed since the run that wrote it), with torch's first reason."""
    from schedc.diagnostics import error

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = lines[1] if len(lines) > 1 else (lines[0] if lines else type(exc).__name__)
    return RunError([error("E570", f"checkpoint `{restore}` does not fit the plan's model at stage {stage}: "
                                   f"{why[:300]}",
                           hint="resume with the model the run that wrote it trained (model.source and the "
                                "sizes it builds), or start without --resume (another --checkpoint-dir)")])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RunError):
        return exc.diagnostics[0].message
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]
