"""Wider versions of `schedc.models.mlp` for the catch-up benchmark (bench/live_slowness.py):
the state a rejoining GPU fetches grows with the square of the width."""

from schedc.models.mlp import build


def build_256():
    return build(hidden=256)


def build_1024():
    return build(hidden=1024)


def build_2048():
    return build(hidden=2048)
