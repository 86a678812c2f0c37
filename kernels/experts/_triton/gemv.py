"""Decode GEMMs as one matrix-vector product per (token, expert) pair, on the CUDA cores.

When each expert sees about one row (one token: DeepSeek-V3's 8 of 256 experts, gpt-oss' 4 of
128), the grouped GEMM pads every expert's row to a BLOCK_M tile for the tensor cores and needs
the pairs sorted by expert first. Here GEMM1's programs take one pair and BLOCK_N output columns:

    C[p, n] = epilogue(sum over k of A[p // a_div, k] * dequant(W[e_p])[n, k])

multiplying in float32 as it loads: no align step and no padding rows. GEMM2's programs take
one token and BLOCK_N columns, and sum its top_k pairs' rows as they compute them (`SlotSum`):

    out[t, n] = extra[t, n] + sum over slots s of w_p * epilogue(sum over k of ...), p = t * k + s

A K step reads the weight tiles of all the token's slots (unrolled: independent loads, in
flight together), so a program has up to top_k times the weight bytes in flight: GEMM2's K (the
intermediate size) is short, and a program a pair would spend its few K steps waiting on one
tile each. The pairs' rows never
reach memory, and the top-k sum is no launch of its own. Each slot's partial sums are taken
times its router weight and the scales constant along K (what its epilogue would multiply
their sum by) as they are added, so one accumulator serves every slot; the bias and `extra`
join after the loop, and the sum is rounded once, as topk_sum does. A slot whose expert is not
here (-1) masks all its loads (its row of A holds anything); a pair of one in GEMM1 writes
nothing.

Weights stored one value an element (16-bit, fp8, int8; `_row_terms`) are read as [BLOCK_N,
BLOCK_K] tiles along K, a thread on 16 contiguous bytes of a row, and each thread sums its own
products, so a K step never waits on a reduction across threads (one after the loop); long K
steps (256 fp8 bytes a row) keep more weight bytes in flight: Triton pipelines no loads here
(no dot), so that is what feeds the memory. int4 keeps the first loop (`_step`: [BLOCK_K,
BLOCK_N] tiles summed each step). The epilogue is the grouped GEMM's (grouped_gemm._epilogue).

fp8-block: a column tile lies within one 128-row scale block (`pair_gemv` narrows BLOCK_N to
fit); the activation and weight scales of each K column fold into the activations.

mxfp4 (`_mxfp4_terms`) has a K step of its own, because the generic one is bound by
instructions there, far below the copy bandwidth: the bytes are read as [BLOCK_N, BLOCK_K / 2]
with a thread on whole 16-byte scale groups, each nibble becomes float32 bits in two or three
integer steps (no reordering of the nibbles), it meets the activation of its parity, read as
one 32-bit word a byte, and each group is summed and scaled in its thread, summed over groups
once after the loop. The tiles are wide along K (1024 columns: 3 steps for gpt-oss' K = 2880).

Per pair beats the grouped GEMM at a token or two on most shapes and loses from a few tokens on
(gpt-oss' mxfp4 keeps it longest): the tile tables' `per_pair` buckets (`moe-serve bench tune`) and
the heuristic's PER_PAIR_ROWS_PER_EXPERT (tiles.py) say where it runs, as `moe-serve bench
kernels` measures the experts. Slower there, so not used: [BLOCK_K, BLOCK_N] accumulators summed
after the loop; 4-bit nibbles met by even and odd activations; fp8-block GEMVs quantising their
16/32-bit input rows per 128-column group as they read them (one launch fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...dependent_launch import begin
from .codes import (
    ACT_PER_TENSOR,
    ACT_PER_TOKEN,
    NO_ACTIVATION,
    W_DENSE,
    W_FP8_BLOCK,
    W_FP8_TENSOR,
    W_INT4_GROUP,
    W_MXFP4,
    W_PER_CHANNEL,
    WeightKind,
)
from .grouped_gemm import (
    Activations,
    Epilogue,
    ExpertMatrix,
    GemmTile,
    _epilogue,
    _group_scale,
    _load_tile,
    _weight_tile,
    gemm_args,
    raise_amax,
)

MAX_PAIRS = 65535  # the grid's second axis, one program row per pair (or per token, summing)


@dataclass(frozen=True)
class EachPair:
    """Rows for `pair_gemv`: pair p (= token * top_k + slot) goes to local expert `experts[p]`."""

    experts: torch.Tensor  # [P] int32, -1: an expert of another rank


@dataclass(frozen=True)
class SlotSum:
    """`pair_gemv` writes one row a token: out[t] = extra[t] + the sum of the rows of its `top_k`
    pairs (t * top_k + slot) whose expert is here, in float32, rounded once to out's dtype."""

    top_k: int
    extra: torch.Tensor | None = None  # [M, N] float32 (the shared experts' output)


