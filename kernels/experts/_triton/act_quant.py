"""GEMM1's epilogue in one pass for GEMMs that cannot fuse it (DeepGEMM): per row of GEMM1's
output h [R, 2I], (+ bias of the row's expert) -> gated activation -> fp8 1x128 quantisation,
written straight into GEMM2's input: q [R, I] fp8 and one float32 scale per row and 128 columns,
stored MN-major (rows contiguous, the layout DeepGEMM's SM90 kernels read through TMA, so it
transposes nothing).

Which rows: `PairRows` (standard format: the pairs of `pair_row`, each on its expert's row; -1
rows are skipped) or `MaskedRows` (batched format: rows [e, s] with s < count[e]). Rows outside
either keep whatever the buffers held: GEMM2 computes each output row from its own input row only.

`act_quant_torch` is the twin: the reference's activation and quantiser (kernels.activations,
kernels.quantize) on the same rows, for the tests and for machines without Triton on a GPU.
The kernel rounds to the fp8 grid itself (ties to even) before the cast: the cast is then exact,
so Triton's CPU interpreter, which drops a mantissa carry when it rounds (126.6 becomes 64),
produces the GPU's bits too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...activations import apply_activation
from ...config import ActivationSpec, GateUp
from ...quant_scheme import FP8_BLOCK, ActQuant
from ...quantize import quantize_activation
from .codes import ACTIVATION, gated_activation

GROUPS_PER_PROGRAM = 4  # 128-column groups one program quantises
_FP8_MIN_NORMAL = tl.constexpr(2.0**-6)  # e4m3: below it the grid is subnormal, 2**-9 apart
_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)  # float32 spacing 2**-9: x + c - c rounds to it


@dataclass(frozen=True)
class PairRows:
    """Standard format: pair p's row is `pair_row[p]` (-1: not here), its expert `experts[p]`."""

    pair_row: torch.Tensor  # [P] int32
    experts: torch.Tensor  # [P] int32 local ids


@dataclass(frozen=True)
class MaskedRows:
    """Batched format: h [E, max_m, 2I]; rows s < counts[e] of expert e, s < max_tokens."""

    counts: torch.Tensor  # [E] int32 on the device
    max_tokens: int  # rows per expert that may be valid (the grid's extent)


def mn_major_scales(rows: int, groups: int, device: torch.device, batch: int = 0) -> torch.Tensor:
    """An empty float32 scale tensor [rows, groups] (or [batch, rows, groups]) stored MN-major:
    stride 1 along rows, `rows` along groups; DeepGEMM's TMA wants rows a multiple of 4."""
    if batch:
        storage = torch.empty(batch, groups, rows, dtype=torch.float32, device=device)
        return storage.transpose(1, 2)
    return torch.empty(groups, rows, dtype=torch.float32, device=device).t()


