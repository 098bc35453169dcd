"""A tiny MLP: `blocks` Linear+ReLU blocks and a linear head, MSE loss.

Bind it in a spec with ``model { source = "schedc.models.mlp:build" }``; its
data comes from `batch` unless `model.data` names another function.
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 16
HIDDEN = 32
OUT_FEATURES = 4
BLOCKS = 6
MICROBATCH_SIZE = 4
SEED = 0


def build(blocks: int = BLOCKS, hidden: int = HIDDEN) -> tuple[nn.Sequential, nn.Module]:
    """`blocks` Linear+ReLU blocks then a linear head: ``blocks + 1`` layers.

    Seeds itself (without disturbing the caller's random state), so every
    rank builds the same initial weights.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        layers: list[nn.Module] = []
        width = IN_FEATURES
        for _ in range(blocks):
            layers.append(nn.Sequential(nn.Linear(width, hidden), nn.ReLU()))
            width = hidden
        layers.append(nn.Linear(width, OUT_FEATURES))
    return nn.Sequential(*layers), nn.MSELoss()


def batch(iteration: int, dp: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `microbatch` of pipeline `dp` in `iteration`: a pure function of the three."""
    g = torch.Generator().manual_seed(_seed(iteration, dp, microbatch))
    x = torch.randn(MICROBATCH_SIZE, IN_FEATURES, generator=g)
    y = torch.randn(MICROBATCH_SIZE, OUT_FEATURES, generator=g)
    return x, y


def _seed(iteration: int, dp: int, microbatch: int) -> int:
    # Distinct for every (iteration, dp, microbatch) a run can use (< 2**20 each).
    return 1 + (iteration << 40) + (dp << 20) + microbatch
