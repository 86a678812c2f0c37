"""CUDA graphs for decode: one captured forward per token count, so a small batch costs one
graph launch instead of a dozen kernel launches (align, GEMMs, top-k sum; per pair, the GEMVs
alone).

Each graph owns its buffers (allocated while capturing, from one pool shared by this layer's
graphs) rather than the shared Workspace, whose buffers may move when another layer grows them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from ...graph_capture import capturing
from ...quant_scheme import ActQuant
from ...tensors import Dispatched

MAX_GRAPH_TOKENS = 64  # decode: beyond this the GEMMs dwarf the launches


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Dispatched  # static copies the graph reads
    output: torch.Tensor  # [M, H], overwritten by each replay


def _static_copy(x: Dispatched) -> Dispatched:
    tensors = {f.name: getattr(x, f.name) for f in fields(x)}
    return replace(x, **{n: t.clone() for n, t in tensors.items() if isinstance(t, torch.Tensor)})


def _refill(static: Dispatched, x: Dispatched) -> None:
    for f in fields(x):
        live = getattr(x, f.name)
        if isinstance(live, torch.Tensor):
            getattr(static, f.name).copy_(live)


class DecodeGraphs:
    """Replays `forward` (Dispatched -> [M, H]) from a graph captured at the first call per M."""

    def __init__(self, forward: Callable[[Dispatched], torch.Tensor]) -> None:
        self.forward = forward
        self.graphs: dict[tuple[int, ActQuant | None], _Captured] = {}
        self.pool = None

    def __call__(self, x: Dispatched) -> torch.Tensor:
        """x (num_tokens <= MAX_GRAPH_TOKENS, on CUDA) -> [M, H], valid until the next call.
        One graph per M and per how x comes quantised (16-bit, or already by the dispatch)."""
        key = (x.num_tokens, x.act_quant)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(x)
        _refill(captured.inputs, x)
        captured.graph.replay()
        return captured.output

    def _capture(self, x: Dispatched) -> _Captured:
        static = _static_copy(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            self.forward(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with capturing(graph, self.pool):
            output = self.forward(static)
        return _Captured(graph, static, output)
