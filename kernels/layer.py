"""A whole MoE block: router -> routed experts (modular kernel) -> + shared experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.activations import apply_activation
from kernels.config import ActivationSpec, MoEConfig
from kernels.modular import DEFAULT_CHUNK_TOKENS, ModularKernel
from kernels.routing import route
from kernels.selection import Selection, select
from kernels.stages import PrepareFinalize
from kernels.tensors import ExpertWeights, ForwardInputs, Routing
from kernels.workspace import Workspace


@dataclass
class RouterWeights:
    weight: torch.Tensor | None = None  # [E, H]; None: clients must send router logits
    bias: torch.Tensor | None = None  # [E]
    correction_bias: torch.Tensor | None = None  # [E] steers the choice only (DeepSeek-V3)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> float32 logits [M, E]."""
        logits = hidden.float() @ self.weight.float().T
        return logits if self.bias is None else logits + self.bias.float()


@dataclass
class SharedExpert:
    """A dense SiLU MLP every token visits (DeepSeek shared_experts, Qwen2-MoE shared_expert)."""

    w13: torch.Tensor  # [2I_s, H], gate rows then up rows
    w2: torch.Tensor  # [H, I_s]
    gate: torch.Tensor | None = None  # [1, H]: Qwen2-MoE scales the output by sigmoid(x @ gate.T)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> float32 [M, H]."""
        x = hidden.float()
        h = apply_activation(x @ self.w13.float().T, ActivationSpec())
        out = h @ self.w2.float().T
        if self.gate is not None:
            out = out * torch.sigmoid(x @ self.gate.float().T)
        return out


@dataclass
class LayerWeights:
    experts: ExpertWeights
    router: RouterWeights
    shared: SharedExpert | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        named = dict(self.experts.tensors())
        for prefix, part in (("router", self.router), ("shared", self.shared)):
            if part is not None:
                named |= {f"{prefix}.{n}": t for n, t in vars(part).items() if t is not None}
        return named

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class LayerOutput:
    output: torch.Tensor  # [M, H] in the layer's dtype
    routing: Routing


class MoELayer:
    def __init__(self, cfg: MoEConfig, kernel: ModularKernel, weights: LayerWeights) -> None:
        self.cfg = cfg
        self.kernel = kernel
        self.router = weights.router
        self.shared = weights.shared

    def forward(self, inputs: ForwardInputs) -> LayerOutput:
        hidden, logits = inputs.hidden_states, inputs.router_logits
        cfg = self.cfg
        if hidden.shape[1] != cfg.hidden_size:
            raise ValueError(
                f"hidden_states has {hidden.shape[1]} columns, the layer's hidden size is "
                f"{cfg.hidden_size}"
            )
        if logits is None:
            if self.router.weight is None:
                raise ValueError("this layer has no stored router: send router_logits")
            logits = self.router.logits(hidden)
        elif logits.shape[1] != cfg.num_experts:
            raise ValueError(
                f"router_logits has {logits.shape[1]} columns, the layer has "
                f"{cfg.num_experts} experts"
            )
        routing = route(logits, cfg.routing, self.router.correction_bias)
        out = self.kernel.forward(hidden.to(cfg.dtype), routing)
        if self.shared is not None:
            out = (out.float() + self.shared.forward(hidden)).to(cfg.dtype)
        return LayerOutput(out, routing)


def build_layer(
    cfg: MoEConfig,
    weights: LayerWeights,
    device: torch.device,
    backend: str = "auto",
    workspace: Workspace | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    expert_map: torch.Tensor | None = None,
    prepare_finalize: PrepareFinalize | None = None,
) -> tuple[MoELayer, Selection]:
    """Pick a backend for the layer on `device` and compose its modular kernel.

    `weights` must already be on `device`. Layers built with the same `workspace` share it.
    `chunk_tokens`: the most tokens one pass through the experts takes (ModularKernel).
    Expert parallelism: `weights` holds this rank's experts, `expert_map` [E] maps each global
    expert id to its local id (-1: another rank's), the backend is chosen among those that take
    an expert_map, and `prepare_finalize` is the collective stage (default: naive-ep's).
    """
    choice = select(cfg, device, backend, expert_parallel=expert_map is not None)
    experts = choice.experts(cfg, weights.experts)
    kernel = ModularKernel(
        prepare_finalize or choice.prepare_finalize(),
        experts,
        workspace or Workspace(device),
        expert_map,
        chunk_tokens,
    )
    return MoELayer(cfg, kernel, weights), choice
