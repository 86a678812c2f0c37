"""How far a result is from its reference: the one error measure the tests and the benchmarks
share."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when either holds NaN."""
    a, b = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
