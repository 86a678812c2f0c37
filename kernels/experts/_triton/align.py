"""Group the (token, slot) pairs of a standard-format forward by expert.

Pair p = token * k + slot. Each expert's pairs form a run padded to a multiple of BLOCK_M, so
every BLOCK_M rows of `row_ids` belong to one expert. No Python loop over experts and no host
sync: the buffers are sized for the worst case (every non-empty expert wastes BLOCK_M - 1 rows)
and blocks past the used rows carry expert -1, which the GEMM skips.

`align_pairs_torch` does it in about ten torch ops; for decode-sized inputs `align_pairs` does it
in one single-program Triton kernel (one launch instead of ten), with identical results. That
kernel compares the pairs with each other, never with every expert: over [pairs, experts] it
was a visible share of a one-token DeepSeek-V3 forward (E = 256) in a profile of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...arith import round_up
from ...dependent_launch import begin, dependent_launch

_FUSED_MAX_PAIRS = 128  # [pairs, pairs] tiles one program handles well
_PAIR_BLOCK = 1024


@dataclass(frozen=True)
class AlignedPairs:
    row_ids: torch.Tensor  # [capacity] int32 pair id, num_pairs marks padding
    block_expert: torch.Tensor  # [capacity / block_m] int32 local expert of each block, -1 unused
    num_pairs: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def aligned_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `row_ids` that hold any routing of `num_pairs` pairs: a multiple of block_m."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return round_up(worst, block_m)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids [M, k] local expert ids (-1: not here) -> pairs sorted by expert, padded runs."""
    flat = topk_ids.flatten().long()  # [P]
    num_pairs = flat.numel()
    device = flat.device
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    expert = torch.where(flat >= 0, flat, num_experts)  # -1 goes to a bucket past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    run_start = counts.cumsum(0) - counts  # [E + 1] first sorted position of each expert

    order = torch.sort(expert, stable=True).indices  # pair ids grouped by expert
    sorted_expert = expert[order]
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_expert]
    local = sorted_expert < num_experts
    dest = torch.where(
        local, padded_start[sorted_expert.clamp(max=num_experts - 1)] + rank, capacity
    )  # pairs of other ranks land in one extra slot, dropped below
    row_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    row_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(0, capacity, block_m, device=device)
    owner = torch.searchsorted(padded_end, block_start, right=True)  # first e ending after it
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return AlignedPairs(row_ids[:capacity], block_expert, num_pairs, block_m)


