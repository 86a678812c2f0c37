"""Passes over a served batch's rows in Triton, each touching only what it must:

- `nonfinite_into`: whether any value is NaN or Inf, the flag every served batch computes on its
  inputs and on its output (API: `kernels.input_checks.all_finite_on_device`). Each value is
  read once as bits: a value is NaN or Inf exactly when all its format's mask bits are set
  (kernels/nonfinite.py). `torch.isfinite(x).all()` runs four elementwise kernels and a
  reduction over the whole tensor, several times this pass's time in a profile of the layer.
- `zero_rows_from`: a CUDA graph's padding rows (from its valid_rows on) set to zero, the
  others not read or written (a broadcast masked_fill_ reads and writes all of them); as a
  replay's first kernel it also resets the stats `batch_stats_into` then fills, so that no copy
  of their start values sits between the experts' last kernel and that pass.
- `batch_stats_into`: what a CUDA graph reports of its batch, in one pass: tokens per expert over
  the valid rows, whether the valid output rows and every input row are finite. Torch takes
  about 17 small kernels for it (a mask, a scatter, two flags, their stack), a visible share of
  a one-token forward. Programs split each row's columns, so a one-row batch is not one
  program's serial loop.
- `router_logits_into`: a batch of a token or two, its router logits as one GEMV pass over the
  router's rows, float32 sums of the 16-bit products plus the bias. cuBLAS runs a split-K GEMM
  and its reduce for it, two launches before the routing kernel can start (a one-token replay's
  critical path). Each row is summed in one order whatever the batch, but a larger batch goes
  to cuBLAS: not for batch-invariant layers.
- `silu_and_mul`: the shared experts' activation, float32 GEMM output [M, 2I] -> silu(gate) * up
  rounded once to the layer's dtype for their second GEMM: torch's `silu`, `*` and `.to` bit for
  bit on a GPU (kernels/triton_math.py), one pass over the intermediate instead of three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dependent_launch import begin, dependent_launch
from .triton_math import exp, libdevice_here

_MAX_BLOCK = 1024  # columns one step of a program reads


@triton.jit
def _nonfinite_kernel(
    bits_ptr, flag_ptr, valid_ptr, cols, stride,
    MASK: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    here = True
    if HAS_VALID:  # rows from valid_rows on are a CUDA graph's padding
        here = row < tl.load(valid_ptr)
    if here:
        bad = tl.zeros((BLOCK,), dtype=tl.int32)
        for c in range(0, cols, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            bits = tl.load(bits_ptr + row.to(tl.int64) * stride + offs, mask=offs < cols, other=0)
            bad = tl.maximum(bad, ((bits & MASK) == MASK).to(tl.int32))
        if tl.max(bad, axis=0) > 0:
            tl.store(flag_ptr, 1)


def nonfinite_into(
    bits: torch.Tensor, mask: int, flag: torch.Tensor, valid_rows: torch.Tensor | None
) -> None:
    """Sets flag (int32 [1], zeroed by the caller) to 1 where rows [0, valid_rows) of `bits`
    (a float tensor's [R, C] integer view, unit column stride; all rows if valid_rows is None,
    else a 0-d int64 tensor on the device) hold a value with every `mask` bit set."""
    if bits.numel():
        cols = bits.shape[1]
        _nonfinite_kernel[(bits.shape[0],)](
            bits, flag, valid_rows, cols, bits.stride(0),
            MASK=mask, HAS_VALID=valid_rows is not None,
            BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(cols)),
        )  # fmt: skip


@triton.jit
def _has_nonfinite(bits_ptr, row, offs, cols, stride, MASK: tl.constexpr):
    """Whether row `row`'s columns `offs` (those below cols) hold a NaN or Inf."""
    bits = tl.load(bits_ptr + row * stride + offs, mask=offs < cols, other=0)
    return tl.max(((bits & MASK) == MASK).to(tl.int32), axis=0) > 0


@triton.jit
def _batch_stats_kernel(
    stats_ptr, ids_ptr, valid_ptr, num_experts,
    out_ptr, out_cols, out_stride, a_ptr, a_cols, a_stride, b_ptr, b_cols, b_stride,
    TOP_K: tl.constexpr, OUT_MASK: tl.constexpr, A_MASK: tl.constexpr, B_MASK: tl.constexpr,
    HAS_B: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (r, c): row r's columns [c * BLOCK, (c + 1) * BLOCK) of the output checked (rows
    before valid_rows) and of the inputs (every row); the first column block also counts row
    r's pairs. A flag is cleared by storing 0: any program may."""
    begin(PDL)  # launched beside the experts' last kernel (kernels/dependent_launch.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if row < tl.load(valid_ptr):
        if tl.program_id(1) == 0:
            for slot in tl.static_range(TOP_K):
                expert = tl.load(ids_ptr + row * TOP_K + slot).to(tl.int64)
                if (expert >= 0) & (expert < num_experts):
                    tl.atomic_add(stats_ptr + expert, 1, sem="relaxed")
        if _has_nonfinite(out_ptr, row, offs, out_cols, out_stride, OUT_MASK):
            tl.store(stats_ptr + num_experts, 0)
    bad = _has_nonfinite(a_ptr, row, offs, a_cols, a_stride, A_MASK)
    if HAS_B:
        bad = bad | _has_nonfinite(b_ptr, row, offs, b_cols, b_stride, B_MASK)
    if bad:
        tl.store(stats_ptr + num_experts + 1, 0)


