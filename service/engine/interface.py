"""What an engine is: the interface the runtime, the batcher, the routes and the model
repository use (`ServingEngine`), which one process's engine (service/engine/engine.py) and
expert parallelism's (service/ep/engine.py) implement; what it is given and what it serves: a
loaded layer's source, the layer as served, a batch's result and the error of a forward whose
output is not finite."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ...kernels.config import MoEConfig
from ...kernels.layer import LayerOutput, LayerWeights, MoELayer
from ...kernels.layer_graphs import LayerGraphs
from ...kernels.placement import Placement
from ...kernels.selection import Selection
from ...kernels.tensors import ForwardInputs


class LayerSource(Protocol):
    """What the engine needs of a loaded layer (weights.load.LoadedLayer fits)."""

    name: str
    config: MoEConfig
    weights: LayerWeights  # already on `device`
    device: torch.device  # one of the engine's devices: the one that serves the layer


@dataclass(frozen=True)
class ServedLayer:
    name: str
    config: MoEConfig
    layer: MoELayer
    selection: Selection
    device_bytes: int  # the layer's weights on the device
    device: torch.device  # where it runs: its own streams, workspace and graphs there
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


@dataclass(frozen=True)
class StageTimes:
    """Where one batch's time went."""

    forward_s: float  # device time from CUDA events on a GPU; host time elsewhere
    stage_s: float = 0.0  # host: copying the parts into the pinned staging buffer
    h2d_s: float | None = None  # device: host-to-device copy (None off the GPU)
    d2h_s: float | None = None  # device: device-to-host copy (None off the GPU)


@dataclass(frozen=True)
class BatchResult:
    # one per part, on the CPU, output in the layer's dtype (or, written into a part's own
    # `into` on a GPU, in that tensor's dtype)
    outputs: list[LayerOutput]
    expert_tokens: torch.Tensor  # [E] int64 pairs per expert over the batch, on the CPU
    times: StageTimes
    # every output value is finite: one reduction where the forward ran, copied out with the
    # output; only when False are the parts' rows looked at (service.engine.batcher)
    finite: bool
    # every input value is finite (the batch as staged, in the layer's dtype, so also within its
    # range); only when False are the parts' values checked on the host (service.engine.batcher)
    inputs_finite: bool


class Pending(Protocol):
    def done(self) -> bool:
        """Whether `result` would return without waiting for the device (it may raise what
        made the device fail)."""

    def result(self) -> BatchResult:
        """Block until the batch is done; raises what its forward raised."""


class ServingEngine(Protocol):
    """Layer name -> layer on one of the engine's devices; `start` runs one batch of one layer.
    The batcher's launcher thread calls `start`; `add`, `load` and `remove` run where no
    forward does (at start-up, or on the batcher's worker)."""

    devices: tuple[torch.device, ...]  # where layers may be placed (ServedLayer.device)
    chunk_tokens: int  # the largest batch: the batcher never sends more tokens at once
    layers: dict[str, ServedLayer]
    failure: str | None  # why the engine can serve no more; None while it can
    on_failure: Callable[[str], None]  # called with `failure` once it is set
    on_degraded: Callable[[str], None]  # serving on fewer expert-parallel ranks, and why
    on_status: Callable[[str], None]  # what a layer being added waits for (its calibration)

    @property
    def enqueues(self) -> bool:
        """True: `start` only stages and enqueues device work, returning before it is done."""
        ...

    @property
    def max_in_flight(self) -> int:
        """Batches `start` may have running at once on one device."""
        ...

    @property
    def start_may_wait(self) -> bool:
        """Whether `start` may wait for something other than its own copies; the batcher then
        never calls it on the event loop."""
        ...

    def add(self, source: LayerSource) -> ServedLayer:
        """Serve `source` (built on its device, not yet warmed up)."""
        ...

    def load(self, source: LayerSource, token_counts: Sequence[int]) -> ServedLayer:
        """Add or replace layer `source`, warmed up at `token_counts`; atomic."""
        ...

    def remove(self, name: str) -> ServedLayer:
        """Stop serving layer `name`."""
        ...

    def get(self, name: str) -> ServedLayer:
        """Layer `name`; UnknownLayer (404) if none is served."""
        ...

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ) -> Pending:
        """Begin one batch of layer `name`: one output per part, in the layer's dtype, each
        written into its `into` tensor where one is given and the engine enqueues."""
        ...

    def warm_up(self, token_counts: Sequence[int], names: Sequence[str] | None = None) -> None:
        """Run every layer (or those named) at each of `token_counts`, so no request pays for
        a first compile or capture."""
        ...

    def placement(self, name: str) -> dict:
        """Which rank holds which of the layer's experts (Conflict, 409, without expert
        parallelism)."""
        ...

    def rebalance(
        self, name: str, ranks: Sequence[Sequence[int]] | None, redundant: int | None = None
    ) -> Placement:
        """Switch the layer to another placement (Conflict, 409, without expert
        parallelism)."""
        ...

    def close(self) -> None:
        """Stop what the engine started (expert parallelism's other ranks)."""
        ...
