"""Weights and inputs of the external backends' GPU tests, for layers of bench/shapes.py.

DeepSeek-V3 (fp8 block, E=256, H=7168, I=2048, top 8 of 8 groups) and gpt-oss-120b (MXFP4,
swigluoai with biases, E=128, H=I=2880, top 4), each at full size and scaled down. Weights are
drawn and quantised on the GPU, a few experts at a time, with the one quantiser
(kernels.quantize), so a full-size layer never exists in float32 at once.
"""

from __future__ import annotations

import functools

import torch

from moe_serve.bench.shapes import SHAPES
from moe_serve.kernels.config import MoEConfig
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import Batched
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quantize import quantize_weight
from moe_serve.kernels.routing import route
from moe_serve.kernels.stages import Experts
from moe_serve.kernels.tensors import ExpertWeights, Routing
from moe_serve.kernels.workspace import Workspace

EXPERTS_PER_DRAW = 16


def _quantized(cfg: MoEConfig, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, scale = quantize_weight(w, cfg.quant)
    return (q.to(cfg.dtype) if scale is None else q), scale


@functools.cache
def layer_weights(name: str, seed: int = 0) -> ExpertWeights:
    cfg, dev = SHAPES[name], torch.device("cuda")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device=dev).manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {"w13": [], "s13": [], "w2": [], "s2": []}
    for start in range(0, e, EXPERTS_PER_DRAW):
        n = min(EXPERTS_PER_DRAW, e - start)
        w13, s13 = _quantized(cfg, torch.randn(n, 2 * i, h, device=dev, generator=g) / h**0.5)
        w2, s2 = _quantized(cfg, torch.randn(n, h, i, device=dev, generator=g) / i**0.5)
        for key, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
            if t is not None:
                parts[key].append(t)
    cat = {k: torch.cat(v) if v else None for k, v in parts.items()}
    biases = (None, None)
    if cfg.has_bias:
        biases = (
            torch.randn(e, 2 * i, device=dev, generator=g) / 2,
            torch.randn(e, h, device=dev, generator=g) / 2,
        )
    return ExpertWeights(cat["w13"], cat["w2"], cat["s13"], cat["s2"], *biases)


def layer_inputs(name: str, m: int, crowded: bool = False, seed: int = 1) -> tuple:
    """hidden [M, H], logits [M, E], routing. `crowded`: every token to experts 0..k-1, so one
    expert gets all tokens at slot 0 and the others none."""
    cfg, dev = SHAPES[name], torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(m, cfg.hidden_size, device=dev, generator=g).to(cfg.dtype)
    logits = torch.randn(m, cfg.num_experts, device=dev, generator=g)
    routing = route(logits, cfg.routing)
    if crowded:
        ids = torch.arange(cfg.top_k, device=dev, dtype=torch.int32).expand(m, -1).contiguous()
        routing = Routing(ids, routing.topk_weights)
    return hidden, logits, routing


def modular(experts: Experts, chunk_tokens: int = 8192) -> ModularKernel:
    pf = Batched() if experts.format == "batched" else NoEP()
    return ModularKernel(pf, experts, Workspace(torch.device("cuda")), chunk_tokens=chunk_tokens)


@functools.cache
def reference_output(name: str, m: int, crowded: bool = False) -> torch.Tensor:
    cfg = SHAPES[name]
    hidden, _, routing = layer_inputs(name, m, crowded)
    return modular(ReferenceExperts(cfg, layer_weights(name))).forward(hidden, routing).float()
