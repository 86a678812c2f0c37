"""Engine: layer name -> MoE layer built on the device; `forward` runs one batch of one layer.

Every forward goes through `Engine.forward` on the batcher's single worker thread, so the
layers can share one Workspace (their forwards never overlap) and one device stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.config import MoEConfig
from kernels.layer import LayerOutput, LayerWeights, MoELayer, build_layer
from kernels.modular import DEFAULT_CHUNK_TOKENS
from kernels.selection import Selection
from kernels.tensors import ForwardInputs, Routing
from kernels.workspace import Workspace
from service.errors import NotReady, UnknownLayer

log = logging.getLogger(__name__)


class LayerSource(Protocol):
    """What the engine needs of a loaded layer (weights.load.LoadedLayer fits)."""

    name: str
    config: MoEConfig
    weights: LayerWeights  # already on the engine's device


@dataclass(frozen=True)
class ServedLayer:
    name: str
    config: MoEConfig
    layer: MoELayer
    selection: Selection
    device_bytes: int  # the layer's weights on the device

    @property
    def backend(self) -> str:
        return self.selection.experts.name

    @property
    def has_router(self) -> bool:
        return self.layer.router.weight is not None


class Engine:
    def __init__(
        self, device: torch.device, backend: str = "auto", chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    ) -> None:
        self.device = device
        self.backend = backend
        self.chunk_tokens = chunk_tokens  # the largest batch (--max-batch-tokens): never split
        self.workspace = Workspace(device)  # shared by every layer
        self.layers: dict[str, ServedLayer] = {}
        self.failure: str | None = None  # why this engine can serve no more; None while it can
        self.on_failure: Callable[[str], None] = lambda _reason: None  # the app turns unready

    def add(self, source: LayerSource) -> ServedLayer:
        """Build `source`'s modular kernel on the device (backend chosen per layer)."""
        if source.name in self.layers:
            raise ValueError(f"two layers are named {source.name!r}; layer names must be unique")
        layer, selection = self.build(source)
        served = ServedLayer(source.name, source.config, layer, selection, source.weights.nbytes())
        self.layers[source.name] = served
        log.info(
            "layer %s: %s + %s (%s)",
            source.name,
            selection.prepare_finalize.name,
            selection.experts.name,
            selection.reason,
        )
        return served

    def load(self, source: LayerSource, token_counts: Sequence[int]) -> ServedLayer:
        """Add layer `source`, or replace the one of its name, warmed up at `token_counts`.
        Atomic: if building or warming fails, the layers are as they were (the old one serves).
        Call it where forwards run (the batcher's worker), so that none runs meanwhile."""
        old = self.layers.pop(source.name, None)
        try:
            served = self.add(source)
            self.warm_up(token_counts, [source.name])
        except BaseException:
            self.layers.pop(source.name, None)
            if old is not None:
                self.layers[source.name] = old
            raise
        return served

    def remove(self, name: str) -> ServedLayer:
        """Stop serving layer `name` (its device memory goes with the last reference)."""
        served = self.get(name)
        del self.layers[name]
        log.info("layer %s removed", name)
        return served

    def build(self, source: LayerSource) -> tuple[MoELayer, Selection]:
        """`source`'s layer on the device (expert parallelism composes its own)."""
        return build_layer(
            source.config,
            source.weights,
            self.device,
            self.backend,
            self.workspace,
            self.chunk_tokens,
        )

    def get(self, name: str) -> ServedLayer:
        try:
            return self.layers[name]
        except KeyError:
            known = ", ".join(sorted(self.layers)) or "none"
            raise UnknownLayer(f"no layer named {name!r}; served layers: {known}") from None

    def forward(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        """One batch [M, H] of layer `name` (CPU tensors) -> output [M, H] and routing, on CPU.

        The one path from a batch to the device and back: expert parallelism replaces this.
        """
        if self.failure is not None:
            raise NotReady(self.failure)
        served = self.get(name)
        logits = inputs.router_logits
        on_device = ForwardInputs(
            inputs.hidden_states.to(self.device),
            None if logits is None else logits.to(self.device),
        )
        try:
            with torch.inference_mode():
                result = served.layer.forward(on_device)
        except torch.AcceleratorError as err:
            # A device fault (illegal address, ECC) leaves the CUDA context unusable: every later
            # forward would fail too, so stop serving and let the orchestrator replace us.
            self.failure = f"the device failed: {err}"
            self.on_failure(self.failure)
            raise NotReady(self.failure) from err
        routing = result.routing
        return LayerOutput(
            result.output.cpu(), Routing(routing.topk_ids.cpu(), routing.topk_weights.cpu())
        )

    def warm_up(self, token_counts: Sequence[int], names: Sequence[str] | None = None) -> None:
        """Run every layer (or those named) at each of `token_counts`, so no request pays for a
        kernel's first compile or a workspace allocation (a JIT compile mid-load stalls its batch
        for seconds)."""
        generator = torch.Generator().manual_seed(0)
        for name in list(self.layers) if names is None else names:
            served = self.layers[name]
            cfg = served.config
            for tokens in token_counts:
                hidden = torch.randn(tokens, cfg.hidden_size, generator=generator)
                logits = None if served.has_router else torch.zeros(tokens, cfg.num_experts)
                out = self.forward(name, ForwardInputs(hidden, logits)).output
                if not torch.isfinite(out.float()).all():
                    raise RuntimeError(f"warm-up forward of layer {name!r} produced NaN or Inf")
