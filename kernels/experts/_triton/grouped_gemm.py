"""One grouped GEMM for both MoE GEMMs and both formats.

For each block of BLOCK_M rows that all belong to expert e:
    C[rows] = epilogue(A[rows // a_div] @ dequant(W[e]).T)
where the rows come from `align_pairs` (standard format: pair ids, A row = pair // top_k, so the
input is gathered, never permuted) or from an expert's valid rows of [E, max_tokens, K]
(batched format: blocks past an expert's count exit at once). The epilogue adds the bias,
applies the gated activation (GEMM1: gate and up tiles accumulate side by side, so the 2I-wide
product never reaches memory) and multiplies by the pair's router weight (GEMM2).
Weights are dequantised in the K loop; fp8 activations go to the tensor cores as fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...arith import ceil_div
from ...config import ActivationSpec, GateUp
from ...dependent_launch import begin, dependent_launch
from ...quant_scheme import FP8, ActQuant, QuantConfig
from .align import AlignedPairs
from .codes import (
    ACT_PER_TENSOR,
    ACT_PER_TOKEN,
    ACT_SCALE,
    ACTIVATION,
    NO_ACTIVATION,
    W_DENSE,
    W_FP8_BLOCK,
    W_FP8_TENSOR,
    W_INT4_GROUP,
    W_MXFP4,
    W_PER_CHANNEL,
    WeightKind,
    gated_activation,
    weight_kind,
)


@dataclass(frozen=True)
class Activations:
    """A: [R, K] rows the GEMM reads (fp8 with `scale`, or 16/32-bit with none)."""

    data: torch.Tensor  # [R, K]
    scale: torch.Tensor | None = None  # [1], [R, 1] or [R, ceil(K/128)] float32
    act_quant: ActQuant | None = None
    pairs_per_row: int = 1  # output row r reads A row r // pairs_per_row (top_k for tokens)


@dataclass(frozen=True)
class ExpertMatrix:
    """One GEMM's weights for every expert: logical [E, N, K] in `quant`'s stored layout."""

    data: torch.Tensor  # [E, N, K], packed 4-bit [E, N, K/2]
    scale: torch.Tensor | None
    bias: torch.Tensor | None  # [E, N]
    quant: QuantConfig

    @property
    def n(self) -> int:
        return self.data.shape[1]

    @property
    def k(self) -> int:
        return self.data.shape[2] * self.quant.spec.values.per_byte

    def n_slice(self, n: slice) -> ExpertMatrix:
        """Rows `n` of every expert's matrix (its GEMM's output columns): views, no copies. They
        start on a scale group's first row."""
        scale, groups = self.scale, self.quant.spec.scales
        if scale is not None and groups is not None and groups.n is not None:
            if n.start % groups.n:
                raise ValueError(f"rows from {n.start} split a scale group of {groups.n} rows")
            first = n.start // groups.n
            scale = scale.narrow(
                scale.dim() + groups.n_dim, first, ceil_div(n.stop, groups.n) - first
            )
        bias = None if self.bias is None else self.bias[:, n]
        return ExpertMatrix(self.data[:, n], scale, bias, self.quant)


@dataclass(frozen=True)
class BatchedRows:
    """Batched format: row e * max_tokens + t is valid when t < tokens_per_expert[e]."""

    tokens_per_expert: torch.Tensor  # [E] int32
    max_tokens: int
    block_m: int


@dataclass(frozen=True)
class Epilogue:
    gate_up: ActivationSpec | None = None  # GEMM1: fuse this gated activation (N -> N / 2)
    row_weights: torch.Tensor | None = None  # GEMM2: [P] float32 router weight per pair
    # GEMM1 of a tensor-wide fp8 scale: [1] float32 raised to the largest |value| written, so
    # the intermediate's scale needs no pass of its own over it
    amax: torch.Tensor | None = None


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0  # program order: 0 row blocks fastest, else swizzled in groups of this


