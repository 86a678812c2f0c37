"""Single process, standard format: quantise in place, no data movement, weighted combine."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..quant_scheme import ActQuant
from ..quantize import quantize_activation
from ..routing import to_local_ids
from ..stages import (
    HAS_TRITON,
    DispatchSpec,
    PrepareFinalize,
    weighted_topk_sum,
)
from ..tensors import Dispatched, Format, Routing
from ..workspace import Workspace

if HAS_TRITON:
    from ..experts._triton.quantize import quantize_rows


def quantize_input(hidden: torch.Tensor, how: ActQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation`, on a GPU in one Triton pass instead of torch's ten or so
    elementwise kernels (bit for bit the same: tests/kernels/test_triton_gpu.py)."""
    if HAS_TRITON:
        return quantize_rows(hidden, how)  # the torch twin on the CPU
    return quantize_activation(hidden, how)


def dispatch_locally(hidden: torch.Tensor, routing: Routing, spec: DispatchSpec) -> Dispatched:
    """hidden [M, K] -> standard-format Dispatched: local ids, optional input weighting, fp8."""
    ids = to_local_ids(routing.topk_ids, spec.expert_map)
    weights = routing.topk_weights
    if spec.apply_router_weight_on_input:  # top_k == 1: scale x, then weigh the output by 1
        hidden = (hidden.float() * weights).to(hidden.dtype)
        weights = torch.ones_like(weights)
    scale = None
    if spec.act_quant is not None:
        hidden, scale = quantize_input(hidden, spec.act_quant)
    return Dispatched(hidden, scale, spec.act_quant, ids, weights)


class NoEP(PrepareFinalize):
    name: ClassVar[str] = "no-ep"
    format: ClassVar[Format] = Format.STANDARD
    graph_capturable: ClassVar[bool] = True

    def prepare(
        self,
        hidden: torch.Tensor,
        routing: Routing,
        spec: DispatchSpec,
        ws: Workspace,  # noqa: ARG002
    ) -> Dispatched:
        return dispatch_locally(hidden, routing, spec)

    def combine(self, expert_out: torch.Tensor, x: Dispatched, reduce: bool) -> torch.Tensor:
        return weighted_topk_sum(expert_out, x.topk_ids, x.topk_weights) if reduce else expert_out
