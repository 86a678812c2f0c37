"""Group the (token, slot) pairs of a standard-format forward by expert, in plain torch.

Pair p = token * k + slot. Each expert's pairs form a run padded to a multiple of BLOCK_M, so
every BLOCK_M rows of `row_ids` belong to one expert. No Python loop over experts and no host
sync: the buffers are sized for the worst case (every non-empty expert wastes BLOCK_M - 1 rows)
and blocks past the used rows carry expert -1, which the GEMM skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    return -(-worst // block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
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
