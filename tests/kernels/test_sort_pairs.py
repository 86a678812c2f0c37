"""kernels/experts/_triton/sort_pairs.py: the one-program pair sort gives torch's stable argsort's
result exactly (order, inverse, weights, counts), on decode shapes and awkward ones: one pair,
every pair on one expert, most experts empty, the largest input it takes, bf16 weights. Past it,
the grid sort groups the same pairs under the same experts in the same expert order (any order
within an expert). On a CPU the kernels run in Triton's interpreter; with a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.experts._triton.sort_pairs import (
    ONE_PROGRAM_MAX_PAIRS,
    sort_pairs,
    sort_pairs_torch,
)


def _routing(m: int, k: int, num_experts: int, seed: int, only: int | None, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(m)])
    if only is not None:
        ids[:, 0] = only
    weights = torch.rand(m, k, generator=g).to(dtype)
    return ids.to(torch.int32), weights


def _assert_sorts_agree(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
    fast = sort_pairs(ids, weights, num_experts)
    slow = sort_pairs_torch(ids, weights, num_experts)
    for name in ("sorted_pairs", "row_of_pair", "row_weights", "tokens_per_expert"):
        got, want = getattr(fast, name), getattr(slow, name)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "k", "num_experts", "only"),
    [(1, 1, 8, None), (1, 4, 128, None), (7, 4, 128, 5), (32, 4, 128, None), (16, 8, 256, 0),
     (5, 3, 6, None)],
)  # fmt: skip
def test_the_one_program_sort_equals_torchs_stable_argsort(
    device: torch.device, m: int, k: int, num_experts: int, only: int | None, dtype: torch.dtype
) -> None:
    ids, weights = _routing(m, k, num_experts, seed=m * k, only=only, dtype=dtype)
    ids, weights = ids.to(device), weights.to(device)
    assert m * k <= ONE_PROGRAM_MAX_PAIRS
    _assert_sorts_agree(ids, weights, num_experts)


def _assert_grouped_as_torch(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
    """The grid sort's rows: torch's pairs under each expert, in ascending experts, the inverse
    and the weights consistent with them."""
    fast = sort_pairs(ids, weights, num_experts)
    slow = sort_pairs_torch(ids, weights, num_experts)
    assert torch.equal(fast.tokens_per_expert.cpu(), slow.tokens_per_expert.cpu())
    order, inverse = fast.sorted_pairs.cpu().long(), fast.row_of_pair.cpu().long()
    assert torch.equal(inverse[order], torch.arange(ids.numel()))
    flat = ids.flatten().cpu()
    assert torch.equal(flat[order], flat[slow.sorted_pairs.cpu().long()])  # experts row by row
    ends = slow.tokens_per_expert.cpu().cumsum(0).tolist()
    for start, end in zip([0, *ends[:-1]], ends, strict=True):  # the same pairs in each run
        assert sorted(order[start:end].tolist()) == slow.sorted_pairs[start:end].cpu().tolist()
    want = weights.flatten().float().cpu()[order]
    assert torch.equal(fast.row_weights.cpu(), want)


@pytest.mark.parametrize(
    ("m", "k", "num_experts", "only"),
    [(33, 4, 16, None), (300, 4, 128, 9), (257, 8, 256, None), (40, 4, 6, None)],
)  # fmt: skip
def test_past_one_program_the_grid_sort_groups_the_pairs_as_torch(
    device: torch.device, m: int, k: int, num_experts: int, only: int | None
) -> None:
    """Just past one program, several programs of each kernel with a ragged last one, every
    pair of a token's first slot on one expert, E = 256, and experts fewer than slots' blocks."""
    ids, weights = _routing(m, k, num_experts, seed=m + k, only=only, dtype=torch.bfloat16)
    assert m * k > ONE_PROGRAM_MAX_PAIRS
    _assert_grouped_as_torch(ids.to(device), weights.to(device), num_experts)


def test_no_pairs_sort_to_empty_rows_and_zero_counts(device: torch.device) -> None:
    ids = torch.empty(0, 4, dtype=torch.int32, device=device)
    out = sort_pairs(ids, torch.empty(0, 4, device=device), 8)
    assert out.sorted_pairs.numel() == 0 and out.tokens_per_expert.tolist() == [0] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 32])
def test_the_sort_on_the_gpu_equals_torchs_at_gpt_oss_decode_sizes(m: int) -> None:
    """Compiled (tests/gpu_suite.sh runs the gpu-marked tests only): 128 experts, top 4."""
    ids, weights = _routing(m, 4, 128, seed=m, only=7 if m > 1 else None, dtype=torch.bfloat16)
    _assert_sorts_agree(ids.cuda(), weights.cuda(), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [33, 64, 512, 4096])
def test_the_grid_sort_on_the_gpu_groups_as_torch_at_gpt_oss_prefill_sizes(m: int) -> None:
    ids, weights = _routing(m, 4, 128, seed=m, only=None, dtype=torch.bfloat16)
    _assert_grouped_as_torch(ids.cuda(), weights.cuda(), 128)
