"""kernels/experts/_triton/sort_pairs.py: the one-program pair sort gives torch's stable argsort's
result exactly (order, inverse, weights, counts), on decode shapes and awkward ones: one pair,
every pair on one expert, most experts empty, the largest input it takes, bf16 weights. On a CPU
the kernel runs in Triton's interpreter; with a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.experts._triton import sort_pairs as sort_pairs_module
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


def test_past_one_programs_reach_torch_sorts(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    ran = []
    monkeypatch.setattr(sort_pairs_module, "sort_pairs_torch", lambda *a: ran.append(a) or a)
    ids, weights = _routing(33, 4, 16, seed=1, only=None, dtype=torch.float32)
    ids, weights = ids.to(device), weights.to(device)
    sort_pairs(ids, weights, 16)  # 132 pairs
    assert len(ran) == 1
    sort_pairs(ids[:32], weights[:32], 16)  # 128 pairs: the kernel
    assert len(ran) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 32])
def test_the_sort_on_the_gpu_equals_torchs_at_gpt_oss_decode_sizes(m: int) -> None:
    """Compiled (tests/gpu_suite.sh runs the gpu-marked tests only): 128 experts, top 4."""
    ids, weights = _routing(m, 4, 128, seed=m, only=7 if m > 1 else None, dtype=torch.bfloat16)
    _assert_sorts_agree(ids.cuda(), weights.cuda(), 128)
