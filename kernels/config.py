"""What one MoE layer is: sizes, routing, activation and quantisation, as frozen values.

Legend used across `kernels/`: M = tokens, E = experts, k = top_k, H = hidden size (K of GEMM1),
I = intermediate size (GEMM1 produces 2I = gate and up, GEMM2 maps I back to H).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from .quant_scheme import QuantConfig


class Activation(StrEnum):
    SILU = "silu"  # silu(gate) * up (Mixtral, Qwen, DeepSeek)
    GELU = "gelu"  # gelu(gate) * up, exact erf form
    SWIGLUOAI = "swigluoai"  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate)


class GateUp(StrEnum):
    """How gate and up rows are laid out along the 2I axis of w13."""

    SPLIT = "split"  # rows [0, I) are gate, [I, 2I) are up
    INTERLEAVED = "interleaved"  # row 2i is gate i, row 2i + 1 is up i (gpt-oss)


@dataclass(frozen=True)
class ActivationSpec:
    kind: Activation = Activation.SILU
    gate_up: GateUp = GateUp.SPLIT
    alpha: float = 1.702  # swigluoai only
    limit: float = 7.0  # swigluoai only

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Activation(self.kind))
        object.__setattr__(self, "gate_up", GateUp(self.gate_up))
        if self.limit <= 0:
            raise ValueError(f"activation limit must be positive, got {self.limit}")


class Scoring(StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class GroupScore(StrEnum):
    """How a group of experts is scored when routing is group-limited."""

    MAX = "max"  # DeepSeek-V2: best expert score in the group
    TOP2_SUM = "top2_sum"  # DeepSeek-V3: sum of the two best (bias-corrected) scores


@dataclass(frozen=True)
class RoutingConfig:
    """Router logits [M, E] -> (topk_ids, topk_weights), see `kernels.routing.route`.

    - softmax, renormalize: Mixtral; Qwen with norm_topk_prob.
    - softmax_after_topk: gpt-oss (top-k on the logits, then softmax over the k).
    - sigmoid + score-correction bias + groups(TOP2_SUM) + scaling: DeepSeek-V3.
    - softmax + groups(MAX): DeepSeek-V2 group-limited greedy.
    """

    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = True
    softmax_after_topk: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = GroupScore.MAX
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scoring", Scoring(self.scoring))
        object.__setattr__(self, "group_score", GroupScore(self.group_score))
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_groups must be in [1, num_groups={self.num_groups}], got {self.topk_groups}"
            )
        if self.softmax_after_topk and self.scoring != Scoring.SOFTMAX:
            raise ValueError("softmax_after_topk needs softmax scoring")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape and numerics; checks itself so downstream code can trust it."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    routing: RoutingConfig
    activation: ActivationSpec = field(default_factory=ActivationSpec)
    quant: QuantConfig = field(default_factory=QuantConfig)
    dtype: torch.dtype = torch.bfloat16  # activations in and out
    has_bias: bool = False  # per-expert biases on both GEMMs (gpt-oss)
    apply_router_weight_on_input: bool = False  # scale x by the weight before GEMM1 (top_k 1)

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.routing.top_k > self.num_experts:
            raise ValueError(f"top_k={self.routing.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.routing.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by "
                f"num_groups={self.routing.num_groups}"
            )
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype}")
        if self.apply_router_weight_on_input and self.routing.top_k != 1:
            raise ValueError("apply_router_weight_on_input needs top_k == 1")
        self.quant.check_shape(self.hidden_size, self.intermediate_size)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def w13_parts(self) -> int:
        """w13's matrices stacked along 2I, each scaled on its own: gate and up when split
        (quant_scheme.py's note on fp8-block), one when interleaved."""
        return 2 if self.activation.gate_up == GateUp.SPLIT else 1

    def as_json(self) -> dict[str, Any]:
        """Every field as a JSON value (enums as strings, dtype by name), as manifest.json and
        /v1/layers show the layer."""
        dtype = next(name for name, d in DTYPES.items() if d == self.dtype)
        return dataclasses.asdict(self) | {"dtype": dtype}
