"""Dynamic fp8 quantisation of activation rows in Triton: `kernels.quantize.quantize_activation`
in one pass over the rows (two for a tensor-wide scale), capturable in a CUDA graph.

Same arithmetic as the torch twin: scale = max(amax, 1e-12) / 448 over the tensor, the row or
the row's 128 columns, q = fp8(clamp(x / scale, -448, 448)), rounded to nearest even by the GPU,
bit for bit the twin's result. Triton's CPU interpreter converts to fp8 without carrying a
rounded-up mantissa into the exponent (126.6 becomes 64), so on the CPU the twin runs instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.experts._triton.codes import ACT_PER_GROUP, ACT_PER_TENSOR, ACT_PER_TOKEN, ACT_SCALE
from kernels.quant_scheme import FP8, FP8_BLOCK, ActQuant
from kernels.quantize import quantize_activation

_TINY = 1e-12  # as kernels.quantize: all-zero rows keep a finite scale
_BLOCK = 128  # columns per program: one activation group


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, k, stride_x, BLOCK: tl.constexpr):
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0), sem="relaxed")


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, k, stride_x, stride_q, stride_s,
    HOW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    if HOW == ACT_PER_TOKEN:  # one scale per row: this program reads the whole row twice
        amax = tl.max(tl.zeros((BLOCK,), dtype=tl.float32), axis=0)
        for c in range(0, k, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        start = 0
        stop = k
    else:  # one 128-column group
        start = group * BLOCK
        stop = start + BLOCK
        if HOW == ACT_PER_GROUP:
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        else:
            amax = tl.load(amax_ptr)
    # torch divides by the python scalar 448 as a multiply by its float32 reciprocal on CUDA
    scale = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
    for c in range(start, stop, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv)  # IEEE, as torch
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=cols < k)
    if HOW == ACT_PER_TENSOR:
        if row == 0 and group == 0:
            tl.store(scale_ptr, scale)
    else:
        tl.store(scale_ptr + row * stride_s + group, scale)


def quantize_rows(x: torch.Tensor, how: ActQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (fp8 [R, K], scale [1] | [R, 1] | [R, ceil(K/128)]), as quantize_activation."""
    if not x.is_cuda:
        return quantize_activation(x, how)
    rows, k = x.shape
    groups = triton.cdiv(k, FP8_BLOCK)
    q = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    scale_shape = {ActQuant.TENSOR: (1,), ActQuant.TOKEN: (rows, 1), ActQuant.GROUP: (rows, groups)}
    scale = torch.empty(scale_shape[how], dtype=torch.float32, device=x.device)
    if rows == 0:
        return q.view(FP8), scale.fill_(_TINY / 448.0)
    amax = None
    if how == ActQuant.TENSOR:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        _amax_kernel[(rows, groups)](x, amax, k, x.stride(0), BLOCK=_BLOCK)
    _quantize_kernel[(rows, 1 if how == ActQuant.TOKEN else groups)](
        x, q, scale, amax, k, x.stride(0), q.stride(0), scale.stride(0) if scale.dim() == 2 else 0,
        HOW=ACT_SCALE[how], BLOCK=_BLOCK,
    )  # fmt: skip
    return q.view(FP8), scale
