"""What an engine is given and what it serves: a loaded layer's source, the layer as served, and
the error of a forward whose output is not finite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ...kernels.config import MoEConfig
from ...kernels.layer import LayerOutput, LayerWeights, MoELayer
from ...kernels.layer_graphs import LayerGraphs
from ...kernels.selection import Selection


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
    graphs: LayerGraphs | None = None  # whole-layer CUDA graphs, where the backend captures

    @property
    def backend(self) -> str:
        return self.selection.experts.name

    @property
    def by_tokens(self) -> tuple[tuple[int, str], ...]:
        """(from this many tokens, the experts backend that runs), ascending."""
        return self.layer.kernel.experts.by_tokens()

    @property
    def has_router(self) -> bool:
        return self.layer.router.weight is not None


class NonFiniteRows(Exception):
    """A forward ran, but its output holds NaN or Inf; `result` is the whole output, on the CPU
    (service.engine.batcher fails only the requests that own such rows)."""

    def __init__(self, layer: str, result: LayerOutput) -> None:
        self.result = result
        super().__init__(f"the output of layer {layer!r} holds NaN or Inf")