@triton.jit
def _load_tile(ptrs, mask, MASKED: tl.constexpr, AS_BYTES: tl.constexpr):
    """tl.load, with zeros where masked when MASKED. On the interpreter, which cannot load fp8,
    fp8 tensors arrive as their bytes (uint8) and are reinterpreted here; not on the GPU, where
    the round trip through registers stalls the load pipeline at prefill."""
    if MASKED:  # noqa: SIM108 (compile-time branch: only one side is built)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    if AS_BYTES:
        tile = tile.to(tl.float8e4nv, bitcast=True)
    return tile


@triton.jit
def _e2m1_to_float(nibble):
    """e2m1 codes (sign bit 3, exponent bits 1-2, mantissa bit 0) -> float32. The three low bits
    land on fp16's lowest two exponent bits and top mantissa bit: an fp16 of 2**-14 times the
    value (code 1, 0.5, becomes an fp16 subnormal), converted exactly and scaled back; fewer
    integer steps than building float32 bits, which the per-pair GEMVs are bound by."""
    code = nibble.to(tl.uint16)
    half = ((code & 7) << 9) | ((code & 8) << 12)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _decoded_pairs(byte, KIND: tl.constexpr, BF16: tl.constexpr):
    """Packed bytes [...] -> the values of their low and high nibbles [..., 2]: float32, or
    bf16 (mxfp4 into bf16 dots: the values and power-of-two scales are exact in bf16, so each
    product rounds once, as through float32). bf16 takes each e2m1 code's three low bits
    straight into bf16's two lowest exponent bits and top mantissa bit (2**-126 times the value;
    code 1, 0.5, a subnormal) and a multiply by 2**126 restores it, two codes an instruction."""
    if BF16:
        b = byte.to(tl.uint16)
        low = ((b & 7) << 6) | ((b & 8) << 12)
        high = ((b & 0x70) << 2) | ((b & 0x80) << 8)
        w = tl.join(low, high).to(tl.bfloat16, bitcast=True) * tl.full((), 2.0**126, tl.bfloat16)
    else:
        nibble = tl.join(byte & 0xF, byte >> 4)
        if KIND == W_INT4_GROUP:
            w = (nibble.to(tl.int32) - 8).to(tl.float32)
        else:
            w = _e2m1_to_float(nibble)
    return w


