"""Gated activations between GEMM1 and GEMM2, in plain torch: [..., 2I] -> [..., I].

These are the exact definitions every backend is tested against.
"""

from __future__ import annotations

import torch

from .config import Activation, ActivationSpec, GateUp


def split_gate_up(x: torch.Tensor, layout: GateUp) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I] -> gate [..., I], up [..., I] by the w13 row layout."""
    if layout == GateUp.INTERLEAVED:
        return x[..., 0::2], x[..., 1::2]
    gate, up = x.chunk(2, dim=-1)
    return gate, up


def apply_activation(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """GEMM1's output [..., 2I] -> activated [..., I], computed in x's dtype."""
    gate, up = split_gate_up(x, spec.gate_up)
    match spec.kind:
        case Activation.SILU:
            return torch.nn.functional.silu(gate) * up
        case Activation.GELU:
            return torch.nn.functional.gelu(gate) * up
        case Activation.SWIGLUOAI:
            gate = gate.clamp(max=spec.limit)
            up = up.clamp(-spec.limit, spec.limit)
            return (up + 1) * gate * torch.sigmoid(spec.alpha * gate)
    raise AssertionError(spec.kind)
