"""Dynamic fp8 quantisation of activation rows in Triton: `kernels.quantize.quantize_activation`
in one pass over the rows (two for a tensor-wide scale), capturable in a CUDA graph. A program
takes GROUPS_PER_PROGRAM 128-column groups of one row (a whole row for a per-token scale), and
rows that no expert here takes can be skipped.

Same arithmetic as the torch twin: scale = max(amax, 1e-12) / 448 over the tensor, the row or
the row's 128 columns, q = fp8(clamp(x / scale, -448, 448)), rounded to nearest even by the GPU,
bit for bit the twin's result. Triton's CPU interpreter converts to fp8 without carrying a
rounded-up mantissa into the exponent (126.6 becomes 64), so on the CPU the twin runs instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dependent_launch import begin, dependent_launch
from ...quant_scheme import FP8, FP8_BLOCK, ActQuant
from ...quantize import quantize_activation
from .codes import ACT_PER_GROUP, ACT_PER_TOKEN, ACT_SCALE

_TINY = 1e-12  # as kernels.quantize: all-zero rows keep a finite scale
_BLOCK = 128  # columns of one activation group
GROUPS_PER_PROGRAM = 8  # groups one program quantises (per-group and tensor-wide scales)
AMAX_ROWS = 8  # rows of GROUPS_PER_PROGRAM groups one program of the tensor-wide amax reads


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, rows, k, stride_x, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    """ROWS rows x BLOCK columns a program, one atomic each: one atomic per row and group
    serialises a large intermediate (Mixtral-fp8's at prefill) on the one address."""
    begin(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    first = tl.program_id(0) * ROWS
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(ROWS):  # past the last row: the last row again (max is unmoved)
        row = tl.minimum(first + r, rows - 1).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(amax, axis=0), sem="relaxed")


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, ids_ptr, k, stride_x, stride_q, stride_s,
    HOW: tl.constexpr, SKIP: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    begin(PDL)
    here = True
    if SKIP:  # a pair routed to no expert of this rank (another rank's, or a padded row)
        here = tl.load(ids_ptr + row) >= 0
    if here:
        if HOW == ACT_PER_TOKEN:  # one scale per row: this program reads the whole row twice
            amax = tl.max(tl.zeros((BLOCK,), dtype=tl.float32), axis=0)
            for c in range(0, k, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            # torch divides by the python scalar 448 as a multiply by its float32 reciprocal
            scale = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
            for c in range(0, k, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0).to(tl.float32)
                q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv)
                tl.store(q_ptr + row * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=cols < k)
            tl.store(scale_ptr + row * stride_s, scale)
        else:  # GROUPS 128-column groups of the row, read once
            groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
            cols = groups[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]
            mask = cols < k
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0).to(tl.float32)
            if HOW == ACT_PER_GROUP:
                amax = tl.max(tl.abs(x), axis=1)  # [GROUPS]
            else:
                amax = tl.zeros((GROUPS,), dtype=tl.float32) + tl.load(amax_ptr)
            scale = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
            q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
            tl.store(q_ptr + row * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=mask)
            if HOW == ACT_PER_GROUP:
                tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups * BLOCK < k)
            elif row == 0:
                tl.store(scale_ptr + groups, scale, mask=groups == 0)


def quantize_rows(
    x: torch.Tensor,
    how: ActQuant,
    rows_here: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (fp8 [R, K], scale [1] | [R, 1] | [R, ceil(K/128)]), as quantize_activation.

    `rows_here` [R] (per row or group scales only): rows where it is negative are left
    unquantised, their q and scale rows undefined: the pairs routed to no expert here, which no
    GEMM reads (on an expert-parallel rank, half of them or more). `amax` [1] (tensor-wide
    scale only): the largest |x| of the rows that count, as the GEMM that wrote them found it;
    the other rows are quantised too, and no GEMM reads them."""
    if not x.is_cuda:
        return quantize_activation(x, how, amax)
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    groups = triton.cdiv(k, FP8_BLOCK)
    scale_shape = {ActQuant.TENSOR: (1,), ActQuant.TOKEN: (rows, 1), ActQuant.GROUP: (rows, groups)}
    scale = torch.empty(scale_shape[how], dtype=torch.float32, device=x.device)
    quantize_into(x, q, scale, how, rows_here, amax)
    return q.view(FP8), scale


def quantize_into(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    how: ActQuant,
    rows_here: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> None:
    """`quantize_rows` into q (uint8 [R, K]) and scale: the kernel alone (the interpreter's
    fp8 cast differs from the GPU's; tests call this to check which rows it writes)."""
    rows, k = x.shape
    if rows == 0:
        scale.fill_(_TINY / 448.0)
        return
    if rows_here is not None and how == ActQuant.TENSOR:
        raise ValueError("a tensor-wide scale is over every row: rows_here does not apply")
    groups = triton.cdiv(k, FP8_BLOCK)
    pdl = dependent_launch(x.device)
    if how == ActQuant.TENSOR and amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        block = GROUPS_PER_PROGRAM * _BLOCK
        _amax_kernel[(triton.cdiv(rows, AMAX_ROWS), triton.cdiv(k, block))](
            x, amax, rows, k, x.stride(0), ROWS=AMAX_ROWS, BLOCK=block, PDL=pdl, launch_pdl=pdl
        )
    grid = (rows, 1 if how == ActQuant.TOKEN else triton.cdiv(groups, GROUPS_PER_PROGRAM))
    _quantize_kernel[grid](
        x, q, scale, amax, rows_here, k, x.stride(0), q.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0,
        HOW=ACT_SCALE[how], SKIP=rows_here is not None, BLOCK=_BLOCK, GROUPS=GROUPS_PER_PROGRAM,
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
