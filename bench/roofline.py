"""What a forward must do at least, and the fastest the measured hardware could do it.

Bytes that must move: the weights (and scales, biases) of the experts the routing actually hits,
each read once, plus the input activations read once and the output written once. Intermediates
(GEMM1's output, the activation) are not counted: a fully fused kernel keeps them on chip.
FLOPs: two GEMMs per routed (token, expert) pair, 2 * (H * 2I + I * H) each.

roofline time = max(bytes / copy bandwidth, flops / dense GEMM peak of the layer's precision)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.config import MoEConfig
from ..kernels.tensors import ExpertWeights


@dataclass(frozen=True)
class Work:
    bytes: int  # bytes that must move through device memory
    flops: int
    experts_hit: int  # distinct experts with at least one routed token


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    gemm_flops_per_s: float  # dense GEMM peak in the layer's precision


@dataclass(frozen=True)
class Bound:
    memory_s: float  # bytes / copy bandwidth
    compute_s: float  # flops / GEMM peak

    @property
    def roofline_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound_by(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def expert_bytes(weights: ExpertWeights) -> int:
    """Bytes of one expert's tensors (weights, scales, biases); every tensor has a leading E."""
    return weights.nbytes() // weights.num_experts


def count_work(cfg: MoEConfig, weights: ExpertWeights, topk_ids: torch.Tensor) -> Work:
    """The minimum traffic and arithmetic of one forward routed by topk_ids [M, k]."""
    m = topk_ids.shape[0]
    valid = topk_ids[topk_ids >= 0]
    hit = int(torch.unique(valid).numel())
    h, i = cfg.hidden_size, cfg.intermediate_size
    activation_bytes = 2 * m * h * cfg.dtype.itemsize  # hidden states in, output out
    flops = 2 * int(valid.numel()) * (h * 2 * i + i * h)
    return Work(hit * expert_bytes(weights) + activation_bytes, flops, hit)


def bound(work: Work, ceilings: Ceilings) -> Bound:
    return Bound(work.bytes / ceilings.copy_bytes_per_s, work.flops / ceilings.gemm_flops_per_s)
