"""The tensors that travel between the stages of a forward, each with its shape beside it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

import torch

from .quant_scheme import ActQuant


class Format(StrEnum):
    """How activations reach the experts."""

    STANDARD = "standard"  # tokens as they come: [M, K], with topk_ids [M, k]
    BATCHED = "batched"  # grouped by expert: [E, max_tokens, K], with tokens_per_expert [E]


@dataclass(frozen=True)
class Routing:
    topk_ids: torch.Tensor  # [M, k] int32 global expert ids
    topk_weights: torch.Tensor  # [M, k] float32

    def __post_init__(self) -> None:
        if self.topk_ids.shape != self.topk_weights.shape or self.topk_ids.dim() != 2:
            raise ValueError(
                f"topk_ids {tuple(self.topk_ids.shape)} and topk_weights "
                f"{tuple(self.topk_weights.shape)} must both be [M, k]"
            )


@dataclass(frozen=True)
class ForwardInputs:
    """One forward call of a layer: hidden states and, optionally, the router's logits."""

    hidden_states: torch.Tensor  # [M, H]
    router_logits: torch.Tensor | None = None  # [M, E]
    # checked against a layer by kernels.input_checks, which knows its H and E


@dataclass
class ExpertWeights:
    """The routed experts' parameters, in the layout of `MoEConfig.quant` (see quant_scheme)."""

    w13: torch.Tensor  # [E, 2I, H] (packed 4-bit: [E, 2I, H/2]); gate/up per ActivationSpec.gate_up
    w2: torch.Tensor  # [E, H, I] (packed 4-bit: [E, H, I/2])
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None  # [E, 2I]
    w2_bias: torch.Tensor | None = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every tensor's name: its field's."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are present, by name."""
        return {n: getattr(self, n) for n in self.names() if getattr(self, n) is not None}

    def to(self, device: torch.device | str) -> ExpertWeights:
        return ExpertWeights(**{n: t.to(device) for n, t in self.tensors().items()})

    def select(self, experts: torch.Tensor) -> ExpertWeights:
        """The experts in `experts` (local id order), for expert parallelism."""
        return ExpertWeights(**{n: t[experts] for n, t in self.tensors().items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class Dispatched:
    """What prepare hands the experts.

    STANDARD: `hidden` [M, K] and `topk_ids` [M, k] in *local* expert ids, -1 where the expert
    lives on another rank. BATCHED: `hidden` [E_local, max_tokens, K], only the first
    `tokens_per_expert[e]` rows of expert e valid, and `slots` [M, k] giving the row each
    (token, slot) pair took within its expert's block (-1 where topk_ids is -1), for finalize.
    """

    hidden: torch.Tensor
    scale: torch.Tensor | None  # activation scales when `act_quant` is set
    act_quant: ActQuant | None
    topk_ids: torch.Tensor  # [M, k] local ids
    topk_weights: torch.Tensor  # [M, k] float32; ones when applied on the input
    tokens_per_expert: torch.Tensor | None = None  # [E_local] int32, BATCHED only
    slots: torch.Tensor | None = None  # [M, k] int64, BATCHED only

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]
