"""Shared by the CPU (interpreter) and GPU tests of the Triton experts: layer builders and the
side-by-side run against the reference backend (bounds: kernels/accuracy.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.config import Activation, ActivationSpec, GateUp, MoEConfig, RoutingConfig
from moe_serve.kernels.experts._triton.tiles import LayerTiles
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.triton import TritonBatchedExperts, TritonExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import Batched
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import Format, Routing
from moe_serve.kernels.workspace import Workspace

ALL_SCHEMES = tuple(QuantScheme)


@dataclass(frozen=True)
class Case:
    """One layer configuration under test."""

    scheme: QuantScheme = QuantScheme.NONE
    dtype: torch.dtype = torch.float16
    activation: Activation = Activation.SILU
    gate_up: GateUp = GateUp.SPLIT
    has_bias: bool = False
    num_experts: int = 4
    hidden: int = 64
    intermediate: int = 96  # not a multiple of the 64-wide N tiles
    top_k: int = 2
    group_size: int = 32
    limit: float = 1.5  # swigluoai: low enough that the clamps act on random inputs

    def config(self) -> MoEConfig:
        return MoEConfig(
            num_experts=self.num_experts,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            routing=RoutingConfig(top_k=self.top_k),
            activation=ActivationSpec(self.activation, self.gate_up, limit=self.limit),
            quant=QuantConfig(self.scheme, self.group_size),
            dtype=self.dtype,
            has_bias=self.has_bias,
        )


def random_routing(
    m: int, num_experts: int, top_k: int, seed: int, only: int | None = None
) -> Routing:
    """Distinct experts per token; `only` sends every token's first slot to that expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(m)])
    if only is not None:
        others = [[e for e in row.tolist() if e != only][: top_k - 1] for row in ids]
        ids = torch.tensor([[only, *rest] for rest in others])
    weights = torch.rand(m, top_k, generator=g) + 0.1
    return Routing(ids.reshape(m, top_k).to(torch.int32), weights / weights.sum(1, keepdim=True))


def _forward(
    cfg: MoEConfig,
    routing: Routing,
    device: torch.device,
    fmt: Format,
    expert_map: torch.Tensor | None,
    seed: int,
    tiles: LayerTiles | None,
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """The Triton experts' output in `fmt` on seeded inputs, and the reference's on the same."""
    weights = random_expert_weights(cfg, seed).to(device)
    m = routing.topk_ids.shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(m, cfg.hidden_size, generator=g).to(cfg.dtype).to(device)
    routing = Routing(routing.topk_ids.to(device), routing.topk_weights.to(device))
    local = weights if expert_map is None else weights.select(torch.nonzero(expert_map >= 0)[:, 0])
    fast_cls, stage = (
        (TritonExperts, NoEP()) if fmt == Format.STANDARD else (TritonBatchedExperts, Batched())
    )
    emap = None if expert_map is None else expert_map.to(device)
    fast = ModularKernel(stage, fast_cls(cfg, local.to(device), tiles), Workspace(device), emap)
    ref = ModularKernel(NoEP(), ReferenceExperts(cfg, local.to(device)), Workspace(device), emap)
    out = fast.forward(hidden, routing)
    assert out.dtype == cfg.dtype and out.shape == hidden.shape
    return out, lambda: ref.forward(hidden, routing)


def run_triton(
    cfg: MoEConfig, routing: Routing, device: torch.device, fmt: Format, tiles: LayerTiles
) -> torch.Tensor:
    """The Triton experts' output in `fmt` with these tiles (seeded inputs, on the CPU)."""
    return _forward(cfg, routing, device, fmt, None, 0, tiles)[0].cpu()


def triton_vs_reference(
    cfg: MoEConfig,
    routing: Routing,
    device: torch.device,
    fmt: Format = Format.STANDARD,
    expert_map: torch.Tensor | None = None,
    seed: int = 0,
    tiles: LayerTiles | None = None,
) -> float:
    """Relative error of the Triton experts in `fmt` against the reference, same inputs."""
    out, reference = _forward(cfg, routing, device, fmt, expert_map, seed, tiles)
    return relative_error(out.cpu(), reference().cpu())
