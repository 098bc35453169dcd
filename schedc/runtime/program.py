"""Loading a generated program for one rank: from its file (`schedc run`, torchrun) or from its
text (`schedc train`, which ships programs through the job's store). One loader for both, so a
class program of a plan by classes is bound to its rank's copy the same way everywhere."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

from schedc.diagnostics import RunError, error
from schedc.runtime.manifest import Manifest


def load_program(out_dir: Path | str, manifest: Manifest, rank: int):
    """The program of schedule rank `rank` in `out_dir` (an object with `iteration(rt)`)."""
    path = Path(out_dir) / manifest.programs[rank]
    spec = importlib.util.spec_from_file_location(f"schedc_program_rank_{rank}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise RunError([error("E522", f"the program of rank {rank} (`{path}`) is missing",
                              hint="recompile: `schedc compile SPEC -o OUT`")])
    return bind(module, manifest, rank)


def program_from_text(text: str, where: str, manifest: Manifest, rank: int):
    """The program of schedule rank `rank` from its source `text` (`where` names it in tracebacks)."""
    module = types.ModuleType(f"schedc_program_rank_{rank}")
    exec(compile(text, where, "exec"), module.__dict__)
    return bind(module, manifest, rank)


def bind(module, manifest: Manifest, rank: int):
    """A class program (`manifest.copy_of`) runs with its rank's copy bound; others as they are."""
    if rank not in manifest.copy_of:
        return module
    table = manifest.copy_tables[manifest.copy_of[rank]]
    ranks, pipelines = tuple(table["ranks"]), tuple(table["pipelines"])
    return types.SimpleNamespace(iteration=lambda rt: module.iteration(rt, ranks, pipelines))
