"""The compile-time codes our kernels branch on, named after what they stand for, and the one
gated activation (`gated_activation`) that the activation codes select.

A Triton kernel reads a module global only when it is a `tl.constexpr`, so each code is one:
kernels say `KIND == W_FP8_BLOCK`, never `KIND == 3`. The codes of activation scales and gated
activations come from our enums (`ActQuant`, `Activation`); 0 means "none". The weight kinds say
how the grouped GEMM turns stored weights into dot operands, and `weight_kind` reads them off the
scheme's description.
"""

from __future__ import annotations

from enum import IntEnum

import triton
import triton.language as tl

from ...config import Activation
from ...quant_scheme import E2M1, FP8_E4M3, INT4, ActQuant, SchemeSpec

# How a kernel finds an activation's fp8 scale (grouped_gemm's ACT_SCALE, quantize's HOW).
ACT_SCALE = {None: 0} | {how: code for code, how in enumerate(ActQuant, start=1)}
ACT_PER_TENSOR = tl.constexpr(ACT_SCALE[ActQuant.TENSOR])  # [1]
ACT_PER_TOKEN = tl.constexpr(ACT_SCALE[ActQuant.TOKEN])  # [R, 1]
ACT_PER_GROUP = tl.constexpr(ACT_SCALE[ActQuant.GROUP])  # [R, ceil(K/128)]

# The gated activation GEMM1 fuses (grouped_gemm's ACTIVATION); 0: none (GEMM2).
ACTIVATION = {None: 0} | {kind: code for code, kind in enumerate(Activation, start=1)}
NO_ACTIVATION = tl.constexpr(ACTIVATION[None])
SILU = tl.constexpr(ACTIVATION[Activation.SILU])
GELU = tl.constexpr(ACTIVATION[Activation.GELU])
SWIGLUOAI = tl.constexpr(ACTIVATION[Activation.SWIGLUOAI])


@triton.jit
def gated_activation(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    """float32 gate and up -> the gated activation ACTIVATION codes, as kernels.activations."""
    if ACTIVATION == SILU:
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == GELU:
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    else:  # SWIGLUOAI
        clamped = tl.minimum(gate, limit)
        out = (
            (tl.minimum(tl.maximum(up, -limit), limit) + 1.0)
            * clamped
            * tl.sigmoid(alpha * clamped)
        )
    return out


class WeightKind(IntEnum):
    """How the grouped GEMM turns stored weights into dot operands (its KIND)."""

    DENSE = 0  # 16/32-bit, as stored
    FP8_TENSOR = 1  # fp8, one scale per expert, applied after the K loop
    PER_CHANNEL = 2  # fp8 or int8, one scale per output row, applied after the K loop
    FP8_BLOCK = 3  # fp8, one scale per GROUP x GROUP tile, applied per K step
    INT4_GROUP = 4  # nibbles - 8, one scale per GROUP K columns, dequantised before the dot
    MXFP4 = 5  # e2m1 nibbles, 2**(e8m0 - 127) per GROUP K columns, dequantised before the dot


W_DENSE = tl.constexpr(WeightKind.DENSE.value)
W_FP8_TENSOR = tl.constexpr(WeightKind.FP8_TENSOR.value)
W_PER_CHANNEL = tl.constexpr(WeightKind.PER_CHANNEL.value)
W_FP8_BLOCK = tl.constexpr(WeightKind.FP8_BLOCK.value)
W_INT4_GROUP = tl.constexpr(WeightKind.INT4_GROUP.value)
W_MXFP4 = tl.constexpr(WeightKind.MXFP4.value)


def weight_kind(spec: SchemeSpec) -> WeightKind:
    """The kind of a scheme's weights, from its description (a ValueError where none fits)."""
    scales = spec.scales
    if scales is None:
        return WeightKind.DENSE
    packed = {INT4: WeightKind.INT4_GROUP, E2M1: WeightKind.MXFP4}.get(spec.values)
    if packed is not None and scales.n == 1:
        return packed
    if packed is None and scales.k is None:  # constant along K: applied after the K loop
        if scales.n is None:
            return WeightKind.FP8_TENSOR
        if scales.n == 1:
            return WeightKind.PER_CHANNEL
    if spec.values == FP8_E4M3 and scales.n == scales.k:
        return WeightKind.FP8_BLOCK
    raise ValueError(f"the grouped GEMM has no path for weights laid out as {spec}")
