"""Batched format: group token copies by expert into [E, capacity, K] and back.

The capacity (rows per expert) is decided on the host from M alone up to SYNC_FREE_TOKENS
tokens: a token's k experts are distinct (top-k; replicas of distinct experts are distinct
local slots), so no expert gets more than M pairs. Counts, slots and the scatter stay on the
device: no host sync, and a forward can be captured in a CUDA graph. Above SYNC_FREE_TOKENS the
worst case would be E * M rows (DeepSeek-V3 at 4096 tokens: 7.5 GB of fp8 input alone), so
the capacity is the busiest expert's count, read on the host (one sync; prefill, uncaptured).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..quant_scheme import ActQuant
from ..stages import DispatchSpec, PrepareFinalize, weighted_topk_sum
from ..tensors import Dispatched, Format, Routing
from ..workspace import Workspace
from .no_ep import dispatch_locally

# The largest forward whose capacity is its token count. 256 covers the decode buckets (up to
# 64 tokens) and the next few graph buckets (kernels.layer_graphs.token_buckets); at 256 a
# DeepSeek-V3 layer (E=256, H=7168) holds 0.47 GB of fp8 batched input and deep-gemm-batched
# 1.4 GB more (its input and bf16 output buffers), against about 0.8 GB at 64 tokens, where
# DeepGEMM's 128-row alignment already sets the size.
SYNC_FREE_TOKENS = 256


def capacity(num_tokens: int, counts: torch.Tensor) -> int:
    """Rows per expert for a forward of `num_tokens` tokens whose per-expert `counts` [E] are
    on the device: num_tokens up to SYNC_FREE_TOKENS (no sync), else the largest count."""
    if num_tokens <= SYNC_FREE_TOKENS:
        return max(num_tokens, 1)
    return max(int(counts.max()), 1)  # host sync: the worst case would not fit


def _scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    # index_put has no fp8 kernel on every device; move the bytes instead
    if dst.element_size() == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst[rows] = src


class Batched(PrepareFinalize):
    name: ClassVar[str] = "batched"
    format: ClassVar[Format] = Format.BATCHED
    graph_capturable: ClassVar[bool] = True
    max_capture_tokens: ClassVar[int | None] = SYNC_FREE_TOKENS

    def prepare(
        self, hidden: torch.Tensor, routing: Routing, spec: DispatchSpec, ws: Workspace
    ) -> Dispatched:
        x = dispatch_locally(hidden, routing, spec)
        m, k = x.topk_ids.shape
        num_experts = spec.num_local_experts
        ids = x.topk_ids.flatten().long()  # [M * k]: pair token * k + slot
        local = ids >= 0
        key = torch.where(local, ids, num_experts)  # another rank's pairs sort last
        sorted_key, order = torch.sort(key, stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, key, torch.ones_like(key))  # bincount reads its size on the host
        starts = counts.cumsum(0) - counts
        slots = torch.empty_like(ids)  # each pair's row within its expert, in token order
        slots[order] = torch.arange(ids.numel(), device=ids.device) - starts[sorted_key]
        counts = counts[:num_experts]
        cap = capacity(m, counts)
        # one spare row past E * cap takes the other ranks' pairs, so nothing is filtered
        rows = torch.where(local, ids * cap + slots, num_experts * cap)
        tokens = torch.arange(ids.numel(), device=ids.device) // k

        h = x.hidden.shape[1]
        flat = ws.get("batched_hidden", (num_experts * cap + 1, h), x.hidden.dtype)
        _scatter_rows(flat, rows, x.hidden[tokens])
        scale = x.scale
        if scale is not None and spec.act_quant != ActQuant.TENSOR:  # per-row scales travel too
            flat_scale = torch.zeros(num_experts * cap + 1, scale.shape[1], device=scale.device)
            flat_scale[rows] = scale[tokens]
            scale = flat_scale[:-1].view(num_experts, cap, -1)
        return Dispatched(
            flat[:-1].view(num_experts, cap, h),
            scale,
            x.act_quant,
            x.topk_ids,
            x.topk_weights,
            tokens_per_expert=counts.to(torch.int32),
            slots=torch.where(local, slots, -1).view(m, k),
        )

    def combine(self, expert_out: torch.Tensor, x: Dispatched, reduce: bool) -> torch.Tensor:
        assert reduce, "batched experts leave weight-and-reduce to finalize"
        # each pair's row gathered back ([M, k, K]); another rank's pairs (-1) add nothing
        rows = expert_out[x.topk_ids.long().clamp_min(0), x.slots.clamp_min(0)]
        return weighted_topk_sum(rows, x.topk_ids, x.topk_weights)
