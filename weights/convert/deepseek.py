"""DeepSeek-V2 / V3 (and Kimi-K2, which ships a deepseek_v3 config):
`model.layers.N.mlp.{gate.weight, gate.e_score_correction_bias (V3), experts.e.*_proj,
shared_experts.*_proj}`. fp8 checkpoints (128 x 128 blocks, `.weight_scale_inv`) stay fp8-block
bit for bit; their shared experts are dequantised into the layer dtype.

Routing, from config.json:
- V3 `noaux_tc`: sigmoid scores, bias-corrected choice within the `topk_group` best of `n_group`
  groups (scored by their two best experts), renormalised iff `norm_topk_prob`, then scaled by
  `routed_scaling_factor`.
- V2 `greedy` / `group_limited_greedy` (groups scored by their best expert): softmax scores;
  V2 applies `routed_scaling_factor` only when it does not renormalise.
"""

from __future__ import annotations

from ...kernels.config import ActivationSpec, GroupScore, RoutingConfig, Scoring
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

_TOPK_METHODS = {
    "deepseek_v2": ("greedy", "group_limited_greedy"),
    "deepseek_v3": ("noaux_tc",),
}


def _check_sparse(ckpt: Checkpoint, layer: int) -> None:
    first = ckpt.config_int("first_k_dense_replace", 0)
    freq = ckpt.config_int("moe_layer_freq", 1)
    if layer < first or freq == 0 or layer % freq:
        raise ckpt.config_error(
            f"layer {layer} is a dense MLP layer (first_k_dense_replace={first}, "
            f"moe_layer_freq={freq}): it has no experts to convert"
        )


def _routing(ckpt: Checkpoint) -> RoutingConfig:
    version = ckpt.model_type
    method = ckpt.config.get("topk_method", _TOPK_METHODS[version][0])
    if method not in _TOPK_METHODS[version]:
        raise ckpt.config_error(
            f"topk_method {method!r} is not one of {_TOPK_METHODS[version]} for {version}"
        )
    scoring = ckpt.config.get("scoring_func", "softmax")
    if scoring not in (Scoring.SOFTMAX, Scoring.SIGMOID):
        raise ckpt.config_error(f"scoring_func {scoring!r} is not softmax or sigmoid")
    renormalize = bool(ckpt.config.get("norm_topk_prob", False))
    scaling = float(ckpt.config.get("routed_scaling_factor") or 1.0)
    grouped = method != "greedy"
    try:
        return RoutingConfig(
            top_k=ckpt.config_int("num_experts_per_tok"),
            scoring=Scoring(scoring),
            renormalize=renormalize,
            num_groups=ckpt.config_int("n_group", 1) if grouped else 1,
            topk_groups=ckpt.config_int("topk_group", 1) if grouped else 1,
            group_score=GroupScore.TOP2_SUM if method == "noaux_tc" else GroupScore.MAX,
            routed_scaling_factor=1.0 if version == "deepseek_v2" and renormalize else scaling,
        )
    except ValueError as err:
        raise ckpt.config_error(str(err)) from err


def convert(ckpt: Checkpoint, layer: int) -> ConvertedLayer:
    ckpt.check_layer(layer)
    _check_sparse(ckpt, layer)
    dtype = ckpt.dtype()
    h, i = ckpt.config_int("hidden_size"), ckpt.config_int("moe_intermediate_size")
    sizes = (ckpt.config_int("n_routed_experts"), h, i)
    cfg = moe_config(
        ckpt, sizes, routing=_routing(ckpt), activation=ActivationSpec(ckpt.activation())
    )
    prefix = f"model.layers.{layer}.mlp"
    experts = stack_gated_experts(ckpt, prefix + HF_EXPERT_TEMPLATE, HF_PROJECTIONS, sizes, dtype)
    router = RouterWeights(weight=ckpt.get_float(f"{prefix}.gate.weight", (sizes[0], h)).to(dtype))
    if ckpt.model_type == "deepseek_v3":
        bias = ckpt.get_float(f"{prefix}.gate.e_score_correction_bias", (sizes[0],))
        router.correction_bias = bias.float()
    shared = None
    if n_shared := ckpt.config_int("n_shared_experts", 0):
        shared = read_shared_expert(
            ckpt, prefix + ".shared_experts.{proj}.weight", (h, i * n_shared), dtype
        )
    return ConvertedLayer(cfg, LayerWeights(experts, router, shared), ckpt.source(layer))
