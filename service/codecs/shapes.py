"""Tensor shapes a client states: whether torch can lay them out at all."""

from __future__ import annotations

from collections.abc import Sequence

MAX_EXTENT = 2**63 - 1  # torch's sizes and strides are int64


def too_large(shape: Sequence[int]) -> bool:
    """Whether `shape`'s dimensions, a zero counted as one, multiply past MAX_EXTENT: torch's
    strides would overflow. A shape with a zero dimension holds no bytes, so no byte count
    catches it ([0, 2**63] is such a shape)."""
    extent = 1
    for size in shape:
        extent *= max(size, 1)
        if extent > MAX_EXTENT:  # stop before a long shape makes a huge product
            return True
    return False


def too_large_message(shape: Sequence[int]) -> str:
    return f"shape {list(shape)} is too large: its dimensions multiply past 2^63 - 1"
