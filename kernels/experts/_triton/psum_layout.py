"""DeepGEMM's contiguous layout with prefix sums ("psum"), built on the device (no host sync),
and the two passes around the GEMMs: rows in, weighted rows out.

Pair p = token * k + slot. Each expert's pairs take consecutive rows; expert e's run starts at
the first multiple of the alignment at or after the end of e - 1's, so
    psum[e] = start[e] + count[e],   start[e] = round_up(psum[e - 1], alignment).
DeepGEMM (`use_psum_layout=True`) schedules blocks from `psum` alone, so the buffers can be sized
for the worst case (`aligned_capacity`) without computing anything for the unused rows, and the
forward needs no host sync. Rows are ranked within an expert by an atomic count on large inputs
(any order: a row's GEMM result does not depend on where it sits).

    psum_layout      topk_ids -> pair_row [P] (-1: another rank's pair), psum [E]
    gather_rows      fp8 activations and their 1x128 scales [M, H] -> the pairs' rows
    weighted_sum     GEMM2's rows (+ bias) -> [M, H], each token's k rows in slot order
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant_scheme import FP8_BLOCK
from .align import aligned_capacity, rank_pairs_kernel

_ONE_PROGRAM_MAX_ELEMENTS = 1 << 15  # [pairs, experts] one-hot tiles one program handles well
_PAIR_BLOCK = 1024
_BLOCK_H = 1024  # columns per program of the row passes: 8 scale groups


@dataclass(frozen=True)
class PsumLayout:
    pair_row: torch.Tensor  # [P] int32 row of each pair, -1 for pairs of other ranks
    psum: torch.Tensor  # [E] int32 end of each expert's run
    capacity: int  # rows any routing of P pairs fits in (a multiple of the alignment)


@triton.jit
def _layout_one_program_kernel(
    ids_ptr, pair_row_ptr, psum_ptr, num_pairs, num_experts,
    ALIGN: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
):  # fmt: skip
    """Decode sizes: counts, runs and each pair's row in one program; pairs in id order."""
    pairs = tl.arange(0, P_BLOCK)
    experts = tl.arange(0, E_BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    onehot = ((ids[:, None] == experts[None, :]) & here[:, None]).to(tl.int32)  # [P, E]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(psum_ptr + experts, start + counts, mask=experts < num_experts)
    rank = tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1) - 1  # earlier pairs of its expert
    row = tl.sum(onehot * start[None, :], axis=1) + rank
    tl.store(pair_row_ptr + pairs, tl.where(here, row, -1), mask=pairs < num_pairs)


@triton.jit
def _runs_kernel(counts_ptr, start_ptr, psum_ptr, num_experts, ALIGN: tl.constexpr,
                 E_BLOCK: tl.constexpr):  # fmt: skip
    experts = tl.arange(0, E_BLOCK)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(start_ptr + experts, start, mask=experts < num_experts)
    tl.store(psum_ptr + experts, start + counts, mask=experts < num_experts)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, start_ptr, pair_row_ptr, num_pairs, num_experts,
                  BLOCK: tl.constexpr):  # fmt: skip
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    start = tl.load(start_ptr + ids, mask=here, other=0)
    rank = tl.load(rank_ptr + pairs, mask=here, other=0)
    tl.store(pair_row_ptr + pairs, tl.where(here, start + rank, -1), mask=pairs < num_pairs)