@triton.jit
def _round_to_e4m3(x):
    """x in [-448, 448] -> the nearest float8 e4m3 value (ties to even), still in float32."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 of float32's 23 mantissa bits; a carry into the exponent is right
    keep = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = keep.to(tl.float32, bitcast=True)
    magnitude = (tl.abs(x) + _SUBNORMAL_ROUNDER) - _SUBNORMAL_ROUNDER
    # x's sign bit put back by hand: a negative x that rounds to zero is -0.0 (0x80) as torch
    # casts it, and Triton 3.6 compiles `-m` as `0 - m`, +0.0 for m = +0.0 (triton-lang/triton
    # #10270 made it a negation later)
    sign = bits & -0x80000000
    subnormal = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < _FP8_MIN_NORMAL, subnormal, normal)


@triton.jit
def _act_quant_kernel(
    h_ptr, bias_ptr, q_ptr, s_ptr, map_ptr, experts_ptr, inter,
    stride_hb, stride_hm, stride_be, stride_qb, stride_qm, stride_sb, stride_sm, stride_sg,
    max_tokens, limit, alpha,
    MASKED: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    # every name below is set once: Triton wants a name to keep its type across runtime branches
    if MASKED:  # program r is row r % max_tokens of expert r // max_tokens
        expert = r // max_tokens
        slot = r % max_tokens
        valid = slot < tl.load(map_ptr + expert)
        h_off = expert.to(tl.int64) * stride_hb + slot.to(tl.int64) * stride_hm
        q_off = expert.to(tl.int64) * stride_qb + slot.to(tl.int64) * stride_qm
        s_off = expert.to(tl.int64) * stride_sb + slot.to(tl.int64) * stride_sm
    else:  # program r is pair r
        row = tl.load(map_ptr + r)
        expert = tl.load(experts_ptr + r)
        valid = row >= 0
        h_off = row.to(tl.int64) * stride_hm
        q_off = row.to(tl.int64) * stride_qm
        s_off = row.to(tl.int64) * stride_sm
    if valid:
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
        mask = cols < inter
        if INTERLEAVED:
            gate_cols, up_cols = 2 * cols, 2 * cols + 1
        else:
            gate_cols, up_cols = cols, inter + cols
        h_row = h_ptr + h_off
        gate = tl.load(h_row + gate_cols, mask=mask, other=0).to(tl.float32)
        up = tl.load(h_row + up_cols, mask=mask, other=0).to(tl.float32)
        if HAS_BIAS:
            b_row = bias_ptr + expert.to(tl.int64) * stride_be
            gate += tl.load(b_row + gate_cols, mask=mask, other=0).to(tl.float32)
            up += tl.load(b_row + up_cols, mask=mask, other=0).to(tl.float32)
        a = tl.where(mask, gated_activation(gate, up, ACTIVATION, alpha, limit), 0.0)
        # as kernels.quantize: scale = max(amax, 1e-12) / 448 (torch on CUDA multiplies by the
        # float32 reciprocal), q = fp8(clamp(a / scale, -448, 448))
        scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) * (1.0 / 448.0)  # [GROUPS]
        q = tl.clamp(tl.math.div_rn(a, scale[:, None]), -448.0, 448.0)
        q = _round_to_e4m3(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + q_off + cols, q, mask=mask)
        tl.store(s_ptr + s_off + groups * stride_sg, scale, mask=groups * GROUP < inter)


def act_quant(
    h: torch.Tensor,
    bias: torch.Tensor | None,
    spec: ActivationSpec,
    rows: PairRows | MaskedRows,
    q: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """h [R, 2I] (PairRows) or [E, max_m, 2I] (MaskedRows), any float dtype; bias [E, 2I] or
    None -> q (fp8, h's shape with I columns) and scale (float32, ceil(I/128) columns, any
    strides), on the chosen rows only."""
    inter = h.shape[-1] // 2
    masked = isinstance(rows, MaskedRows)
    if masked:
        num = h.shape[0] * rows.max_tokens
        row_map, experts = rows.counts, rows.counts  # `experts` unused: a row's expert is e
        h3, q3, s3 = h, q, scale
    else:
        num = rows.pair_row.numel()
        row_map, experts = rows.pair_row, rows.experts
        h3, q3, s3 = h[None], q[None], scale[None]
    if num == 0:
        return
    grid = (num, triton.cdiv(triton.cdiv(inter, FP8_BLOCK), GROUPS_PER_PROGRAM))
    _act_quant_kernel[grid](
        h3, bias, q3.view(torch.uint8), s3, row_map, experts, inter,
        h3.stride(0), h3.stride(1), 0 if bias is None else bias.stride(0),
        q3.stride(0), q3.stride(1), s3.stride(0), s3.stride(1), s3.stride(2),
        max(rows.max_tokens, 1) if masked else 1, spec.limit, spec.alpha,
        MASKED=masked, INTERLEAVED=spec.gate_up == GateUp.INTERLEAVED,
        ACTIVATION=ACTIVATION[spec.kind], HAS_BIAS=bias is not None,
        GROUPS=GROUPS_PER_PROGRAM, GROUP=FP8_BLOCK,
    )  # fmt: skip


def act_quant_torch(
    h: torch.Tensor,
    bias: torch.Tensor | None,
    spec: ActivationSpec,
    rows: PairRows | MaskedRows,
    q: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """The twin of `act_quant`: the reference's activation and 1x128 quantiser (host syncs)."""
    if isinstance(rows, MaskedRows):
        slots = torch.arange(h.shape[1], device=h.device)
        valid = (slots[None, :] < rows.counts[:, None]) & (slots < rows.max_tokens)
        index = tuple(torch.nonzero(valid, as_tuple=True))
        experts = index[0]
    else:
        here = rows.pair_row >= 0
        index = (rows.pair_row[here].long(),)
        experts = rows.experts[here].long()
    if experts.numel() == 0:
        return
    x = h[index].float()
    if bias is not None:
        x = x + bias[experts].float()
    q_rows, s_rows = quantize_activation(apply_activation(x, spec), ActQuant.GROUP)
    q.view(torch.uint8)[index] = q_rows.view(torch.uint8)
    scale[index] = s_rows
