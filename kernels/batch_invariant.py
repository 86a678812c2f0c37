"""Batch invariance: each row's output bit for bit the same whatever it is batched with and
however the batch is chunked (`moe-serve serve --batch-invariant`).

Why a row's output changes with its batch: a GEMM library picks its kernel (tiles, split-K,
stream-K) by the number of rows, and each kernel sums a row's K products in its own order; on
the CPU, torch's elementwise loops run vectorised or scalar code (their exp differs by an ulp)
by where an element falls in the flat tensor. The invariant mode fixes every order:

- experts: `triton` runs one tile configuration at every M and never splits K; the reference
  runs each (token, expert) pair alone (every op on [1, K] shapes); the k slots of a token are
  summed in slot order (`fixed_order_topk_sum`).
- router and shared expert: on CUDA one Triton GEMM with one fixed tile (`triton_matmul`); on
  the CPU one row at a time (`row_by_row`).
- what stays as it is: CUDA elementwise kernels compute every element alike; per-row activation
  scales (fp8-token, fp8-block's 1 x 128 groups) are maxima, exact in any order. A per-tensor
  scale (fp8-tensor) depends on every row of the batch: `Experts.batch_invariance` refuses it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .quant_scheme import QuantConfig

_BLOCK_M = 64  # the router and shared-expert GEMM's one tile on CUDA (triton_matmul)


Rows = torch.Tensor | tuple[torch.Tensor, ...]


def row_by_row(fn: Callable[..., Rows], *xs: torch.Tensor) -> Rows:
    """`fn` on each row alone: xs [M, ...] -> fn's outputs [M, ...] (a tensor or a tuple).

    Every call sees copies of shape [1, ...] (same shape, freshly aligned), so each row goes
    through the same kernels, vectorised at the same columns, whatever its batch."""
    m = xs[0].shape[0]
    if m == 0:
        return fn(*xs)
    outs = [fn(*(x[i : i + 1].clone() for x in xs)) for i in range(m)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return torch.cat(outs)


def triton_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w [N, K].T -> float32 [M, N] by our grouped GEMM (one expert) with one fixed
    tile at every M, no split-K: each output element sums its K products in the same order
    whichever rows share its tile."""
    from .experts._triton.grouped_gemm import (  # imports triton: only when called
        Activations,
        BatchedRows,
        Epilogue,
        ExpertMatrix,
        GemmTile,
        grouped_gemm,
    )

    if a.dtype != w.dtype:
        a, w = a.float(), w.float()
    a = a.contiguous()
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    count = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)  # capturable
    rows = BatchedRows(count, a.shape[0], _BLOCK_M)
    matrix = ExpertMatrix(w[None], None, None, QuantConfig())
    grouped_gemm(Activations(a), matrix, out, rows, Epilogue(), GemmTile(64, 64, 4, 3))
    return out


def fixed_order_topk_sum(
    expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """`stages.weighted_topk_sum` with its sum in slot order, one elementwise op at a time
    (a batched GEMM, as einsum runs it, may pick its kernel by M): [M, k, K] -> float32 [M, K].
    """
    acc = torch.zeros(expert_out.shape[0], expert_out.shape[2], device=expert_out.device)
    for slot in range(topk_ids.shape[1]):
        here = topk_ids[:, slot] >= 0
        weight = torch.where(here, topk_weights[:, slot].float(), 0.0)[:, None]
        rows = torch.where(here[:, None], expert_out[:, slot].float(), 0.0)
        acc = acc + rows * weight
    return acc
