"""Mixtral: `model.layers.N.block_sparse_moe.{gate, experts.e.w1/w3/w2}` (w1 gate, w3 up, w2
down). Softmax over all experts, top-k, renormalised."""

from __future__ import annotations

from ...kernels.config import ActivationSpec, RoutingConfig
from ...kernels.layer import LayerWeights, RouterWeights
from .hf import Checkpoint, ConvertedLayer, moe_config, stack_gated_experts


def convert(ckpt: Checkpoint, layer: int) -> ConvertedLayer:
    ckpt.check_layer(layer)
    dtype = ckpt.dtype()
    sizes = (
        ckpt.config_int("num_local_experts"),
        ckpt.config_int("hidden_size"),
        ckpt.config_int("intermediate_size"),
    )
    routing = RoutingConfig(top_k=ckpt.config_int("num_experts_per_tok"), renormalize=True)
    cfg = moe_config(ckpt, sizes, routing=routing, activation=ActivationSpec(ckpt.activation()))
    prefix = f"model.layers.{layer}.block_sparse_moe"
    experts = stack_gated_experts(
        ckpt, prefix + ".experts.{e}.{proj}.weight", ("w1", "w3", "w2"), sizes, dtype
    )
    gate = ckpt.get_float(f"{prefix}.gate.weight", sizes[:2]).to(dtype)
    weights = LayerWeights(experts, RouterWeights(weight=gate))
    return ConvertedLayer(cfg, weights, ckpt.source(layer))