@triton.jit
def _pair_gemv_kernel(
    a_ptr, a_s_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, experts_ptr, row_weights_ptr, amax_ptr,
    extra_ptr, n_out, k, a_div, up_offset, up_block_offset,
    stride_am, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_cm, stride_extra, alpha, limit,
    KIND: tl.constexpr, ACT_SCALE: tl.constexpr, GROUP: tl.constexpr, ACTIVATION: tl.constexpr,
    GATE_STEP: tl.constexpr,  # weight row of gate n: n * GATE_STEP; of up n: that + up_offset
    HAS_BIAS: tl.constexpr, HAS_ROW_WEIGHTS: tl.constexpr, HAS_AMAX: tl.constexpr,
    HAS_EXTRA: tl.constexpr, A_FP8: tl.constexpr, W_FP8: tl.constexpr, FP8_BYTES: tl.constexpr,
    MASK_K: tl.constexpr,
    TOP_K: tl.constexpr,  # 0: a program a pair; else a program a token, summing its TOP_K pairs
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)  # the pair, or the token whose pairs are summed
    begin(PDL)
    # a pair of another rank's expert writes nothing; a token's row is always written
    pair_expert = tl.load(experts_ptr + row) if TOP_K == 0 else 0
    if pair_expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # loads wrap past the last column (the store is masked), so only a K tail needs masks
    gate_rows = (offs_n % n_out) * GATE_STEP
    up_rows = gate_rows + up_offset
    # fp8-block: the scale row-block of the whole tile (interleaved: gate and up rows share it)
    gate_block = pid_n * BLOCK_N * GATE_STEP // GROUP
    up_block = gate_block if GATE_STEP == 2 else up_block_offset + gate_block
    GATED: tl.constexpr = ACTIVATION != NO_ACTIVATION
    CHUNK: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)

    # each thread's partial sums, [BLOCK_N, parts] (int4: [BLOCK_N]; _terms)
    if KIND == W_MXFP4:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    elif KIND == W_INT4_GROUP:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // CHUNK), dtype=tl.float32)
    acc_up = acc
    for k0 in range(0, k, BLOCK_K):
        # summing: the slots' loads of one K step are in flight together
        for slot in tl.static_range(max(TOP_K, 1)):
            if TOP_K == 0:
                pair = row
                expert = pair_expert.to(tl.int64)
                k_here = k
            else:
                pair = row * TOP_K + slot
                expert = tl.load(experts_ptr + pair)
                k_here = tl.where(expert >= 0, k, 0)  # another rank's expert: every load masked
                expert = tl.maximum(expert, 0).to(tl.int64)
            a_row = pair // a_div
            w_e = w_ptr + expert * stride_we
            s_e = s_ptr
            if KIND != W_DENSE:
                s_e = s_ptr + expert * stride_se
            part, part_up = _terms(
                a_ptr + a_row * stride_am, a_s_ptr, a_row * stride_asm, w_e, s_e, gate_rows,
                up_rows, gate_block, up_block, k0, k_here, stride_wn, stride_wk, stride_sn,
                stride_sk, KIND, GROUP, GATED, A_FP8 and FP8_BYTES, W_FP8 and FP8_BYTES, CHUNK,
                BLOCK_K, MASK_K,
            )  # fmt: skip
            if TOP_K == 0:
                acc += part
                if GATED:
                    acc_up += part_up
            else:
                acc += _slot_scaled(
                    part, k_here > 0, row_weights_ptr + pair, a_s_ptr, a_row * stride_asm, s_e,
                    gate_rows, stride_sn, ACT_SCALE, KIND, HAS_ROW_WEIGHTS,
                )  # fmt: skip

    written = offs_n < n_out
    if TOP_K == 0:
        a_rows = tl.zeros((1,), dtype=tl.int64) + row // a_div
        expert = pair_expert.to(tl.int64)
        if KIND != W_DENSE:
            s_ptr += expert * stride_se
        out = _epilogue(
            _summed(acc, KIND)[None, :], _summed(acc_up, KIND)[None, :], a_s_ptr, a_rows,
            stride_asm, s_ptr, gate_rows, up_rows, stride_sn, bias_ptr, expert * stride_be,
            alpha, limit, ACT_SCALE, KIND, HAS_BIAS, ACTIVATION,
        )  # fmt: skip
        if HAS_ROW_WEIGHTS:
            out = out * tl.load(row_weights_ptr + row)
        if HAS_AMAX:
            raise_amax(amax_ptr, out, written[None, :])
        tl.store(c_ptr + row * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=written[None, :])  # fmt: skip
    else:
        out = _summed(acc, KIND)
        if HAS_BIAS:  # each pair's bias times its router weight
            for slot in tl.static_range(TOP_K):
                pair = row * TOP_K + slot
                expert = tl.load(experts_ptr + pair)
                weight = 1.0
                if HAS_ROW_WEIGHTS:
                    weight = tl.load(row_weights_ptr + pair)
                bias_row = tl.maximum(expert, 0).to(tl.int64) * stride_be
                out += tl.where(expert >= 0, weight, 0.0) * tl.load(bias_ptr + bias_row + gate_rows)
        if HAS_EXTRA:
            out += tl.load(extra_ptr + row * stride_extra + offs_n, mask=written, other=0)
        tl.store(c_ptr + row * stride_cm + offs_n, out.to(c_ptr.dtype.element_ty), mask=written)