@triton.jit
def _align_kernel(
    ids_ptr, row_ids_ptr, block_expert_ptr, num_pairs, num_experts, capacity,
    BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr, B_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program, each pair against every other: [P, P] tiles, rows p, columns q."""
    begin(PDL)
    pairs = tl.arange(0, P_BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    expert = tl.where(here, ids, num_experts)  # other ranks' pairs and lanes past P: past all
    same = expert[:, None] == expert[None, :]
    rank = tl.sum((same & (pairs[None, :] < pairs[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # the run of the pair's expert
    leads = here & (rank == 0)  # one pair per local expert stands for its run
    below = leads[None, :] & (expert[None, :] < expert[:, None])
    start = tl.sum(tl.where(below, padded[None, :], 0), axis=1)  # runs of lower experts first
    for c in range(0, capacity, C_BLOCK):
        rows = c + tl.arange(0, C_BLOCK)
        tl.store(row_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=rows < capacity)
    tl.debug_barrier()  # the padding fill lands before the pair ids
    tl.store(row_ids_ptr + start + rank, pairs, mask=here)
    for c in range(0, capacity // BLOCK_M, B_BLOCK):
        blocks = c + tl.arange(0, B_BLOCK)
        row = blocks[:, None] * BLOCK_M
        owns = leads[None, :] & (start[None, :] <= row) & (row < start[None, :] + padded[None, :])
        owner = tl.max(tl.where(owns, expert[None, :], -1), axis=1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < capacity // BLOCK_M)


@triton.jit
def rank_pairs_kernel(
    ids_ptr, counts_ptr, rank_ptr, num_pairs, num_experts, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Count each expert's pairs; each pair's rank is the count its increment saw."""
    begin(PDL)
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    rank = tl.atomic_add(counts_ptr + tl.where(here, ids, 0), 1, mask=here, sem="relaxed")
    tl.store(rank_ptr + pairs, rank, mask=here)


@triton.jit
def _runs_kernel(
    counts_ptr, start_ptr, row_ids_ptr, block_expert_ptr, num_pairs, num_experts, capacity,
    BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program c: padding in rows [c * C_BLOCK, (c + 1) * C_BLOCK) and their blocks' experts;
    program 0 also the padded run starts. Every program sums the counts itself: one program
    doing every row takes longer than the placing at prefill sizes."""
    begin(PDL)
    experts = tl.arange(0, E_BLOCK)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(start_ptr + experts, padded_end - padded, mask=experts < num_experts)
    used_rows = tl.max(tl.where(experts < num_experts, padded_end, 0), axis=0)
    padded_end = tl.where(experts < num_experts, padded_end, capacity + 1)
    rows = tl.program_id(0) * C_BLOCK + tl.arange(0, C_BLOCK)
    tl.store(row_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=rows < capacity)
    blocks = tl.program_id(0) * (C_BLOCK // BLOCK_M) + tl.arange(0, C_BLOCK // BLOCK_M)
    owner = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    expert = tl.where(blocks * BLOCK_M < used_rows, owner, -1)
    tl.store(block_expert_ptr + blocks, expert, mask=blocks < capacity // BLOCK_M)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, start_ptr, row_ids_ptr, num_pairs, num_experts,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    begin(PDL)
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    start = tl.load(start_ptr + ids, mask=here, other=0)
    rank = tl.load(rank_ptr + pairs, mask=here, other=0)
    tl.store(row_ids_ptr + start + rank, pairs, mask=here)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids [M, k] local expert ids (-1: not here) -> pairs grouped by expert, padded runs.

    Small (decode) inputs: one single-program launch, pairs in ascending order within each run,
    exactly as `align_pairs_torch`. Larger ones: three launches over a grid each, with an atomic
    count, so pairs sit in arbitrary order within their expert's run (each row's result does not
    depend on it).
    """
    num_pairs = topk_ids.numel()
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    device = topk_ids.device
    ids = topk_ids.contiguous()
    row_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    pdl = dependent_launch(device)
    if num_pairs <= _FUSED_MAX_PAIRS:
        p_block = triton.next_power_of_2(max(num_pairs, 16))
        _align_kernel[(1,)](
            ids, row_ids, block_expert, num_pairs, num_experts, capacity,
            BLOCK_M=block_m, P_BLOCK=p_block, B_BLOCK=32, C_BLOCK=256, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )  # fmt: skip
        return AlignedPairs(row_ids, block_expert, num_pairs, block_m)
    e_block = triton.next_power_of_2(num_experts + 1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    start = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, _PAIR_BLOCK),)
    rank_pairs_kernel[grid](ids, counts, rank, num_pairs, num_experts, BLOCK=_PAIR_BLOCK,
                            PDL=pdl, launch_pdl=pdl)  # fmt: skip
    c_block = max(block_m, 1024)  # a multiple of block_m (a power of two)
    _runs_kernel[(triton.cdiv(capacity, c_block),)](
        counts, start, row_ids, block_expert, num_pairs, num_experts, capacity,
        BLOCK_M=block_m, E_BLOCK=e_block, C_BLOCK=c_block, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    _place_kernel[grid](ids, rank, start, row_ids, num_pairs, num_experts, BLOCK=_PAIR_BLOCK,
                        PDL=pdl, launch_pdl=pdl)  # fmt: skip
    return AlignedPairs(row_ids, block_expert, num_pairs, block_m)
