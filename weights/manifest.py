"""`manifest.json`: what a layer directory holds, read and written through one typed schema."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from kernels.config import DTYPES, ActivationSpec, MoEConfig, RoutingConfig
from kernels.layer import LayerWeights
from kernels.quant_scheme import QuantConfig

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "experts.safetensors"

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # layer names appear in URLs
DtypeName = Literal["float32", "bfloat16", "float16"]


class Source(BaseModel):
    """Where the layer came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str  # mixtral | qwen2_moe | qwen3_moe | deepseek_v2 | deepseek_v3 | gpt_oss | demo
    model: str  # the checkpoint directory's name (or the demo generator)
    layer: int = Field(ge=0)


class Manifest(BaseModel):
    """One MoE layer directory: sizes, numerics, which optional parts exist, the tensors' hash.

    The tensors' shapes and dtypes follow from these fields (`weights.layout.expected_tensors`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = FORMAT_VERSION
    name: str = Field(pattern=NAME_PATTERN)
    source: Source
    num_experts: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    routing: RoutingConfig  # top_k lives here
    activation: ActivationSpec
    quant: QuantConfig
    dtype: DtypeName  # activations, unquantised weights, router gate and shared experts
    has_bias: bool = False  # w13_bias [E, 2I], w2_bias [E, H]
    apply_router_weight_on_input: bool = False
    router: bool = False  # gate [E, H]: clients may omit router logits
    router_bias: bool = False  # gate_bias [E] (gpt-oss)
    correction_bias: bool = False  # e_score_correction_bias [E] (DeepSeek-V3)
    shared_experts: bool = False
    shared_intermediate_size: int = Field(default=0, ge=0)
    shared_gate: bool = False  # Qwen2-MoE sigmoid gate [1, H] on the shared expert
    tensors_sha256: str = ""  # sha256 of experts.safetensors' header (names, dtypes, offsets)
    # weights.integrity: tensor name -> xxh3-64 of its bytes, one per expert for the tensors with
    # an expert axis. Empty in directories written before checksums (they load with a warning).
    tensors_xxh3: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        self.to_config()  # MoEConfig checks sizes against routing and quant
        if self.shared_experts != (self.shared_intermediate_size > 0):
            raise ValueError("shared_intermediate_size must be > 0 exactly when shared_experts")
        if self.shared_gate and not self.shared_experts:
            raise ValueError("shared_gate needs shared_experts")
        if self.router_bias and not self.router:
            raise ValueError("router_bias needs router")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_config(self) -> MoEConfig:
        return MoEConfig(
            num_experts=self.num_experts,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            routing=self.routing,
            activation=self.activation,
            quant=self.quant,
            dtype=DTYPES[self.dtype],
            has_bias=self.has_bias,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
        )

    @classmethod
    def from_config(
        cls, cfg: MoEConfig, weights: LayerWeights, *, name: str, source: Source
    ) -> Manifest:
        """The manifest of `weights` (laid out as `cfg` says); the hashes are filled in on write."""
        router, shared = weights.router, weights.shared
        dtype_name = next(n for n, d in DTYPES.items() if d == cfg.dtype)
        return cls(
            name=name,
            source=source,
            num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            routing=cfg.routing,
            activation=cfg.activation,
            quant=cfg.quant,
            dtype=dtype_name,
            has_bias=cfg.has_bias,
            apply_router_weight_on_input=cfg.apply_router_weight_on_input,
            router=router.weight is not None,
            router_bias=router.bias is not None,
            correction_bias=router.correction_bias is not None,
            shared_experts=shared is not None,
            shared_intermediate_size=0 if shared is None else shared.w2.shape[1],
            shared_gate=shared is not None and shared.gate is not None,
        )
