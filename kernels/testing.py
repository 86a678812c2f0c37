"""Random layers and error measures shared by the tests, the benchmark and the demo layer."""

from __future__ import annotations

import zlib

import torch

from kernels.config import MoEConfig
from kernels.quantize import quantize_weight
from kernels.tensors import ExpertWeights


def random_float_weights(cfg: MoEConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Unquantised float32 expert tensors of `cfg`'s shape (CPU), scaled like a trained layer."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / fan_in**0.5

    tensors = {"w13": randn(e, 2 * i, h, fan_in=h), "w2": randn(e, h, i, fan_in=i)}
    if cfg.has_bias:
        tensors |= {"w13_bias": randn(e, 2 * i, fan_in=4), "w2_bias": randn(e, h, fan_in=4)}
    return tensors


def quantize_expert_weights(cfg: MoEConfig, tensors: dict[str, torch.Tensor]) -> ExpertWeights:
    """Float expert tensors -> ExpertWeights in cfg.quant's layout (biases in float32)."""
    w13, w13_scale = quantize_weight(tensors["w13"], cfg.quant)
    w2, w2_scale = quantize_weight(tensors["w2"], cfg.quant)
    if cfg.quant.scheme == "none":
        w13, w2 = w13.to(cfg.dtype), w2.to(cfg.dtype)
    return ExpertWeights(
        w13, w2, w13_scale, w2_scale, tensors.get("w13_bias"), tensors.get("w2_bias")
    )


def random_expert_weights(cfg: MoEConfig, seed: int = 0) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    return quantize_expert_weights(cfg, random_float_weights(cfg, generator))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; inf when either holds NaN."""
    a, b = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def stable_seed(*parts: object) -> int:
    """A seed derived from `parts` that is the same in every process (unlike hash())."""
    return zlib.crc32(repr(parts).encode()) % 2**31
