"""Group the (token, slot) pairs of a standard-format forward by expert.

Pair p = token * k + slot. Each expert's pairs form a run padded to a multiple of BLOCK_M, so
every BLOCK_M rows of `row_ids` belong to one expert. No Python loop over experts and no host
sync: the buffers are sized for the worst case (every non-empty expert wastes BLOCK_M - 1 rows)
and blocks past the used rows carry expert -1, which the GEMM skips.

`align_pairs_torch` does it in about ten torch ops; for decode-sized inputs `align_pairs` does it
in one single-program Triton kernel (one launch instead of ten), with identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arith import round_up

_FUSED_MAX_ELEMENTS = 1 << 15  # [pairs, experts] one-hot tiles one program handles well
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
    BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
):  # fmt: skip
    pairs = tl.arange(0, P_BLOCK)
    experts = tl.arange(0, E_BLOCK)
    valid = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
    ids = tl.where(ids >= 0, ids, num_experts)  # other ranks' pairs and lanes past P: bucket E
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [P, E]
    counts = tl.sum(onehot, axis=0)
    padded = tl.where(experts < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, axis=0)
    start = tl.sum(onehot * (padded_end - padded)[None, :], axis=1)  # [P] its expert's run start
    rank = tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1) - 1  # earlier pairs of its expert
    for c in range(0, capacity, C_BLOCK):
        rows = c + tl.arange(0, C_BLOCK)
        tl.store(row_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=rows < capacity)
    tl.debug_barrier()  # the padding fill lands before the pair ids
    tl.store(row_ids_ptr + start + rank, pairs, mask=valid & (ids < num_experts))
    for c in range(0, capacity // BLOCK_M, C_BLOCK):
        blocks = c + tl.arange(0, C_BLOCK)
        owner = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        expert = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < capacity // BLOCK_M)


@triton.jit
def rank_pairs_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    """Count each expert's pairs; each pair's rank is the count its increment saw."""
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    rank = tl.atomic_add(counts_ptr + tl.where(here, ids, 0), 1, mask=here, sem="relaxed")
    tl.store(rank_ptr + pairs, rank, mask=here)


@triton.jit
def _runs_kernel(
    counts_ptr, start_ptr, row_ids_ptr, block_expert_ptr, num_pairs, num_experts, capacity,
    BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: padded run starts, each block's expert, and padding everywhere."""
    experts = tl.arange(0, E_BLOCK)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + experts, padded_end - padded, mask=experts < num_experts)
    padded_end = tl.where(experts < num_experts, padded_end, capacity + 1)
    for c in range(0, capacity, C_BLOCK):
        rows = c + tl.arange(0, C_BLOCK)
        tl.store(row_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=rows < capacity)
    for c in range(0, capacity // BLOCK_M, C_BLOCK):
        blocks = c + tl.arange(0, C_BLOCK)
        owner = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        used = blocks * BLOCK_M < tl.max(tl.where(experts < num_experts, padded_end, 0), axis=0)
        expert = tl.where(used, owner, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < capacity // BLOCK_M)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, start_ptr, row_ids_ptr, num_pairs, num_experts,
                  BLOCK: tl.constexpr):  # fmt: skip
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    here = (ids >= 0) & (ids < num_experts)
    start = tl.load(start_ptr + ids, mask=here, other=0)
    rank = tl.load(rank_ptr + pairs, mask=here, other=0)
    tl.store(row_ids_ptr + start + rank, pairs, mask=here)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids [M, k] local expert ids (-1: not here) -> pairs grouped by expert, padded runs.

    Small (decode) inputs: one single-program launch, pairs in ascending order within each run,
    exactly as `align_pairs_torch`. Larger ones: three launches with an atomic count, so pairs
    sit in arbitrary order within their expert's run (each row's result does not depend on it).
    """
    num_pairs = topk_ids.numel()
    p_block = triton.next_power_of_2(max(num_pairs, 16))
    e_block = triton.next_power_of_2(num_experts + 1)
    capacity = aligned_capacity(num_pairs, num_experts, block_m)
    device = topk_ids.device
    ids = topk_ids.contiguous()
    row_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    if p_block * e_block <= _FUSED_MAX_ELEMENTS:
        _align_kernel[(1,)](
            ids, row_ids, block_expert, num_pairs, num_experts, capacity,
            BLOCK_M=block_m, P_BLOCK=p_block, E_BLOCK=e_block, C_BLOCK=256, num_warps=8,
        )  # fmt: skip
        return AlignedPairs(row_ids, block_expert, num_pairs, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    start = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, _PAIR_BLOCK),)
    rank_pairs_kernel[grid](ids, counts, rank, num_pairs, num_experts, BLOCK=_PAIR_BLOCK)
    _runs_kernel[(1,)](
        counts, start, row_ids, block_expert, num_pairs, num_experts, capacity,
        BLOCK_M=block_m, E_BLOCK=e_block, C_BLOCK=128, num_warps=8,
    )  # fmt: skip
    _place_kernel[grid](ids, rank, start, row_ids, num_pairs, num_experts, BLOCK=_PAIR_BLOCK)
    return AlignedPairs(row_ids, block_expert, num_pairs, block_m)
