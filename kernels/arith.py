"""Integer arithmetic on sizes (tiles, groups, alignments), without needing triton.cdiv."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """How many b-sized pieces cover a."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= a."""
    return ceil_div(a, multiple) * multiple
