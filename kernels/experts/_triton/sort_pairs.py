"""Sort the (token, slot) pairs of a forward by expert, as gather/scatter GEMMs (triton_kernels'
matmul_ogs) take them: the sorted order, its inverse, the router weights in that order and each
expert's count.

Decode-sized inputs take one single-program kernel, each pair ranked against every other (as
align.py's), in the stable order of `sort_pairs_torch` (torch's stable argsort, the reference).
Larger ones take two launches over a grid: an atomic count ranks each pair within its expert
(align.py's `rank_pairs_kernel`), then each pair is placed after the lower experts' pairs. Pairs
of one expert then sit in arbitrary order, which changes no output: each row's GEMM result is
its own, and the scatter sums each token's rows by slot. torch's sorts took most of a captured
64-token gpt-oss forward's time outside its two GEMMs (`moe-serve bench kernels --mode profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...dependent_launch import begin, dependent_launch
from .align import rank_pairs_kernel

ONE_PROGRAM_MAX_PAIRS = 128  # [pairs, pairs] and [experts, pairs] tiles one program handles well
_RANK_BLOCK = 1024
_PLACE_BLOCK = 256  # pairs a program places
_PAST_EVERY_EXPERT = tl.constexpr(1 << 30)  # lanes past the last pair sort after every pair


@dataclass(frozen=True)
class SortedPairs:
    sorted_pairs: torch.Tensor  # [P] int32: pair (token * k + slot) at each expert-sorted row
    row_of_pair: torch.Tensor  # [P] int32: inverse of sorted_pairs
    row_weights: torch.Tensor  # [P] float32: router weight of each sorted row
    tokens_per_expert: torch.Tensor  # [E] int32


def sort_pairs_torch(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> SortedPairs:
    """topk_ids, topk_weights [M, k] -> pairs sorted by expert (stable: token order kept); the
    reference of the kernels."""
    flat = topk_ids.flatten()
    sorted_pairs = torch.argsort(flat, stable=True)
    row_of_pair = torch.argsort(sorted_pairs)
    return SortedPairs(
        sorted_pairs.to(torch.int32),
        row_of_pair.to(torch.int32),
        topk_weights.flatten()[sorted_pairs].float(),
        # index_add, not bincount: bincount sizes its output on the host (a sync per call)
        torch.zeros(num_experts, dtype=torch.int32, device=flat.device).index_add_(
            0, flat.long(), torch.ones_like(flat, dtype=torch.int32)
        ),
    )


@triton.jit
def _sort_pairs_kernel(
    ids_ptr, weights_ptr, sorted_ptr, row_of_ptr, row_weights_ptr, counts_ptr, num_pairs,
    num_experts, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program: pair p's sorted row counts the pairs before it (lower expert, or the same
    expert and a lower pair id); [P, P] tiles, rows p, columns q."""
    begin(PDL)
    pairs = tl.arange(0, P_BLOCK)
    valid = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=valid, other=_PAST_EVERY_EXPERT)
    weights = tl.load(weights_ptr + pairs, mask=valid, other=0).to(tl.float32)
    lower = ids[None, :] < ids[:, None]
    tied_before = (ids[None, :] == ids[:, None]) & (pairs[None, :] < pairs[:, None])
    row = tl.sum((lower | tied_before).to(tl.int32), axis=1)
    tl.store(row_of_ptr + pairs, row, mask=valid)
    tl.store(sorted_ptr + row, pairs, mask=valid)
    tl.store(row_weights_ptr + row, weights, mask=valid)
    experts = tl.arange(0, E_BLOCK)
    counts = tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    tl.store(counts_ptr + experts, counts, mask=experts < num_experts)


@triton.jit
def _place_kernel(
    ids_ptr, weights_ptr, rank_ptr, counts_ptr, start_ptr, sorted_ptr, row_of_ptr,
    row_weights_ptr, num_pairs, num_experts, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Pair p's row: the pairs of lower experts, then its rank within its own expert. Each
    program writes the experts' first rows (a sum over the counts) to its own E_BLOCK of
    `start_ptr` and gathers its pairs' from there: a [pairs, experts] tile summed per pair took
    several times longer."""
    begin(PDL)
    experts = tl.arange(0, E_BLOCK)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    start_ptr += tl.program_id(0) * E_BLOCK
    tl.store(start_ptr + experts, tl.cumsum(counts, axis=0) - counts)
    tl.debug_barrier()  # the starts land before this program's threads gather them
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=valid, other=0)
    row = tl.load(start_ptr + ids, mask=valid, other=0) + tl.load(rank_ptr + pairs, mask=valid,
                                                                   other=0)  # fmt: skip
    weights = tl.load(weights_ptr + pairs, mask=valid, other=0).to(tl.float32)
    tl.store(row_of_ptr + pairs, row, mask=valid)
    tl.store(sorted_ptr + row, pairs, mask=valid)
    tl.store(row_weights_ptr + row, weights, mask=valid)


def sort_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> SortedPairs:
    """topk_ids, topk_weights [M, k] (ids in [0, num_experts)) -> pairs sorted by expert: up to
    ONE_PROGRAM_MAX_PAIRS in one launch and in `sort_pairs_torch`'s order, more in two (see the
    module's docstring)."""
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return sort_pairs_torch(topk_ids, topk_weights, num_experts)
    if num_pairs > ONE_PROGRAM_MAX_PAIRS:
        return _sort_pairs_grid(topk_ids.contiguous(), topk_weights.contiguous(), num_experts)
    device = topk_ids.device
    out = SortedPairs(
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_pairs, dtype=torch.float32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
    )
    pdl = dependent_launch(device)
    _sort_pairs_kernel[(1,)](
        topk_ids.contiguous(), topk_weights.contiguous(), out.sorted_pairs, out.row_of_pair,
        out.row_weights, out.tokens_per_expert, num_pairs, num_experts,
        P_BLOCK=triton.next_power_of_2(max(num_pairs, 16)),
        E_BLOCK=triton.next_power_of_2(num_experts), PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _sort_pairs_grid(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> SortedPairs:
    num_pairs, device = ids.numel(), ids.device
    out = SortedPairs(
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_pairs, dtype=torch.float32, device=device),
        torch.zeros(num_experts, dtype=torch.int32, device=device),
    )
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    grid = triton.cdiv(num_pairs, _PLACE_BLOCK)
    e_block = triton.next_power_of_2(num_experts)
    start = torch.empty(grid * e_block, dtype=torch.int32, device=device)  # a block a program
    pdl = dependent_launch(device)
    rank_pairs_kernel[(triton.cdiv(num_pairs, _RANK_BLOCK),)](
        ids, out.tokens_per_expert, rank, num_pairs, num_experts, BLOCK=_RANK_BLOCK, PDL=pdl,
        launch_pdl=pdl,
    )  # fmt: skip
    _place_kernel[(grid,)](
        ids, weights, rank, out.tokens_per_expert, start, out.sorted_pairs, out.row_of_pair,
        out.row_weights, num_pairs, num_experts, BLOCK=_PLACE_BLOCK, E_BLOCK=e_block, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
