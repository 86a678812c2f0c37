"""Sum each token's k already-weighted expert rows: [M * k, H] -> [M, H], skipping slots whose
expert lives elsewhere (id -1), whose rows nothing wrote. Accumulates in float32, adds the
shared experts' float32 output when given, and rounds once to the output's dtype (float32 for
a partial sum other ranks' are added to). After the grouped GEMM2; per-pair GEMVs sum as they
write (gemv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dependent_launch import begin, dependent_launch

_BLOCK_H = 1024


@triton.jit
def _topk_sum_kernel(
    y_ptr, ids_ptr, extra_ptr, out_ptr, h, stride_y, stride_extra, stride_out,
    TOP_K: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < h
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        here = tl.load(ids_ptr + pair) + tl.zeros_like(offs) >= 0  # [BLOCK_H]
        acc += tl.load(y_ptr + pair * stride_y + offs, mask=mask & here, other=0).to(tl.float32)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + token * stride_extra + offs, mask=mask, other=0)
    tl.store(out_ptr + token * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_sum(
    y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M * k, H] weighted rows, topk_ids [M, k] local ids (+ extra float32 [M, H]) -> out
    [M, H] (unit column strides)."""
    m, k = topk_ids.shape
    h = out.shape[1]
    if m == 0:
        return out
    block_h = min(_BLOCK_H, triton.next_power_of_2(h))
    grid = (m, triton.cdiv(h, block_h))
    pdl = dependent_launch(out.device)
    _topk_sum_kernel[grid](
        y, topk_ids, extra, out, h, y.stride(0), 0 if extra is None else extra.stride(0),
        out.stride(0), TOP_K=k, HAS_EXTRA=extra is not None, BLOCK_H=block_h, PDL=pdl,
        launch_pdl=pdl,
    )  # fmt: skip
    return out
