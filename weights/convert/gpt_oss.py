"""gpt-oss: `model.layers.N.mlp.router.{weight, bias}` and stacked experts under
`mlp.experts.`, either MXFP4 (`gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 e2m1 pairs,
`gate_up_proj_scales` [E, 2I, H/32] uint8 e8m0, same for `down_proj_*`) or unquantised
(`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]: stored input-major, so transposed here), with
biases `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H].

Gate and up interleave along 2I; the activation is swigluoai (alpha 1.702, limit
`swiglu_limit`). Routing: top-k on the logits, then softmax over the k.
"""

from __future__ import annotations

import torch

from ...kernels.config import Activation, ActivationSpec, GateUp, RoutingConfig
from ...kernels.layer import LayerWeights, RouterWeights
from ...kernels.quant_scheme import MXFP4_GROUP, QuantConfig, QuantScheme
from ...kernels.tensors import ExpertWeights
from .hf import Checkpoint, ConvertedLayer, moe_config

_U8 = (torch.uint8,)


def _mxfp4(ckpt: Checkpoint) -> bool:
    quant = ckpt.quantization()
    if quant is None:
        return False
    if quant.get("quant_method") != "mxfp4":
        raise ckpt.config_error(
            f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported "
            "for gpt_oss (expected mxfp4 or none)"
        )
    return True


def _mxfp4_weight(ckpt: Checkpoint, name: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`{name}_blocks` [E, N, K/32, 16] -> packed [E, N, K/2]; `{name}_scales` [E, N, K/32]."""
    e = ckpt.config_int("num_local_experts")
    blocks = ckpt.get(f"{name}_blocks", (e, n, k // MXFP4_GROUP, MXFP4_GROUP // 2), _U8)
    scales = ckpt.get(f"{name}_scales", (e, n, k // MXFP4_GROUP), _U8, e8m0=True)
    # both put element 2j in the low nibble: the blocks are our packing, regrouped
    return blocks.flatten(-2), scales


def convert(ckpt: Checkpoint, layer: int) -> ConvertedLayer:
    ckpt.check_layer(layer)
    dtype = ckpt.dtype()
    e, h, i = (
        ckpt.config_int("num_local_experts"),
        ckpt.config_int("hidden_size"),
        ckpt.config_int("intermediate_size"),
    )
    mxfp4 = _mxfp4(ckpt)
    activation = ActivationSpec(
        Activation.SWIGLUOAI,
        GateUp.INTERLEAVED,
        limit=float(ckpt.config.get("swiglu_limit", 7.0)),
    )
    cfg = moe_config(
        ckpt,
        (e, h, i),
        routing=RoutingConfig(
            # the released configs carry both names; transformers reads num_experts_per_tok
            top_k=ckpt.config_int("num_experts_per_tok", ckpt.config.get("experts_per_token")),
            softmax_after_topk=True,
        ),
        activation=activation,
        quant=QuantConfig(QuantScheme.MXFP4 if mxfp4 else QuantScheme.NONE),
        has_bias=True,
    )
    prefix = f"model.layers.{layer}.mlp"
    if mxfp4:
        w13, w13_scale = _mxfp4_weight(ckpt, f"{prefix}.experts.gate_up_proj", 2 * i, h)
        w2, w2_scale = _mxfp4_weight(ckpt, f"{prefix}.experts.down_proj", h, i)
    else:
        w13 = ckpt.get_float(f"{prefix}.experts.gate_up_proj", (e, h, 2 * i)).transpose(1, 2)
        w2 = ckpt.get_float(f"{prefix}.experts.down_proj", (e, i, h)).transpose(1, 2)
        w13, w2, w13_scale, w2_scale = w13.to(dtype), w2.to(dtype), None, None
    experts = ExpertWeights(
        w13,
        w2,
        w13_scale,
        w2_scale,
        ckpt.get_float(f"{prefix}.experts.gate_up_proj_bias", (e, 2 * i)).float(),
        ckpt.get_float(f"{prefix}.experts.down_proj_bias", (e, h)).float(),
    )
    router = RouterWeights(
        weight=ckpt.get_float(f"{prefix}.router.weight", (e, h)).to(dtype),
        bias=ckpt.get_float(f"{prefix}.router.bias", (e,)).float(),
    )
    return ConvertedLayer(cfg, LayerWeights(experts, router), ckpt.source(layer))
