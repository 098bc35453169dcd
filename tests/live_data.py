"""`model.data` functions that misbehave on purpose, for the live-run tests (no tests here)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from schedc.models import mlp

#: Created by the first process that gets stuck; the tests remove it before a run.
STUCK_MARKER = Path(tempfile.gettempdir()) / f"schedc-test-stuck-{os.getuid()}"


def batch_stuck_once(iteration: int, dp: int, microbatch: int):
    """The MLP's data, but the first process to ask for microbatch (1, 0) of iteration 2 computes
    forever (an endless loop, not a wait): its heartbeat goes on, its ops stop."""
    if (iteration, dp, microbatch) == (2, 1, 0):
        try:
            os.close(os.open(STUCK_MARKER, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return mlp.batch(iteration, dp, microbatch)
        while True:
            pass
    return mlp.batch(iteration, dp, microbatch)


def batch_with_a_bug(iteration: int, dp: int, microbatch: int):
    """The MLP's data, until iteration 1 asks for microbatch (0, 1): a bug in the user's code."""
    if (iteration, dp, microbatch) == (1, 0, 1):
        raise ValueError("shard 17 is missing")
    return mlp.batch(iteration, dp, microbatch)


def mlp_with_a_plain_loss():
    """schedc's MLP with its loss a plain function (`torch.nn.functional.mse_loss`), as many
    models write it, not an nn.Module."""
    import torch

    layers, _ = mlp.build()
    return layers, torch.nn.functional.mse_loss


def mlp_with_a_loss_that_is_no_function():
    """A model source whose loss is not callable (a user's slip: a number where the loss goes)."""
    layers, _ = mlp.build()
    return layers, 0.5
