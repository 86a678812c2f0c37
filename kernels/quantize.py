"""Quantise and dequantise, in plain torch: the one implementation the converter, the reference
backend and the tests share. Every scale here is a *dequantisation* multiplier: x ~= q * scale.

Weights are [..., N, K] (any leading expert axis); activations are [M, K].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.arith import ceil_div
from kernels.quant_scheme import FP8, FP8_BLOCK, MXFP4_GROUP, ActQuant, QuantConfig, QuantScheme
from kernels.tensors import ExpertWeights

if TYPE_CHECKING:
    from kernels.config import MoEConfig

FP8_MAX = torch.finfo(FP8).max  # 448
_TINY = 1e-12  # keeps all-zero rows and blocks from dividing by zero

# e2m1 magnitudes for codes 0..7; bit 3 is the sign. Exactly representable in every float type.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MAX = 6.0
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2: the block scale is 2**(floor(log2(amax)) - 2)


def _fp8_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# ---- 4-bit packing: element 2j in the low nibble, 2j + 1 in the high nibble -------------------


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] integer codes in [0, 16) -> [..., K/2] uint8."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension ({codes.shape[-1]}) two per byte")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes in [0, 16)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# ---- fp8 e4m3 -------------------------------------------------------------------------------


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], scale [E]): one scale per expert."""
    amax = w.abs().flatten(1).amax(dim=1).float().clamp_min(_TINY)
    scale = amax / FP8_MAX
    return _fp8_cast(w.float(), scale[:, None, None]), scale


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (fp8, scale [..., N]): one scale per output row."""
    scale = w.abs().amax(dim=-1).float().clamp_min(_TINY) / FP8_MAX
    return _fp8_cast(w.float(), scale[..., None]), scale


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (fp8 [..., N, K], scale [..., ceil(N/128), ceil(K/128)])."""
    n, k = w.shape[-2:]
    nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    tiles = _pad_to(w.float(), nb * FP8_BLOCK, kb * FP8_BLOCK)
    tiles = tiles.unflatten(-1, (kb, FP8_BLOCK)).unflatten(
        -3, (nb, FP8_BLOCK)
    )  # [.., nb, B, kb, B]
    scale = tiles.abs().amax(dim=(-3, -1)).clamp_min(_TINY) / FP8_MAX  # [..., nb, kb]
    return _fp8_cast(w.float(), expand_block_scale(scale, n, k)), scale


def expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., ceil(N/128), ceil(K/128)] -> [..., N, K]: each tile's scale on each of its elements."""
    full = scale.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return full[..., :n, :k]


