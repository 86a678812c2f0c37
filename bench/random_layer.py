"""Random full-size layers made where they run: weights are drawn and quantised on the target
device, a few experts at a time, so a DeepSeek-V3 layer (~11 GB in fp8) never exists on the CPU
nor in float32 all at once.
"""

from __future__ import annotations

import torch

from ..kernels.config import MoEConfig
from ..kernels.layer import LayerWeights, RouterWeights, SharedExpert
from ..kernels.quant_scheme import QuantScheme
from ..kernels.quantize import quantize_weight
from ..kernels.tensors import ExpertWeights

_CHUNK_ELEMENTS = 1 << 28  # float32 draws of at most 1 GiB before quantising


def _random_quantized(
    cfg: MoEConfig, shape: tuple[int, int, int], generator: torch.Generator, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw [E, N, K] ~ N(0, 1/K) expert by expert chunk and quantise it in cfg.quant's layout."""
    e, n, k = shape
    device = generator.device
    step = max(1, _CHUNK_ELEMENTS // (n * k))
    weight = scale = None
    for start in range(0, e, step):
        stop = min(e, start + step)
        w = torch.randn(stop - start, n, k, generator=generator, device=device) / k**0.5
        q, s = quantize_weight(w, cfg.quant, parts)
        if cfg.quant.scheme == QuantScheme.NONE:
            q = q.to(cfg.dtype)
        if weight is None:
            weight = q.new_empty((e, *q.shape[1:]))
            scale = None if s is None else s.new_empty((e, *s.shape[1:]))
        weight[start:stop] = q
        if s is not None:
            scale[start:stop] = s
    return weight, scale


def random_layer(
    cfg: MoEConfig,
    device: torch.device,
    seed: int = 0,
    router: bool = False,
    shared_intermediate: int | None = None,
) -> LayerWeights:
    """Random LayerWeights of cfg's shape and scheme on `device`.

    router: a stored router [E, H] in cfg.dtype (else clients send logits); shared_intermediate:
    a shared expert of that intermediate size in cfg.dtype, as DeepSeek-V3's (2048)."""
    generator = torch.Generator(device).manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def dense(*shape: int) -> torch.Tensor:  # ~N(0, 1/fan_in), like the experts
        return (torch.randn(shape, generator=generator, device=device) / shape[-1] ** 0.5).to(
            cfg.dtype
        )

    w13, w13_scale = _random_quantized(cfg, (e, 2 * i, h), generator, cfg.w13_parts)
    w2, w2_scale = _random_quantized(cfg, (e, h, i), generator)
    biases = {}
    if cfg.has_bias:
        biases = {
            "w13_bias": torch.randn(e, 2 * i, generator=generator, device=device) / 2,
            "w2_bias": torch.randn(e, h, generator=generator, device=device) / 2,
        }
    correction = None
    if cfg.routing.num_groups > 1:  # DeepSeek-V3's score-correction bias steers the choice
        correction = torch.randn(e, generator=generator, device=device) / 100
    experts = ExpertWeights(w13, w2, w13_scale, w2_scale, **biases)
    weights = RouterWeights(weight=dense(e, h) if router else None, correction_bias=correction)
    shared = None
    if shared_intermediate is not None:
        shared = SharedExpert(dense(2 * shared_intermediate, h), dense(h, shared_intermediate))
    return LayerWeights(experts, weights, shared)