@triton.jit
def _summed(acc, KIND: tl.constexpr):
    """The threads' partial sums after the loop -> [BLOCK_N] (int4's are summed already)."""
    return acc if KIND == W_INT4_GROUP else tl.sum(acc, axis=1)


@triton.jit
def _terms(
    a_ptr, a_s_ptr, a_s_row, w_ptr, s_ptr, gate_rows, up_rows, gate_block, up_block, k0, k,
    stride_wn, stride_wk, stride_sn, stride_sk, KIND: tl.constexpr, GROUP: tl.constexpr,
    GATED: tl.constexpr, A_BYTES: tl.constexpr, W_BYTES: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """One K step (from k0) of activation row `a_ptr` against this expert's gate rows (and up
    rows when GATED; else the second is the first again): each thread's partial sums, float32
    [BLOCK_N, parts], parts by weight kind: BLOCK_K / CHUNK (`_row_terms`), one a 32-column
    scale group (`_mxfp4_terms`); int4: [BLOCK_N] (`_step`, summed each step)."""
    if KIND == W_MXFP4:
        part, part_up = _mxfp4_terms(
            a_ptr, w_ptr, s_ptr, gate_rows, up_rows, k0, k, stride_wn, stride_wk, stride_sn,
            stride_sk, GATED, BLOCK_K, MASK_K,
        )  # fmt: skip
    elif KIND == W_INT4_GROUP:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _load_tile(a_ptr + offs_k, offs_k < k, MASK_K, False).to(tl.float32)
        part = _step(a, w_ptr, s_ptr, gate_rows, k0, k, stride_wn, stride_wk, stride_sn,
                     stride_sk, KIND, GROUP, BLOCK_K, MASK_K)  # fmt: skip
        part_up = part
        if GATED:
            part_up = _step(a, w_ptr, s_ptr, up_rows, k0, k, stride_wn, stride_wk, stride_sn,
                            stride_sk, KIND, GROUP, BLOCK_K, MASK_K)  # fmt: skip
    else:
        part, part_up = _row_terms(
            a_ptr, a_s_ptr, a_s_row, w_ptr, s_ptr, gate_rows, up_rows, gate_block, up_block, k0,
            k, stride_wn, stride_wk, stride_sn, stride_sk, KIND, GROUP, GATED, A_BYTES, W_BYTES,
            CHUNK, BLOCK_K, MASK_K,
        )  # fmt: skip
    return part, part_up


@triton.jit
def _slot_scaled(
    part, here, row_weight_ptr, a_s_ptr, a_s_row, s_ptr, rows, stride_sn,
    ACT_SCALE: tl.constexpr, KIND: tl.constexpr, HAS_ROW_WEIGHTS: tl.constexpr,
):  # fmt: skip
    """A summed slot's partial sums ([BLOCK_N, parts]; int4's [BLOCK_N], never per channel)
    times what its own epilogue would multiply their sum by: its router weight and the scales
    constant along K (those of grouped_gemm._after_k_scales, which GEMM2 has: no gated
    activation). 0 for a pair of another rank's expert (`here` False), whose activation row
    and scale hold anything."""
    scale = 1.0
    if HAS_ROW_WEIGHTS:
        scale = tl.load(row_weight_ptr)
    if ACT_SCALE == ACT_PER_TENSOR:
        scale = scale * tl.load(a_s_ptr)
    if ACT_SCALE == ACT_PER_TOKEN:
        scale = scale * tl.load(a_s_ptr + a_s_row)
    if KIND == W_FP8_TENSOR:
        scale = scale * tl.load(s_ptr)
    scale = tl.where(here, scale, 0.0)
    if KIND == W_PER_CHANNEL:
        scaled = part * (scale * tl.load(s_ptr + rows * stride_sn))[:, None]
    else:
        scaled = part * scale
    return scaled


@triton.jit
def _step(
    a, w_ptr, s_ptr, rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """int4: one K step, sum over k of a[k] * W[rows[n], k0 + k], [BLOCK_N] float32."""
    w = _weight_tile(w_ptr, s_ptr, rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk, KIND,
                     GROUP, False, False, tl.float32, BLOCK_K, MASK_K, False)  # fmt: skip
    return tl.sum(w * a[:, None], axis=0)


@triton.jit
def _row_terms(
    a_ptr, a_s_ptr, a_s_row, w_ptr, s_ptr, gate_rows, up_rows, gate_block, up_block, k0, k,
    stride_wn, stride_wk, stride_sn, stride_sk, KIND: tl.constexpr, GROUP: tl.constexpr,
    GATED: tl.constexpr, A_BYTES: tl.constexpr, W_BYTES: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """One K step of activation row `a_ptr` times this expert's gate rows (and up rows when
    GATED), weights stored one value an element (16-bit, fp8, int8): [BLOCK_N, BLOCK_K / CHUNK]
    float32 each. The weights are read as [BLOCK_N, BLOCK_K] tiles, a thread holding CHUNK
    values (16 bytes) of a row and summing its own products, so no K step waits on a reduction
    across threads (one after the loop). fp8-block folds each K column's activation scale (at
    `a_s_ptr + a_s_row`) and weight scale into the activations."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = _load_tile(a_ptr + offs_k, offs_k < k, MASK_K, A_BYTES).to(tl.float32)
    if KIND == W_FP8_BLOCK:  # each K column's group scale
        a = a * tl.load(a_s_ptr + a_s_row + offs_k // GROUP, mask=offs_k < k, other=0)
    part = _row_step(a, w_ptr, s_ptr, gate_rows, gate_block, offs_k, k, stride_wn, stride_wk,
                     stride_sn, stride_sk, KIND, GROUP, W_BYTES, CHUNK, MASK_K)  # fmt: skip
    part_up = part
    if GATED:
        part_up = _row_step(a, w_ptr, s_ptr, up_rows, up_block, offs_k, k, stride_wn, stride_wk,
                            stride_sn, stride_sk, KIND, GROUP, W_BYTES, CHUNK, MASK_K)  # fmt: skip
    return part, part_up


@triton.jit
def _row_step(
    a, w_ptr, s_ptr, rows, block, offs_k, k, stride_wn, stride_wk, stride_sn, stride_sk,
    KIND: tl.constexpr, GROUP: tl.constexpr, W_BYTES: tl.constexpr, CHUNK: tl.constexpr,
    MASK_K: tl.constexpr,
):  # fmt: skip
    """One K step of `_row_terms`: [BLOCK_N, BLOCK_K / CHUNK] sums of CHUNK products each.
    fp8-block folds each K column's weight scale (of row-block `block`) into `a` first."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    BLOCK_K: tl.constexpr = offs_k.shape[0]
    if KIND == W_FP8_BLOCK:
        a = a * tl.load(s_ptr + block * stride_sn + (offs_k // GROUP) * stride_sk,
                        mask=offs_k < k, other=0)  # fmt: skip
    w = _load_tile(w_ptr + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                   (offs_k < k)[None, :], MASK_K, W_BYTES)  # fmt: skip
    products = w.to(tl.float32) * a[None, :]
    return tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // CHUNK, CHUNK)), axis=2)


# e2m1 (sign, two exponent bits, one mantissa bit) -> float32 bits: the sign to bit 31, the three
# low bits to the exponent's two lowest bits and the mantissa's top (bits 24..22), which makes
# the value times 2**-126 (code 1, 0.5, a subnormal). An int32 mask (0x81C00000).
_E2M1_F32_BITS = tl.constexpr(0x81C00000 - (1 << 32))
# The activations are taken times 2**64, so that each product (value * 2**-126 * a) is a normal
# float for |a| >= 2**-61, and each group's sum times 2**(126 - 64) before its scale: exact for
# |a| < 2**64 (above it a product overflows to inf, which the served forward refuses).
_ACT_UP = tl.constexpr(2.0**64)
_SUM_BACK = tl.constexpr(2.0**62)


@triton.jit
def _mxfp4_terms(
    a_ptr, w_ptr, s_ptr, gate_rows, up_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
    GATED: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """One K step of 16-bit activation row `a_ptr` times this expert's mxfp4 gate rows (and up
    rows when GATED): [BLOCK_N, BLOCK_K / 32] float32 each, a scale group's sum of products
    times its scale. The weight bytes are read as [BLOCK_N, BLOCK_K / 2] tiles, each thread
    holding whole 16-byte scale groups of a row, so the group sums and their scales stay in the
    thread until one sum over the groups after the loop. The activations are read as 32-bit
    words, one a byte: the values its low and high nibble meet (float32 activations: two loads
    a byte)."""
    WORDS: tl.constexpr = a_ptr.dtype.element_ty.primitive_bitwidth == 16
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    if WORDS:
        word = _load_tile(a_ptr.to(tl.pointer_type(tl.int32)) + offs_b, offs_b < k // 2, MASK_K,
                          False)  # fmt: skip
        a_low = _half_word(word, a_ptr.dtype.element_ty) * _ACT_UP
        a_high = _half_word(word >> 16, a_ptr.dtype.element_ty) * _ACT_UP
    else:
        a_low = _load_tile(a_ptr + 2 * offs_b, offs_b < k // 2, MASK_K, False) * _ACT_UP
        a_high = _load_tile(a_ptr + 2 * offs_b + 1, offs_b < k // 2, MASK_K, False) * _ACT_UP
    part = _mxfp4_step(a_low, a_high, w_ptr, s_ptr, gate_rows, k0, k, stride_wn, stride_wk,
                       stride_sn, stride_sk, BLOCK_K, MASK_K)  # fmt: skip
    part_up = part
    if GATED:
        part_up = _mxfp4_step(a_low, a_high, w_ptr, s_ptr, up_rows, k0, k, stride_wn, stride_wk,
                              stride_sn, stride_sk, BLOCK_K, MASK_K)  # fmt: skip
    return part, part_up


@triton.jit
def _half_word(word, DTYPE: tl.constexpr):
    """The 16-bit value in the low half of each int32 `word`, as float32."""
    return (word & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp4_step(
    a_low, a_high, w_ptr, s_ptr, rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """One K step: [BLOCK_N, BLOCK_K / 32] each scale group's sum of
    products, times its scale. A byte widened with its sign has the high nibble's sign on bit
    31 already, so each nibble becomes float32 bits in two or three integer steps."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = _load_tile(w_ptr + rows[:, None] * stride_wn + offs_b[None, :] * stride_wk,
                      (offs_b < k // 2)[None, :], MASK_K, False)  # fmt: skip
    b = byte.to(tl.int8, bitcast=True).to(tl.int32)
    low = (((b << 28) >> 6) & _E2M1_F32_BITS).to(tl.float32, bitcast=True)
    high = ((b << 18) & _E2M1_F32_BITS).to(tl.float32, bitcast=True)
    products = low * a_low[None, :] + high * a_high[None, :]
    sums = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // 32, 16)), axis=2)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    raw = _load_tile(s_ptr + rows[:, None] * stride_sn + offs_g[None, :] * stride_sk,
                     (offs_g < k // 32)[None, :], MASK_K, False)  # fmt: skip
    return sums * _SUM_BACK * _group_scale(raw, W_MXFP4, False)


def pair_gemv(
    a: Activations,
    w: ExpertMatrix,
    out: torch.Tensor,
    rows: EachPair,
    epilogue: Epilogue,
    tile: GemmTile,
    slot_sum: SlotSum | None = None,
) -> None:
    """Write `out` [P, N'] (N' = N / 2 with a gated activation) for every pair here, or with
    `slot_sum`, [M, N] for every token (GEMM2: no gated activation, no amax); `tile`'s block_n,
    block_k and num_warps (its stages and group_m do not apply)."""
    args = gemm_args(a, w, out, epilogue, tile.block_k)
    kind, group = WeightKind(args["KIND"]), args["GROUP"]
    block_n = tile.block_n
    if kind == WeightKind.FP8_BLOCK:  # a column tile within one scale row-block
        block_n = min(block_n, group // args["GATE_STEP"])
    if kind == WeightKind.MXFP4 and tile.block_k % group:
        raise ValueError(f"mxfp4 GEMVs step over whole {group}-wide groups, got {tile.block_k}")
    pairs = rows.experts.numel()
    top_k, extra = 0, None
    if slot_sum is not None:
        if epilogue.gate_up is not None or epilogue.amax is not None:
            raise ValueError("a summing GEMV takes no gated activation and no amax")
        top_k, extra = slot_sum.top_k, slot_sum.extra
        args["MASK_K"] = True  # a pair of another rank's expert masks all its loads
    programs = pairs // max(top_k, 1)  # pairs, or tokens
    if programs > MAX_PAIRS:
        rows_of = "tokens" if top_k else "pairs"
        raise ValueError(f"per-pair GEMVs take at most {MAX_PAIRS} {rows_of}, got {programs}")
    if programs == 0:
        return
    _pair_gemv_kernel[(triton.cdiv(args["n_out"], block_n), programs)](
        experts_ptr=rows.experts, extra_ptr=extra,
        stride_extra=0 if extra is None else extra.stride(0), HAS_EXTRA=extra is not None,
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages, launch_pdl=args["PDL"], **args,
    )  # fmt: skip