def psum_layout(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> PsumLayout:
    """topk_ids [M, k] local ids (-1: not here) -> the layout, on the device, no host sync."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    ids = topk_ids.contiguous()
    pair_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    psum = torch.empty(num_experts, dtype=torch.int32, device=device)
    capacity = aligned_capacity(num_pairs, num_experts, alignment)
    p_block = triton.next_power_of_2(max(num_pairs, 16))
    e_block = triton.next_power_of_2(num_experts)
    if p_block * e_block <= _ONE_PROGRAM_MAX_ELEMENTS:
        _layout_one_program_kernel[(1,)](
            ids, pair_row, psum, num_pairs, num_experts,
            ALIGN=alignment, P_BLOCK=p_block, E_BLOCK=e_block, num_warps=8,
        )  # fmt: skip
        return PsumLayout(pair_row, psum, capacity)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    start = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, _PAIR_BLOCK),)
    rank_pairs_kernel[grid](ids, counts, rank, num_pairs, num_experts, BLOCK=_PAIR_BLOCK, PDL=False)
    _runs_kernel[(1,)](counts, start, psum, num_experts, ALIGN=alignment, E_BLOCK=e_block)
    _place_kernel[grid](ids, rank, start, pair_row, num_pairs, num_experts, BLOCK=_PAIR_BLOCK)
    return PsumLayout(pair_row, psum, capacity)


def psum_layout_torch(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> PsumLayout:
    """The twin of `psum_layout` (pairs in id order within each run), for the tests."""
    flat = topk_ids.flatten().long()
    here = (flat >= 0) & (flat < num_experts)
    key = torch.where(here, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts = counts.index_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + alignment - 1) // alignment * alignment
    start = padded.cumsum(0) - padded
    order = torch.sort(key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=flat.device)  # position in sorted order
    rank = rank - (counts.cumsum(0) - counts)[key.clamp(max=num_experts - 1)]
    row = torch.where(here, start[key.clamp(max=num_experts - 1)] + rank, -1)
    capacity = aligned_capacity(flat.numel(), num_experts, alignment)
    return PsumLayout(row.to(torch.int32), (start + counts).to(torch.int32), capacity)


@triton.jit
def _gather_kernel(
    x_ptr, xs_ptr, pair_row_ptr, a_ptr, as_ptr, hidden, stride_x, stride_xs, stride_a,
    stride_as, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    row = tl.load(pair_row_ptr + pair).to(tl.int64)
    if row >= 0:
        token = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + token * stride_x + cols, mask=cols < hidden)
        tl.store(a_ptr + row * stride_a + cols, x, mask=cols < hidden)
        groups = tl.program_id(1) * (BLOCK_H // GROUP) + tl.arange(0, BLOCK_H // GROUP)
        gmask = groups * GROUP < hidden
        s = tl.load(xs_ptr + token * stride_xs + groups, mask=gmask)
        tl.store(as_ptr + row + groups * stride_as, s, mask=gmask)


def gather_rows(
    x: torch.Tensor, x_scale: torch.Tensor, layout: PsumLayout, a: torch.Tensor,
    a_scale: torch.Tensor,
) -> None:  # fmt: skip
    """x fp8 [M, H] with scales [M, ceil(H/128)] -> a [capacity, H] and its MN-major scales
    (stride 1 along rows): each pair's token on the pair's row."""
    num_pairs, hidden = layout.pair_row.numel(), x.shape[1]
    if num_pairs == 0:
        return
    assert a_scale.stride(0) == 1, "a_scale must be MN-major"
    grid = (num_pairs, triton.cdiv(hidden, _BLOCK_H))
    _gather_kernel[grid](
        x.view(torch.uint8), x_scale, layout.pair_row, a.view(torch.uint8), a_scale, hidden,
        x.stride(0), x_scale.stride(0), a.stride(0), a_scale.stride(1),
        TOP_K=num_pairs // x.shape[0], BLOCK_H=_BLOCK_H, GROUP=FP8_BLOCK,
    )  # fmt: skip


@triton.jit
def _weighted_sum_kernel(
    y_ptr, bias_ptr, pair_row_ptr, ids_ptr, w_ptr, extra_ptr, out_ptr, hidden,
    stride_y, stride_b, stride_extra, stride_out,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        row = tl.load(pair_row_ptr + pair).to(tl.int64)
        if row >= 0:
            y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0).to(tl.float32)
            if HAS_BIAS:
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                y += tl.load(bias_ptr + expert * stride_b + cols, mask=mask, other=0).to(tl.float32)
            acc += tl.load(w_ptr + pair).to(tl.float32) * y
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + token * stride_extra + cols, mask=mask, other=0)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_sum(
    y: torch.Tensor, bias: torch.Tensor | None, layout: PsumLayout, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, out: torch.Tensor, extra: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """y [capacity, H] (GEMM2's rows) -> out [M, H] = sum over slots of w * (y[row] + bias[e])
    (+ extra float32 [M, H]), in float32, slot by slot, rounded once to out's dtype; pairs of
    other ranks add nothing."""
    m, k = topk_ids.shape
    hidden = out.shape[1]
    if m == 0:
        return out
    grid = (m, triton.cdiv(hidden, _BLOCK_H))
    _weighted_sum_kernel[grid](
        y, bias, layout.pair_row, topk_ids.contiguous(), topk_weights.contiguous(), extra, out,
        hidden, y.stride(0), 0 if bias is None else bias.stride(0),
        0 if extra is None else extra.stride(0), out.stride(0),
        TOP_K=k, HAS_BIAS=bias is not None, HAS_EXTRA=extra is not None, BLOCK_H=_BLOCK_H,
    )  # fmt: skip
    return out