@triton.jit
def _group_scale(raw, KIND: tl.constexpr, BF16: tl.constexpr):
    """Loaded group scales -> float32 (BF16: bf16) multipliers."""
    scale = raw.to(tl.float32)  # int4: already float32
    if KIND == W_MXFP4:  # e8m0: 2**(raw - 127), built as float bits (raw 0 flushes to 0)
        if BF16:
            scale = (raw.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
        else:
            scale = (raw.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _packed_tile(
    w_ptr, s_ptr, n_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """int4 / mxfp4: [BLOCK_K, BLOCK_N] float32 (BF16: bf16) from [BLOCK_K / 2, BLOCK_N] bytes
    and the group scales; a tile lies within one group or covers whole groups (checked by the
    launcher)."""
    BLOCK_N: tl.constexpr = n_rows.shape[0]
    offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = _load_tile(w_ptr + n_rows[None, :] * stride_wn + offs_h[:, None] * stride_wk,
                      (offs_h < k // 2)[:, None], MASK_K, False)  # fmt: skip
    pairs = _decoded_pairs(byte, KIND, BF16)  # [BLOCK_K / 2, BLOCK_N, 2]: element 2j low
    w = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_K, BLOCK_N))
    if GROUP >= BLOCK_K:
        raw = tl.load(s_ptr + n_rows * stride_sn + (k0 // GROUP) * stride_sk)
        w = w * _group_scale(raw, KIND, BF16)[None, :]
    else:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        raw = _load_tile(s_ptr + n_rows[None, :] * stride_sn + offs_g[:, None] * stride_sk,
                         (offs_g < k // GROUP)[:, None], MASK_K, False)  # fmt: skip
        scale = _group_scale(raw, KIND, BF16)  # [BLOCK_K / GROUP, BLOCK_N]
        w = tl.reshape(w, (BLOCK_K // GROUP, GROUP, BLOCK_N)) * scale[:, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, n_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
    KIND: tl.constexpr, GROUP: tl.constexpr, W_FP8: tl.constexpr, FP8_BYTES: tl.constexpr,
    DOT_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
    BF16_CODES: tl.constexpr,  # mxfp4 on the GPU: decoded in bf16 (_decoded_pairs)
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] dot operand of this expert's rows `n_rows`: as stored (16-bit, fp8),
    converted (int8) or dequantised (int4, mxfp4)."""
    if KIND == W_INT4_GROUP or KIND == W_MXFP4:  # noqa: SIM109 (Triton has no `in` on tuples)
        w = _packed_tile(w_ptr, s_ptr, n_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
                         KIND, GROUP, BLOCK_K, MASK_K, BF16_CODES)  # fmt: skip
        return w.to(DOT_DTYPE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = _load_tile(w_ptr + n_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                   (offs_k < k)[:, None], MASK_K, W_FP8 and FP8_BYTES)  # fmt: skip
    if not W_FP8:  # int8 (w8a16) converts; 16/32-bit already match the activations
        w = w.to(DOT_DTYPE)
    return w


@triton.jit
def _block_scaled(part, a_s_ptr, a_rows, stride_asm, s_ptr, n_blocks, stride_sn, stride_sk, k0,
                  GROUP: tl.constexpr, ONE_BLOCK: tl.constexpr):  # fmt: skip
    """fp8-block: the dot of one K step times its activation group scales [BLOCK_M] and weight
    tile scales: `n_blocks` is the scale's row-block of each output column [BLOCK_N], or, when
    ONE_BLOCK, the one row-block of the whole tile (a scalar: one load instead of BLOCK_N)."""
    kb = k0 // GROUP
    a_s = tl.load(a_s_ptr + a_rows * stride_asm + kb)
    b_s = tl.load(s_ptr + n_blocks * stride_sn + kb * stride_sk)
    # one return after the branch: Triton 3.9 builds the code after a compile-time branch's
    # return too, and b_s[None, :] fails on a scalar (tests/kernels/test_hopper_compile.py)
    if ONE_BLOCK:  # noqa: SIM108 (compile-time branch: only one side is built)
        scaled = part * a_s[:, None] * b_s
    else:
        scaled = part * a_s[:, None] * b_s[None, :]
    return scaled


@triton.jit
def _after_k_scales(acc, a_s_ptr, a_rows, stride_asm, s_ptr, n_rows, ACT_SCALE, KIND, stride_sn):
    """Scales constant along K: activation (tensor / row) times weight (expert / row)."""
    if ACT_SCALE == ACT_PER_TENSOR:
        acc = acc * tl.load(a_s_ptr)
    if ACT_SCALE == ACT_PER_TOKEN:
        acc = acc * tl.load(a_s_ptr + a_rows * stride_asm)[:, None]
    if KIND == W_FP8_TENSOR:
        acc = acc * tl.load(s_ptr)
    if KIND == W_PER_CHANNEL:
        acc = acc * tl.load(s_ptr + n_rows * stride_sn)[None, :]
    return acc


@triton.jit
def _epilogue(
    acc, acc_up, a_s_ptr, a_rows, stride_asm, s_ptr, gate_rows, up_rows, stride_sn, bias_ptr,
    bias_offset, alpha, limit, ACT_SCALE: tl.constexpr, KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
):  # fmt: skip
    """After the K loop: the scales constant along K, the bias (at `bias_offset`, the expert's
    row), and the gated activation of gate `acc` and `acc_up` ([rows, BLOCK_N] each)."""
    acc = _after_k_scales(acc, a_s_ptr, a_rows, stride_asm, s_ptr, gate_rows, ACT_SCALE, KIND,
                          stride_sn)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + bias_offset + gate_rows)[None, :]
    if ACTIVATION != NO_ACTIVATION:
        up = _after_k_scales(acc_up, a_s_ptr, a_rows, stride_asm, s_ptr, up_rows, ACT_SCALE,
                             KIND, stride_sn)  # fmt: skip
        if HAS_BIAS:
            up += tl.load(bias_ptr + bias_offset + up_rows)[None, :]
        acc = gated_activation(acc, up, ACTIVATION, alpha, limit)
    return acc


@triton.jit
def _tile_of(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Program -> (row block, column block). GROUP_M 0: row blocks fastest, so the row blocks of
    one expert (adjacent) read each weight tile together. Else GROUP_M row blocks at a time
    sweep every column block before the next group starts: the group's input rows are reused
    across columns while in L2 (which pays depends on the shape: `GemmTile.group_m`)."""
    if GROUP_M == 0:
        return pid % num_m_blocks, pid // num_m_blocks
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_s_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    c_ptr,
    row_ids_ptr,
    block_expert_ptr,
    tokens_per_expert_ptr,
    row_weights_ptr,
    amax_ptr,
    num_pairs,
    max_tokens,
    num_m_blocks,
    a_div,
    n_out,
    k,
    up_offset,
    up_block_offset,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_cm,
    alpha,
    limit,
    BATCHED: tl.constexpr,
    KIND: tl.constexpr,
    ACT_SCALE: tl.constexpr,
    GROUP: tl.constexpr,
    ACTIVATION: tl.constexpr,  # codes.ACTIVATION: a gated activation over gate and up tiles
    GATE_STEP: tl.constexpr,  # weight row of gate n: n * GATE_STEP; of up n: that + up_offset
    # fp8-block scale row-block of gate n: n // GROUP (split) or 2n // GROUP (interleaved); of
    # up n: up_block_offset + n // GROUP (split: gate and up are blocked apart) or (2n+1) // GROUP
    ONE_BLOCK: tl.constexpr,  # fp8-block, split: a column tile lies within one scale row-block
    HAS_BIAS: tl.constexpr,
    HAS_ROW_WEIGHTS: tl.constexpr,
    HAS_AMAX: tl.constexpr,
    A_FP8: tl.constexpr,
    W_FP8: tl.constexpr,
    FP8_BYTES: tl.constexpr,  # fp8 tensors come as uint8 views (the interpreter: _load_tile)
    MASK_K: tl.constexpr,  # K is not a multiple of BLOCK_K: loads mask the last K tile
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16_CODES: tl.constexpr,  # _weight_tile
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/dependent_launch.py
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_m_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    begin(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    if BATCHED:
        blocks_per_expert = tl.cdiv(max_tokens, BLOCK_M)
        expert = pid_m // blocks_per_expert
        first = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.load(tokens_per_expert_ptr + expert)
        if first >= count:
            return
        row_mask = first + offs_m < count
        rows = expert.to(tl.int64) * max_tokens + first + offs_m
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = tl.load(row_ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)
        row_mask = rows < num_pairs
    rows = tl.where(row_mask, rows, 0)
    a_rows = rows // a_div
    expert = expert.to(tl.int64)
    w_ptr += expert * stride_we
    if KIND != W_DENSE:
        s_ptr += expert * stride_se

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    # loads wrap past the last column (stores are masked), so only a K tail needs masks
    gate_rows = (offs_n % n_out) * GATE_STEP
    up_rows = gate_rows + up_offset
    if ONE_BLOCK:
        gate_blocks = pid_n * BLOCK_N // GROUP
        up_blocks = up_block_offset + gate_blocks
    else:
        gate_blocks = gate_rows // GROUP
        up_blocks = up_rows // GROUP if GATE_STEP == 2 else up_block_offset + offs_n // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # rows past the valid ones are masked: in decode most of a block is padding
        a_mask = row_mask[:, None] & (offs_k < k)[None, :] if MASK_K else row_mask[:, None]
        a = _load_tile(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], a_mask, True,
                       A_FP8 and FP8_BYTES)  # fmt: skip
        b = _weight_tile(
            w_ptr, s_ptr, gate_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
            KIND, GROUP, W_FP8, FP8_BYTES, DOT_DTYPE, BLOCK_K, MASK_K, BF16_CODES,
        )  # fmt: skip
        part = tl.dot(a, b, input_precision=DOT_PRECISION)
        if KIND == W_FP8_BLOCK:
            part = _block_scaled(part, a_s_ptr, a_rows, stride_asm, s_ptr, gate_blocks,
                                 stride_sn, stride_sk, k0, GROUP, ONE_BLOCK)  # fmt: skip
        acc += part
        if ACTIVATION != NO_ACTIVATION:
            b = _weight_tile(
                w_ptr, s_ptr, up_rows, k0, k, stride_wn, stride_wk, stride_sn, stride_sk,
                KIND, GROUP, W_FP8, FP8_BYTES, DOT_DTYPE, BLOCK_K, MASK_K, BF16_CODES,
            )  # fmt: skip
            part = tl.dot(a, b, input_precision=DOT_PRECISION)
            if KIND == W_FP8_BLOCK:
                part = _block_scaled(part, a_s_ptr, a_rows, stride_asm, s_ptr, up_blocks,
                                     stride_sn, stride_sk, k0, GROUP, ONE_BLOCK)  # fmt: skip
            acc_up += part

    acc = _epilogue(
        acc, acc_up, a_s_ptr, a_rows, stride_asm, s_ptr, gate_rows, up_rows, stride_sn, bias_ptr,
        expert * stride_be, alpha, limit, ACT_SCALE, KIND, HAS_BIAS, ACTIVATION,
    )  # fmt: skip
    if HAS_ROW_WEIGHTS:
        acc = acc * tl.load(row_weights_ptr + rows, mask=row_mask, other=0)[:, None]
    written = row_mask[:, None] & n_mask[None, :]
    if HAS_AMAX:
        raise_amax(amax_ptr, acc, written)
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=written)  # fmt: skip


@triton.jit
def raise_amax(amax_ptr, values, written):
    """One atomic a tile: amax_ptr[0] = max(itself, |values| where written)."""
    tile_max = tl.max(tl.where(written, tl.abs(values), 0.0))
    tl.atomic_max(amax_ptr, tile_max, sem="relaxed")


_DOT_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_dtype(a: torch.Tensor) -> tl.dtype:
    return tl.float8e4nv if a.dtype == FP8 else _DOT_DTYPE[a.dtype]


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _scale_strides(w: ExpertMatrix) -> tuple[int, int, int]:
    """(expert, row, column) strides of the weight scale, 0 along axes it does not have."""
    s = w.scale
    if s is None:
        return 0, 0, 0
    strides = list(s.stride()) + [0] * (3 - s.dim())
    return strides[0], strides[1], strides[2]


def gemm_args(a: Activations, w: ExpertMatrix, out: torch.Tensor, epilogue: Epilogue,
              block_k: int) -> dict:  # fmt: skip
    """The arguments, by name, that both expert GEMM kernels take (this one and gemv.py's); a
    ValueError where K steps of `block_k` and the weights' scale groups do not nest."""
    group = w.quant.spec.k_group or 1  # K columns per weight scale (GROUP x GROUP fp8 tiles)
    if group > 1 and group % block_k and block_k % group:
        raise ValueError(f"block_k {block_k} and the {group}-wide scale groups must nest")
    spec = epilogue.gate_up
    gated = spec is not None
    n_out = w.n // 2 if gated else w.n
    interleaved = gated and spec.gate_up == GateUp.INTERLEAVED
    s_e, s_n, s_k = _scale_strides(w)
    fp8_bytes = not a.data.is_cuda  # the interpreter (see _load_tile)
    operand = _bytes_if_fp8 if fp8_bytes else (lambda t: t)
    return {
        "a_ptr": operand(a.data), "a_s_ptr": a.scale, "w_ptr": operand(w.data),
        "s_ptr": w.scale, "bias_ptr": w.bias, "c_ptr": out,
        "row_weights_ptr": epilogue.row_weights, "amax_ptr": epilogue.amax,
        "n_out": n_out, "k": w.k, "a_div": a.pairs_per_row,
        "up_offset": 1 if interleaved else n_out,
        "up_block_offset": triton.cdiv(n_out, group) if gated else 0,
        "stride_am": a.data.stride(0),
        "stride_asm": a.scale.stride(0) if a.scale is not None and a.scale.dim() == 2 else 0,
        "stride_we": w.data.stride(0), "stride_wn": w.data.stride(1),
        "stride_wk": w.data.stride(2), "stride_se": s_e, "stride_sn": s_n, "stride_sk": s_k,
        "stride_be": w.bias.stride(0) if w.bias is not None else 0, "stride_cm": out.stride(0),
        "alpha": spec.alpha if gated else 0.0, "limit": spec.limit if gated else 0.0,
        "KIND": int(weight_kind(w.quant.spec)),
        "ACT_SCALE": ACT_SCALE[a.act_quant],
        "GROUP": group,
        "ACTIVATION": ACTIVATION[spec.kind if gated else None],
        "GATE_STEP": 2 if interleaved else 1,
        "HAS_BIAS": w.bias is not None,
        "HAS_ROW_WEIGHTS": epilogue.row_weights is not None,
        "HAS_AMAX": epilogue.amax is not None,
        "A_FP8": a.data.dtype == FP8,
        "W_FP8": w.data.dtype == FP8,
        "FP8_BYTES": fp8_bytes,
        "MASK_K": w.k % block_k != 0,
        "PDL": dependent_launch(out.device),
    }  # fmt: skip


def grouped_gemm(
    a: Activations,
    w: ExpertMatrix,
    out: torch.Tensor,
    rows: AlignedPairs | BatchedRows,
    epilogue: Epilogue,
    tile: GemmTile,
) -> None:
    """Write `out` [rows, N'] (N' = N / 2 with a gated activation) for every valid row."""
    args = gemm_args(a, w, out, epilogue, tile.block_k)
    kind, group = WeightKind(args["KIND"]), args["GROUP"]
    if kind == WeightKind.FP8_BLOCK and group % tile.block_k:  # its scales apply per K step
        raise ValueError(f"fp8-block needs block_k to divide {group}, got {tile.block_k}")
    if isinstance(rows, AlignedPairs):
        block_m, grid_m, max_tokens, num_pairs = rows.block_m, rows.num_blocks, 0, rows.num_pairs
        row_ids, block_expert, tokens_per_expert = rows.row_ids, rows.block_expert, None
    else:
        block_m, max_tokens, num_pairs = rows.block_m, rows.max_tokens, 0
        grid_m = w.data.shape[0] * triton.cdiv(max_tokens, block_m)
        row_ids = block_expert = None
        tokens_per_expert = rows.tokens_per_expert
    if grid_m == 0:
        return
    split_one_block = kind == WeightKind.FP8_BLOCK and args["GATE_STEP"] == 1
    grid = (grid_m * triton.cdiv(args["n_out"], tile.block_n),)
    _grouped_gemm_kernel[grid](
        row_ids_ptr=row_ids, block_expert_ptr=block_expert,
        tokens_per_expert_ptr=tokens_per_expert, num_pairs=num_pairs, max_tokens=max_tokens,
        num_m_blocks=grid_m, BATCHED=isinstance(rows, BatchedRows),
        ONE_BLOCK=split_one_block and group % tile.block_n == 0,
        DOT_DTYPE=_dot_dtype(a.data),
        # mxfp4 decoded in bf16, faster than through fp16 (`moe-serve bench kernels`, gpt-oss);
        # not on the interpreter, whose bf16 bit casts are wrong
        BF16_CODES=kind == WeightKind.MXFP4 and a.data.dtype == torch.bfloat16 and a.data.is_cuda,
        DOT_PRECISION="ieee" if a.data.dtype == torch.float32 else "tf32",
        GROUP_M=tile.group_m, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=args["PDL"], **args,
    )  # fmt: skip
