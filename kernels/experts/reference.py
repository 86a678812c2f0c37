"""Exact experts in plain torch, float32 throughout: the oracle every fast backend is tested
against, and the backend the service runs on a machine without a GPU.

Legend: P = routed (token, expert) pairs, K = hidden size, I = intermediate size.
For each pair p going to expert e:
    h[p] = act(a[p] @ W13[e].T + b13[e])          # [2I] -> [I]
    h[p] = dequant(quant(h)) when the scheme quantises activations (over all pairs at once)
    y[p] = h[p] @ W2[e].T + b2[e]                  # [K]
Weights are dequantised one expert at a time, so a large layer never exists in float32.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ..activations import apply_activation
from ..batch_invariant import row_by_row
from ..quant_scheme import ActQuant, QuantConfig, QuantScheme
from ..quantize import dequantize_activation, dequantize_weight, quantize_activation
from ..stages import Experts
from ..tensors import Dispatched, Format
from ..workspace import Workspace

# Every scheme kernels/quantize.py encodes; a new scheme joins once the oracle tests cover it.
_SCHEMES = frozenset({
    QuantScheme.NONE, QuantScheme.FP8_TENSOR, QuantScheme.FP8_TOKEN, QuantScheme.FP8_BLOCK,
    QuantScheme.INT8_W8A16, QuantScheme.INT4_W4A16, QuantScheme.MXFP4,
})  # fmt: skip


def _expert_weight(
    w: torch.Tensor, scale: torch.Tensor | None, e: int, quant: QuantConfig, parts: int
) -> torch.Tensor:
    """Expert e's weight [N, K] in float32 (`parts`: as `quantize.dequantize_weight`)."""
    one = slice(e, e + 1)
    return dequantize_weight(w[one], None if scale is None else scale[one], quant, parts)[0]


def _expert_linear(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    experts: torch.Tensor,
    quant: QuantConfig,
    parts: int = 1,
) -> torch.Tensor:
    """a [P, K_in] @ W[experts[p]].T (+ bias) per pair -> float32 [P, N]; expert -1 rows stay 0."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
    for e in torch.unique(experts[experts >= 0]).tolist():
        rows = experts == e
        out[rows] = a[rows] @ _expert_weight(w, scale, e, quant, parts).T
        if bias is not None:
            out[rows] += bias[e].float()
    return out


def _pairs_one_by_one(experts_obj: Experts, a: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """`run_pairs` for batch invariance: each pair alone through GEMM1 -> act -> quant -> GEMM2
    (every op on [1, ...] shapes, so on the same kernels whatever the batch), an expert's weights
    dequantised once."""
    cfg, w = experts_obj.cfg, experts_obj.weights
    act_quant = experts_obj.act_quant()
    out = torch.zeros(a.shape[0], w.w2.shape[1], dtype=torch.float32, device=a.device)

    def pair_mlp(row: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int) -> torch.Tensor:
        h = row @ w13.T  # [1, 2I]
        if w.w13_bias is not None:
            h = h + w.w13_bias[e].float()
        h = apply_activation(h, cfg.activation)
        if act_quant is not None:
            h = dequantize_activation(*quantize_activation(h, act_quant), act_quant)
        y = h @ w2.T  # [1, K]
        return y if w.w2_bias is None else y + w.w2_bias[e].float()

    for e in torch.unique(experts[experts >= 0]).tolist():
        w13 = _expert_weight(w.w13, w.w13_scale, e, cfg.quant, cfg.w13_parts)
        w2 = _expert_weight(w.w2, w.w2_scale, e, cfg.quant, 1)
        rows = experts == e
        out[rows] = row_by_row(functools.partial(pair_mlp, w13=w13, w2=w2, e=e), a[rows])
    return out


def run_pairs(experts_obj: Experts, a: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """a [P, K] float32 activations, experts [P] local ids (-1 = skip) -> float32 [P, K]."""
    if experts_obj.batch_invariant:
        return _pairs_one_by_one(experts_obj, a, experts)
    cfg, w = experts_obj.cfg, experts_obj.weights
    h = _expert_linear(a, w.w13, w.w13_scale, w.w13_bias, experts, cfg.quant, cfg.w13_parts)
    h = apply_activation(h, cfg.activation)  # [P, I]
    act_quant = experts_obj.act_quant()
    valid = experts >= 0
    if act_quant is not None and valid.any():
        q, scale = quantize_activation(h[valid], act_quant)
        h[valid] = dequantize_activation(q, scale, act_quant)
    return _expert_linear(h, w.w2, w.w2_scale, w.w2_bias, experts, cfg.quant)


def dequantize_input(x: Dispatched, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The dispatched activations in float32: all [M, K], or the `rows` mask's rows [P, K]."""
    hidden = x.hidden if rows is None else x.hidden[rows]
    if x.act_quant is None:
        return hidden.float()
    scale = x.scale
    if rows is not None and x.act_quant != ActQuant.TENSOR:
        scale = scale[rows]
    return dequantize_activation(hidden, scale, x.act_quant)


class ReferenceExperts(Experts):
    name: ClassVar[str] = "reference"
    format: ClassVar[Format] = Format.STANDARD
    schemes: ClassVar[frozenset[QuantScheme]] = _SCHEMES
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    has_invariant_mode: ClassVar[bool] = True

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:  # noqa: ARG002
        m, k = x.topk_ids.shape
        a = dequantize_input(x).repeat_interleave(k, dim=0)  # [M * k, K], pair = token * k + slot
        y = run_pairs(self, a, x.topk_ids.flatten().long())
        return y.view(m, k, -1)


class BatchedReferenceExperts(Experts):
    name: ClassVar[str] = "reference-batched"
    format: ClassVar[Format] = Format.BATCHED
    schemes: ClassVar[frozenset[QuantScheme]] = _SCHEMES
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:  # noqa: ARG002
        num_experts, max_tokens, _ = x.hidden.shape
        slots = torch.arange(max_tokens, device=x.hidden.device)
        valid = slots[None, :] < x.tokens_per_expert[:, None]  # [E, max_tokens]
        experts = torch.arange(num_experts, device=valid.device)[:, None].expand_as(valid)[valid]
        y = run_pairs(self, dequantize_input(x, valid), experts)
        out = torch.zeros(num_experts, max_tokens, y.shape[1], device=y.device)
        out[valid] = y
        return out
