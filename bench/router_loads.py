"""Router logits for the two load patterns the kernel benchmark measures."""

from __future__ import annotations

from enum import StrEnum

import torch

SKEW = 1.5  # skewed load: expert of popularity rank r gets a logit offset of -SKEW * ln(1 + r)


class Load(StrEnum):
    UNIFORM = "uniform"  # i.i.d. normal logits: every expert equally likely
    SKEWED = "skewed"  # Zipf-like popularity: a few hot experts, a long cold tail


def router_logits(
    load: Load, tokens: int, num_experts: int, seed: int, device: torch.device
) -> torch.Tensor:
    """Random float32 logits [tokens, num_experts] for `load`, drawn on the CPU so that a seed
    gives the same routing on every device (they are small: 16 MB at 16384 x 256)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=generator)
    if load == Load.SKEWED:
        # hot experts at random positions, so group-limited routing sees them in several groups
        rank = torch.randperm(num_experts, generator=generator).float()
        logits = logits - SKEW * torch.log1p(rank)
    return logits.to(device)
