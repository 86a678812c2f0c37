"""The two hardware ceilings, measured in the same run as the kernels they judge.

- copy bandwidth: a large device-to-device copy, counting bytes read plus bytes written;
- dense GEMM peak: a square torch.matmul in the layer's dtype, or torch._scaled_mm for fp8
  (per-tensor scales, bf16 output), counting 2 * n^3 flops.
"""

from __future__ import annotations

import torch

from ..kernels.quant_scheme import FP8
from ..kernels.timing import Timer

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sizes(device: torch.device) -> tuple[int, int]:
    """(copy bytes, GEMM n): big enough to fill an H100, small enough to be quick on a CPU."""
    return (2**30, 8192) if device.type == "cuda" else (2**24, 512)


def copy_bandwidth(timer: Timer, device: torch.device) -> float:
    """Bytes per second of dst.copy_(src) over a buffer far larger than the L2."""
    nbytes, _ = _sizes(device)
    src = torch.randn(nbytes // 4, device=device)  # random, not zeros: zeros can run faster
    dst = torch.empty_like(src)
    timing = timer.measure(lambda: dst.copy_(src))
    return 2 * nbytes / (timing.median_us * 1e-6)


def gemm_peak(timer: Timer, device: torch.device, precision: str) -> float:
    """FLOP/s of an n x n x n product in `precision` ("bf16", "fp16", "fp32" or "fp8")."""
    _, n = _sizes(device)
    if precision == "fp8":
        a = torch.randn(n, n, device=device).to(FP8)
        b = torch.randn(n, n, device=device).to(FP8).t()  # _scaled_mm wants B column-major
        one = torch.ones((), device=device)

        def product() -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    else:
        a = torch.randn(n, n, device=device, dtype=_DTYPES[precision])
        b = torch.randn(n, n, device=device, dtype=_DTYPES[precision])

        def product() -> torch.Tensor:
            return torch.matmul(a, b)

    timing = timer.measure(product)
    return 2 * n**3 / (timing.median_us * 1e-6)