# ---- integer weights (activations stay 16-bit) --------------------------------------------


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (int8, scale [..., N]), symmetric."""
    scale = w.abs().amax(dim=-1).float().clamp_min(_TINY) / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_int4_grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (uint8 [..., N, K/2], scale [..., N, K/group]).

    Symmetric signed values in [-8, 7], stored with a +8 offset as unsigned nibbles.
    """
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"int4 needs K ({k}) to be a multiple of the group size ({group_size})")
    groups = w.float().unflatten(-1, (k // group_size, group_size))
    scale = groups.abs().amax(dim=-1).clamp_min(_TINY) / 7.0
    q = torch.round(groups / scale[..., None]).clamp(-8, 7) + 8
    return pack_nibbles(q.flatten(-2)), scale


def dequantize_int4_grouped(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = unpack_nibbles(packed).float() - 8.0  # [..., N, K]
    group_size = values.shape[-1] // scale.shape[-1]
    return values * scale.repeat_interleave(group_size, dim=-1)


# ---- MXFP4: e2m1 values, one power-of-two (e8m0) scale per 32 along K ----------------------


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (uint8 [..., N, K/2] e2m1 pairs, uint8 [..., N, K/32] biased exponents)."""
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs K ({k}) to be a multiple of {MXFP4_GROUP}")
    groups = w.float().unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))
    amax = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - _E2M1_EMAX).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX)
    # nearest representable magnitude (ties go to the smaller code)
    values = torch.tensor(E2M1_VALUES, device=w.device)
    midpoints = (values[1:] + values[:-1]) / 2
    magnitude_code = torch.bucketize(scaled.abs(), midpoints, right=False)
    sign = (scaled < 0).to(torch.uint8) << 3
    codes = (magnitude_code.to(torch.uint8) | sign).flatten(-2)
    return pack_nibbles(codes), (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> torch.Tensor:
    codes = unpack_nibbles(packed).long()  # [..., N, K]
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    values = lut[codes]
    scale = torch.exp2(scale_e8m0.float() - 127.0)
    return values * scale.repeat_interleave(MXFP4_GROUP, dim=-1)


# ---- one entry point per direction, by scheme ---------------------------------------------


def quantize_weight(
    w: torch.Tensor, quant: QuantConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float weights [E, N, K] -> (stored weight, scale or None) in `quant`'s layout."""
    match quant.scheme:
        case QuantScheme.NONE:
            return w, None
        case QuantScheme.FP8_TENSOR:
            return quantize_fp8_per_tensor(w)
        case QuantScheme.FP8_TOKEN:
            return quantize_fp8_per_channel(w)
        case QuantScheme.FP8_BLOCK:
            return quantize_fp8_block(w)
        case QuantScheme.INT8_W8A16:
            return quantize_int8_per_channel(w)
        case QuantScheme.INT4_W4A16:
            return quantize_int4_grouped(w, quant.group_size)
        case QuantScheme.MXFP4:
            return quantize_mxfp4(w)
    raise AssertionError(quant.scheme)


def dequantize_weight(
    w: torch.Tensor, scale: torch.Tensor | None, quant: QuantConfig
) -> torch.Tensor:
    """Stored weight [E, N, K'] (+ scale) -> float32 [E, N, K], exactly."""
    match quant.scheme:
        case QuantScheme.NONE:
            return w.float()
        case QuantScheme.FP8_TENSOR:
            return w.float() * scale.view(-1, *([1] * (w.dim() - 1)))
        case QuantScheme.FP8_TOKEN | QuantScheme.INT8_W8A16:
            return w.float() * scale[..., None]
        case QuantScheme.FP8_BLOCK:
            return w.float() * expand_block_scale(scale, *w.shape[-2:])
        case QuantScheme.INT4_W4A16:
            return dequantize_int4_grouped(w, scale)
        case QuantScheme.MXFP4:
            return dequantize_mxfp4(w, scale)
    raise AssertionError(quant.scheme)


def quantize_expert_weights(cfg: MoEConfig, tensors: dict[str, torch.Tensor]) -> ExpertWeights:
    """Float expert tensors (w13, w2, optional biases) -> ExpertWeights in cfg.quant's layout
    (biases stay float32)."""
    w13, w13_scale = quantize_weight(tensors["w13"], cfg.quant)
    w2, w2_scale = quantize_weight(tensors["w2"], cfg.quant)
    if cfg.quant.scheme == QuantScheme.NONE:
        w13, w2 = w13.to(cfg.dtype), w2.to(cfg.dtype)
    return ExpertWeights(
        w13, w2, w13_scale, w2_scale, tensors.get("w13_bias"), tensors.get("w2_bias")
    )


def quantize_activation(x: torch.Tensor, how: ActQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], scale).

    scale is [1] for TENSOR, [M, 1] for TOKEN and [M, ceil(K/128)] for GROUP.
    """
    x = x.float()
    match how:
        case ActQuant.TENSOR:
            scale = (x.abs().amax().clamp_min(_TINY) / FP8_MAX).reshape(1)
            return _fp8_cast(x, scale), scale
        case ActQuant.TOKEN:
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / FP8_MAX
            return _fp8_cast(x, scale), scale
        case ActQuant.GROUP:
            m, k = x.shape
            kb = ceil_div(k, FP8_BLOCK)
            groups = torch.nn.functional.pad(x, (0, kb * FP8_BLOCK - k)).view(m, kb, FP8_BLOCK)
            scale = groups.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX
            full = scale.repeat_interleave(FP8_BLOCK, dim=-1)[:, :k]
            return _fp8_cast(x, full), scale
    raise AssertionError(how)


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, how: ActQuant) -> torch.Tensor:
    """Inverse of `quantize_activation`, in float32."""
    if how == ActQuant.GROUP:
        scale = scale.repeat_interleave(FP8_BLOCK, dim=-1)[:, : q.shape[-1]]
    return q.float() * scale
