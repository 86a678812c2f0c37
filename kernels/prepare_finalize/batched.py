"""Batched format: group token copies by expert into [E, max_tokens, K] and back.

max_tokens is the largest per-expert count of this call, so the buffer holds no more than the
busiest expert needs (one host sync to read it).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kernels.prepare_finalize.no_ep import dispatch_locally
from kernels.quant_scheme import ActQuant
from kernels.stages import DispatchSpec, PrepareFinalize
from kernels.tensors import Dispatched, Format, Routing
from kernels.workspace import Workspace


def _scatter_rows(
    dst: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    # index_put has no fp8 kernel on every device; move the bytes instead
    if dst.element_size() == 1:
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst[experts, slots] = rows


class Batched(PrepareFinalize):
    name: ClassVar[str] = "batched"
    format: ClassVar[Format] = Format.BATCHED

    def prepare(
        self, hidden: torch.Tensor, routing: Routing, spec: DispatchSpec, ws: Workspace
    ) -> Dispatched:
        x = dispatch_locally(hidden, routing, spec)
        k = x.topk_ids.shape[1]
        num_experts = spec.num_local_experts
        flat = x.topk_ids.flatten().long()  # [M * k]
        pairs = torch.nonzero(flat >= 0).squeeze(1)
        experts, order = torch.sort(flat[pairs], stable=True)
        pairs = pairs[order]  # (token * k + slot), grouped by expert
        counts = torch.bincount(experts, minlength=num_experts)
        max_tokens = max(int(counts.max()) if pairs.numel() else 0, 1)
        slots = (
            torch.arange(pairs.numel(), device=pairs.device) - (counts.cumsum(0) - counts)[experts]
        )
        tokens = pairs // k

        batched = ws.get(
            "batched_hidden", (num_experts, max_tokens, x.hidden.shape[1]), x.hidden.dtype
        )
        _scatter_rows(batched, experts, slots, x.hidden[tokens])
        scale = x.scale
        if scale is not None and spec.act_quant != ActQuant.TENSOR:  # per-row scales travel too
            rows = scale[tokens]
            scale = torch.zeros(num_experts, max_tokens, rows.shape[1], device=rows.device)
            scale[experts, slots] = rows
        source = ws.get("batched_source", (num_experts, max_tokens), torch.int64).fill_(-1)
        source[experts, slots] = pairs
        return Dispatched(
            batched,
            scale,
            x.act_quant,
            x.topk_ids,
            x.topk_weights,
            tokens_per_expert=counts.to(torch.int32),
            source=source,
        )

    def finalize(
        self, expert_out: torch.Tensor, x: Dispatched, out: torch.Tensor, reduce: bool
    ) -> None:
        assert reduce, "batched experts leave weight-and-reduce to finalize"
        valid = x.source >= 0
        pairs = x.source[valid]  # [P]
        weights = x.topk_weights.flatten()[pairs].float()
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        acc.index_add_(
            0, pairs // x.topk_ids.shape[1], expert_out[valid].float() * weights[:, None]
        )
        out.copy_(acc)
