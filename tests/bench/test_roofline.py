"""Byte and FLOP counting, and the roofline arithmetic, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.roofline import Ceilings, Work, bound, count_work, expert_bytes
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights

E, H, I = 4, 256, 128  # noqa: E741 - I is the intermediate size, as in kernels.config


def _cfg(scheme: QuantScheme = QuantScheme.NONE) -> MoEConfig:
    return MoEConfig(E, H, I, RoutingConfig(top_k=2), quant=QuantConfig(scheme))


def test_expert_bytes_count_bf16_weights_of_one_expert() -> None:
    weights = random_expert_weights(_cfg())
    assert expert_bytes(weights) == (2 * I * H + H * I) * 2


def test_expert_bytes_include_fp8_block_scales() -> None:
    weights = random_expert_weights(_cfg(QuantScheme.FP8_BLOCK))
    w13_scales = (2 * I // 128) * (H // 128) * 4  # float32 per 128 x 128 tile
    w2_scales = (H // 128) * (I // 128) * 4
    assert expert_bytes(weights) == 2 * I * H + H * I + w13_scales + w2_scales


def test_count_work_reads_only_the_experts_hit_once_each() -> None:
    cfg = _cfg()
    weights = random_expert_weights(cfg)
    topk_ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32)  # 3 tokens, 2 experts
    work = count_work(cfg, weights, topk_ids)
    assert work.experts_hit == 2
    assert work.bytes == 2 * expert_bytes(weights) + 2 * 3 * H * 2  # + bf16 input and output
    assert work.flops == 2 * 6 * (H * 2 * I + I * H)


def test_count_work_skips_pairs_of_experts_on_other_ranks() -> None:
    cfg = _cfg()
    weights = random_expert_weights(cfg)
    work = count_work(cfg, weights, torch.tensor([[2, -1]], dtype=torch.int32))
    assert work.experts_hit == 1
    assert work.flops == 2 * (H * 2 * I + I * H)


def test_roofline_is_the_larger_of_memory_and_compute_time() -> None:
    ceilings = Ceilings(copy_bytes_per_s=2e12, gemm_flops_per_s=1e15)
    memory_bound = bound(Work(bytes=4_000_000, flops=10**9, experts_hit=1), ceilings)
    assert memory_bound.memory_s == pytest.approx(2e-6)
    assert memory_bound.compute_s == pytest.approx(1e-6)
    assert memory_bound.roofline_s == pytest.approx(2e-6)
    assert memory_bound.bound_by == "memory"
    compute_bound = bound(Work(bytes=2_000, flops=3 * 10**12, experts_hit=1), ceilings)
    assert compute_bound.roofline_s == pytest.approx(3e-3)
    assert compute_bound.bound_by == "compute"
