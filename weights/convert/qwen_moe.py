"""Qwen2-MoE and Qwen3-MoE: `model.layers.N.mlp.{gate, experts.e.gate_proj/up_proj/down_proj}`;
Qwen2-MoE adds `shared_expert.*` scaled by sigmoid(`shared_expert_gate`). Softmax top-k,
renormalised iff `norm_topk_prob`. Layers in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, are dense."""

from __future__ import annotations

from ...kernels.config import ActivationSpec, RoutingConfig
from ...kernels.layer import LayerWeights, RouterWeights
from .hf import (
    HF_EXPERT_TEMPLATE,
    HF_PROJECTIONS,
    Checkpoint,
    ConvertedLayer,
    moe_config,
    read_shared_expert,
    stack_gated_experts,
)


def _check_sparse(ckpt: Checkpoint, layer: int) -> None:
    step = ckpt.config_int("decoder_sparse_step", 1)
    dense_layers = ckpt.config.get("mlp_only_layers") or []
    if layer in dense_layers or step == 0 or (layer + 1) % step:
        raise ckpt.config_error(
            f"layer {layer} is a dense MLP layer (mlp_only_layers={dense_layers}, "
            f"decoder_sparse_step={step}): it has no experts to convert"
        )


def convert(ckpt: Checkpoint, layer: int) -> ConvertedLayer:
    ckpt.check_layer(layer)
    _check_sparse(ckpt, layer)
    dtype = ckpt.dtype()
    h = ckpt.config_int("hidden_size")
    sizes = (ckpt.config_int("num_experts"), h, ckpt.config_int("moe_intermediate_size"))
    routing = RoutingConfig(
        top_k=ckpt.config_int("num_experts_per_tok"),
        renormalize=bool(ckpt.config.get("norm_topk_prob", False)),
    )
    cfg = moe_config(ckpt, sizes, routing=routing, activation=ActivationSpec(ckpt.activation()))
    prefix = f"model.layers.{layer}.mlp"
    experts = stack_gated_experts(ckpt, prefix + HF_EXPERT_TEMPLATE, HF_PROJECTIONS, sizes, dtype)
    gate = ckpt.get_float(f"{prefix}.gate.weight", sizes[:2]).to(dtype)
    shared = None
    shared_size = ckpt.config_int("shared_expert_intermediate_size", 0)
    if ckpt.model_type == "qwen2_moe" and shared_size:
        shared = read_shared_expert(
            ckpt,
            prefix + ".shared_expert.{proj}.weight",
            (h, shared_size),
            dtype,
            gate_name=f"{prefix}.shared_expert_gate.weight",
        )
    weights = LayerWeights(experts, RouterWeights(weight=gate), shared)
    return ConvertedLayer(cfg, weights, ckpt.source(layer))
