"""A user's own model for `schedc profile` tests: not one of schedc's, declares `hidden`."""

from __future__ import annotations

import torch
from torch import nn


class Mixer(nn.Module):
    """A residual block with a 1-d convolution (no nn.Linear: its weights get gradients in B)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=3, padding=1)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.proj(torch.tanh(y))


def build(hidden: int = 16):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        layers = [nn.Linear(8, hidden), Mixer(hidden), Mixer(hidden), nn.Linear(hidden, 2)]
    return nn.Sequential(*layers), nn.MSELoss()


def batch(iteration: int, dp: int, microbatch: int):
    g = torch.Generator().manual_seed(7 + (iteration << 20) + (dp << 10) + microbatch)
    return torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 2, generator=g)