def batch_stats_into(
    stats: torch.Tensor,
    topk_ids: torch.Tensor,
    valid_rows: torch.Tensor,
    output: tuple[torch.Tensor, int],
    inputs: list[tuple[torch.Tensor, int]],
) -> None:
    """stats int64 [E + 2], holding zeros then two ones (as `zero_rows_from` resets it), gets:
    [e] += the pairs of rows [0, valid_rows) routed to expert e (ids of -1 count nowhere); [E] = 0
    if a value of those rows of `output` is NaN or Inf; [E + 1] = 0 if one of any row of `inputs`
    is. `output` and `inputs` (one or two) are (bits [R, C] with unit column stride, mask) as
    `nonfinite_into` takes them, all with topk_ids' R rows; valid_rows a 0-d int64 tensor on the
    device."""
    rows, top_k = topk_ids.shape
    if rows == 0:
        return
    (out, out_mask), (a, a_mask) = output, inputs[0]
    b, b_mask = inputs[1] if len(inputs) > 1 else (a, a_mask)
    widest = max(t.shape[1] for t in (out, a, b))
    block = min(_MAX_BLOCK, triton.next_power_of_2(widest))
    pdl = dependent_launch(stats.device)
    _batch_stats_kernel[(rows, triton.cdiv(widest, block))](
        stats, topk_ids.contiguous(), valid_rows, stats.shape[0] - 2,
        out, out.shape[1], out.stride(0), a, a.shape[1], a.stride(0), b, b.shape[1], b.stride(0),
        TOP_K=top_k, OUT_MASK=out_mask, A_MASK=a_mask, B_MASK=b_mask, HAS_B=len(inputs) > 1,
        BLOCK=block, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip


@triton.jit
def _zero_rows_kernel(
    x_ptr, valid_ptr, rows, cols, stride, stats_ptr, num_experts,
    RESET_STATS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    row = tl.program_id(0)
    if (row < rows) & (row >= tl.load(valid_ptr)):
        for c in range(0, cols, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            tl.store(x_ptr + row.to(tl.int64) * stride + offs, 0, mask=offs < cols)
    if RESET_STATS:  # program 0: no tokens per expert yet, both flags up
        end = tl.where(row == 0, num_experts + 2, 0)
        for e in range(0, num_experts + 2, BLOCK):
            offs = e + tl.arange(0, BLOCK)
            tl.store(stats_ptr + offs, (offs >= num_experts).to(tl.int64), mask=offs < end)


def zero_rows_from(
    x: torch.Tensor, valid_rows: torch.Tensor, stats: torch.Tensor | None = None
) -> torch.Tensor:
    """x [R, C] (unit column stride) with rows from valid_rows (a 0-d int64 tensor on
    the device) on set to zero, in place; returns x. `stats` (int64 [E + 2]), where given, is
    reset in the same launch to what `batch_stats_into` starts from: E zeros, then two ones."""
    rows, cols = x.shape
    if not x.numel() and stats is None:
        return x
    pdl = dependent_launch(x.device)
    _zero_rows_kernel[(max(rows, 1),)](
        x, valid_rows, rows, cols, x.stride(0), stats, 0 if stats is None else stats.shape[0] - 2,
        RESET_STATS=stats is not None, BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(max(cols, 1))),
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return x


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, experts, hidden, stride_x, stride_w, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    row = tl.program_id(1).to(tl.int64)
    rows_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)  # summed across once, after the loop
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < hidden, other=0.0)
        mask = (rows_e[:, None] < experts) & (offs[None, :] < hidden)
        w = tl.load(w_ptr + rows_e[:, None] * stride_w + offs[None, :], mask=mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + rows_e, mask=rows_e < experts, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + rows_e, logits, mask=rows_e < experts)


# Router rows per program: enough programs to spread a big router's bytes over the SMs
# (DeepSeek-V3: 256 x 7168 bf16, 3.7 MB), and short steps along H for a small one.
_ROUTER_PROGRAMS = 128


def router_logits_into(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 out [M, E] = x [M, H] @ weight [E, H].T (+ bias [E]), each dot summed in float32;
    x and weight with unit column stride. Returns out."""
    m, hidden = x.shape
    experts = weight.shape[0]
    if out.numel():
        block_e = triton.next_power_of_2(triton.cdiv(experts, _ROUTER_PROGRAMS))
        block_h = min(_MAX_BLOCK, triton.next_power_of_2(hidden))
        pdl = dependent_launch(x.device)
        _router_kernel[(triton.cdiv(experts, block_e), m)](
            x, weight, bias, out, experts, hidden, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_E=block_e, BLOCK_H=block_h, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(
    h_ptr, out_ptr, inter, stride_h, stride_out, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + row * stride_h + inter + cols, mask=mask, other=0.0)
    silu = tl.math.div_rn(gate, 1.0 + exp(-gate, LIBDEVICE))
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 h [M, 2I] (gate columns, then up; unit column stride) -> silu(gate) * up [M, I]
    in `dtype`, computed in float32 and rounded once."""
    m, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(m, inter, dtype=dtype, device=h.device)
    if out.numel():
        block = min(_MAX_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(m, triton.cdiv(inter, block))](
            h, out, inter, h.stride(0), out.stride(0),
            LIBDEVICE=libdevice_here(h.is_cuda), BLOCK=block,
        )  # fmt: skip
    return out
