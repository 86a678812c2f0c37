"""Random expert weights of a layer's shape: the tests, the benchmarks and the demo layers."""

from __future__ import annotations

import zlib

import torch

from .config import MoEConfig
from .quantize import quantize_expert_weights
from .tensors import ExpertWeights


def random_float_weights(cfg: MoEConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Unquantised float32 expert tensors of `cfg`'s shape (CPU), scaled like a trained layer."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / fan_in**0.5

    tensors = {"w13": randn(e, 2 * i, h, fan_in=h), "w2": randn(e, h, i, fan_in=i)}
    if cfg.has_bias:
        tensors |= {"w13_bias": randn(e, 2 * i, fan_in=4), "w2_bias": randn(e, h, fan_in=4)}
    return tensors


def random_expert_weights(cfg: MoEConfig, seed: int = 0) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    return quantize_expert_weights(cfg, random_float_weights(cfg, generator))


def stable_seed(*parts: object) -> int:
    """A seed derived from `parts` that is the same in every process (unlike hash())."""
    return zlib.crc32(repr(parts).encode()) % 2**31
