"""The layer shapes the kernel benchmark and the GPU tests run, by name: one table.

The four reference shapes (Mixtral, Qwen3, DeepSeek-V3, gpt-oss) at full size (Mixtral twice:
bf16 and fp8 per-tensor), Qwen3 with GPTQ-style int4 weights as well, DeepSeek-V3 and gpt-oss
scaled down (`-small`: the rule table `--backend auto` follows has a row for small layers too;
the GPU tests of the external backends), and `tiny` for CPU runs and tests.
"""

from __future__ import annotations

import torch

from ..kernels.config import ActivationSpec, GroupScore, MoEConfig, RoutingConfig, Scoring
from ..kernels.quant_scheme import QuantConfig, QuantScheme

_MIXTRAL_ROUTING = RoutingConfig(top_k=2)
_MIXTRAL = {"num_experts": 8, "hidden_size": 4096, "intermediate_size": 14336}

_DEEPSEEK_V3_ROUTING = RoutingConfig(
    top_k=8,
    scoring=Scoring.SIGMOID,
    num_groups=8,
    topk_groups=4,
    group_score=GroupScore.TOP2_SUM,
    routed_scaling_factor=2.5,
)
_FP8_BLOCK = QuantConfig(QuantScheme.FP8_BLOCK)
_GPT_OSS = {
    "routing": RoutingConfig(top_k=4, softmax_after_topk=True),
    "activation": ActivationSpec(kind="swigluoai", gate_up="interleaved"),
    "has_bias": True,
}

SHAPES: dict[str, MoEConfig] = {
    "mixtral": MoEConfig(**_MIXTRAL, routing=_MIXTRAL_ROUTING),
    "mixtral-fp8": MoEConfig(
        **_MIXTRAL, routing=_MIXTRAL_ROUTING, quant=QuantConfig(QuantScheme.FP8_TENSOR)
    ),
    "qwen3": MoEConfig(
        num_experts=128, hidden_size=2048, intermediate_size=768, routing=RoutingConfig(top_k=8)
    ),
    # Qwen3-30B-A3B-GPTQ-Int4's layout: 4-bit weights, a scale per 128 K columns, bf16 activations
    "qwen3-int4": MoEConfig(
        num_experts=128,
        hidden_size=2048,
        intermediate_size=768,
        routing=RoutingConfig(top_k=8),
        quant=QuantConfig(QuantScheme.INT4_W4A16, group_size=128),
    ),
    "deepseek-v3": MoEConfig(256, 7168, 2048, _DEEPSEEK_V3_ROUTING, quant=_FP8_BLOCK),
    "deepseek-v3-small": MoEConfig(16, 512, 256, _DEEPSEEK_V3_ROUTING, quant=_FP8_BLOCK),
    "gpt-oss": MoEConfig(128, 2880, 2880, quant=QuantConfig(QuantScheme.MXFP4), **_GPT_OSS),
    "gpt-oss-small": MoEConfig(8, 256, 320, quant=QuantConfig(QuantScheme.MXFP4), **_GPT_OSS),
    "gpt-oss-bf16-small": MoEConfig(8, 256, 320, **_GPT_OSS),
    # CPU runs and tests: float32, because CPU kernels have no bf16 fast path worth timing.
    "tiny": MoEConfig(
        num_experts=8,
        hidden_size=64,
        intermediate_size=128,
        routing=RoutingConfig(top_k=2),
        dtype=torch.float32,
    ),
}

DEFAULT_SHAPES = ("mixtral", "mixtral-fp8", "qwen3", "deepseek-v3", "gpt-oss")


def parse_shapes(text: str) -> list[str]:
    """ "a,b" -> ["a", "b"], each a known shape name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"unknown shape(s) {unknown or text!r}; known: {', '.join(SHAPES)}")
    return names


def precision(cfg: MoEConfig) -> str:
    """The dense-GEMM precision whose peak bounds this layer: fp8 when activations are fp8."""
    if cfg.quant.spec.act_quant is not None:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[cfg.dtype]
