"""How far a result is from its reference, and how far it may be: the one error measure and the
one tolerance table the tests and the benchmarks share.

Each bound is on the relative L2 error against the exact reference backend run on the same
quantised weights, so it measures the backend's arithmetic only, not the quantisation of the
weights.
"""

from __future__ import annotations

import torch

from .config import MoEConfig
from .quant_scheme import ActQuant


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when either holds NaN."""
    a, b = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# 16-bit activations: products and the stored intermediate round to the activation dtype.
BY_DTYPE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# fp8 activations: the intermediate is re-quantised; a value on an fp8 rounding midpoint may go
# either way, a whole fp8 step.
FP8_ACTIVATIONS = 3e-2
# The benchmark checks the first rows of a larger batch: with one fp8 scale for the whole
# tensor, the backend's scale comes from all M rows, the reference's from the checked rows only.
FP8_TENSOR_SCALE_ON_FEWER_ROWS = 1e-1
# The demo fp8 layer served over HTTP on a GPU against the reference on the CPU
# (tests/service/test_gpu.py): fp8 rounds the inputs and the intermediates.
SERVED_FP8_LAYER = 6e-2


def tolerance(cfg: MoEConfig, *, checked_rows_of_larger_batch: bool = False) -> float:
    """The bound for a backend running `cfg` (see the table above)."""
    act_quant = cfg.quant.spec.act_quant
    if act_quant is None:
        return BY_DTYPE[cfg.dtype]
    if checked_rows_of_larger_batch and act_quant == ActQuant.TENSOR:
        return FP8_TENSOR_SCALE_ON_FEWER_ROWS
    return max(BY_DTYPE[cfg.dtype], FP8_ACTIVATIONS)
