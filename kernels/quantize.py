"""Quantise and dequantise, in plain torch: the one implementation the converter, the reference
backend and the tests share. Every scale here is a *dequantisation* multiplier: x ~= q * scale.

Weights are [..., N, K] (any leading expert axis); activations are [M, K].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .arith import ceil_div, round_up
from .quant_scheme import (
    E2M1,
    E8M0,
    FP8,
    FP8_BLOCK,
    FP8_E4M3,
    INT4,
    INT8,
    ActQuant,
    QuantConfig,
    QuantScheme,
    ScaleGroups,
)
from .tensors import ExpertWeights

if TYPE_CHECKING:
    from .config import MoEConfig

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


# ---- scale groups: one scale per (n rows, k columns) of [..., N, K], None = the whole axis ----


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def group_amax(w: torch.Tensor, groups: ScaleGroups) -> torch.Tensor:
    """|w| [..., N, K] -> float32 amax per group, shaped as the scale (`ScaleGroups.shape`)."""
    n, k = w.shape[-2:]
    gn, gk = groups.n or n, groups.k or k
    if not groups.ragged and k % gk:
        raise ValueError(f"K ({k}) must be a multiple of the group size ({gk})")
    tiles = _pad_to(w.abs(), round_up(n, gn), round_up(k, gk))
    tiles = tiles.unflatten(-1, (-1, gk)).unflatten(-3, (-1, gn))  # [..., N/gn, gn, K/gk, gk]
    amax = tiles.amax(dim=(-3, -1)).float()  # [..., N/gn, K/gk]
    if groups.k is None:
        amax = amax.squeeze(-1)
    if groups.n is None:
        amax = amax.squeeze(-1)
    return amax


def expand_scale(scale: torch.Tensor, groups: ScaleGroups, n: int, k: int) -> torch.Tensor:
    """A scale shaped by `groups` -> one that broadcasts over [..., N, K]: each group's scale on
    each of its elements (axes a single scale covers stay of size 1)."""
    if groups.k is None:
        scale = scale[..., None]
    if groups.n is None:
        scale = scale[..., None, :]
    if groups.n not in (None, 1):
        scale = scale.repeat_interleave(groups.n, dim=-2)[..., :n, :]
    if groups.k is not None and groups.k > 1:
        scale = scale.repeat_interleave(groups.k, dim=-1)[..., :k]
    return scale


# ---- one encoder and one decoder per value type; `groups` says which values share a scale ----


def _encode_fp8(w: torch.Tensor, groups: ScaleGroups) -> tuple[torch.Tensor, torch.Tensor]:
    scale = group_amax(w, groups).clamp_min(_TINY) / FP8_MAX
    return _fp8_cast(w.float(), expand_scale(scale, groups, *w.shape[-2:])), scale


def _integer_codes(w: torch.Tensor, groups: ScaleGroups, qmax: int) -> tuple[torch.Tensor, ...]:
    """Symmetric: round(w / scale) in [-qmax - 1, qmax], scale = amax / qmax per group."""
    scale = group_amax(w, groups).clamp_min(_TINY) / qmax
    full = expand_scale(scale, groups, *w.shape[-2:])
    return torch.round(w.float() / full).clamp(-qmax - 1, qmax), scale


def _encode_int8(w: torch.Tensor, groups: ScaleGroups) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _integer_codes(w, groups, 127)
    return q.to(torch.int8), scale


def _encode_int4(w: torch.Tensor, groups: ScaleGroups) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _integer_codes(w, groups, 7)
    return pack_nibbles(q + 8), scale  # stored with a +8 offset as unsigned nibbles


def _encode_e2m1(w: torch.Tensor, groups: ScaleGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 e2m1 pairs, and one power-of-two scale per group: a biased exponent (E8M0)."""
    amax = group_amax(w, groups).clamp_min(2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - _E2M1_EMAX).clamp(-127, 127)
    scaled = (w.float() / expand_scale(torch.exp2(exponent), groups, *w.shape[-2:])).clamp(
        -_E2M1_MAX, _E2M1_MAX
    )
    # nearest representable magnitude (ties go to the smaller code)
    values = torch.tensor(E2M1_VALUES, device=w.device)
    midpoints = (values[1:] + values[:-1]) / 2
    magnitude_code = torch.bucketize(scaled.abs(), midpoints, right=False)
    sign = (scaled < 0).to(torch.uint8) << 3
    return pack_nibbles(magnitude_code.to(torch.uint8) | sign), (exponent + 127).to(torch.uint8)


def _decode_int4(packed: torch.Tensor) -> torch.Tensor:
    return unpack_nibbles(packed).float() - 8.0


def _decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    return lut[unpack_nibbles(packed).long()]


_ENCODE = {FP8_E4M3: _encode_fp8, INT8: _encode_int8, INT4: _encode_int4, E2M1: _encode_e2m1}
_DECODE = {INT4: _decode_int4, E2M1: _decode_e2m1}  # the others: as stored, in float32


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (uint8 [..., N, K/2] e2m1 pairs, uint8 [..., N, K/32] biased exponents)."""
    return _encode_e2m1(w, QuantScheme.MXFP4.spec.scales)


def dequantize_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> torch.Tensor:
    return dequantize_weight(packed, scale_e8m0, QuantConfig(QuantScheme.MXFP4))


# ---- one entry point per direction, read off the scheme's description ---------------------


def quantize_weight(
    w: torch.Tensor, quant: QuantConfig, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float weights [E, N, K] -> (stored weight, scale or None) in `quant`'s layout.

    `parts`: N holds that many matrices stacked (a split w13: gate, up), grouped apart."""
    spec = quant.spec
    if spec.scales is None:
        return w, None
    if parts > 1 and spec.scales.splits_parts():
        pieces = [quantize_weight(p, quant) for p in w.chunk(parts, dim=-2)]
        q = torch.cat([q for q, _ in pieces], dim=-2)
        return q, torch.cat([s for _, s in pieces], dim=spec.scales.n_dim)
    return _ENCODE[spec.values](w, spec.scales)


def dequantize_weight(
    w: torch.Tensor, scale: torch.Tensor | None, quant: QuantConfig, parts: int = 1
) -> torch.Tensor:
    """Stored weight [E, N, K'] (+ scale) -> float32 [E, N, K], exactly (`parts` as in
    `quantize_weight`)."""
    spec = quant.spec
    if parts > 1 and spec.scales is not None and spec.scales.splits_parts():
        pieces = zip(w.chunk(parts, dim=-2), scale.chunk(parts, dim=spec.scales.n_dim), strict=True)
        return torch.cat([dequantize_weight(p, s, quant) for p, s in pieces], dim=-2)
    decode = _DECODE.get(spec.values)
    values = w.float() if decode is None else decode(w)
    if spec.scales is None:
        return values
    if spec.scales.dtype == E8M0:
        scale = torch.exp2(scale.float() - 127.0)
    return values * expand_scale(scale, spec.scales, *values.shape[-2:])


def quantize_expert_weights(cfg: MoEConfig, tensors: dict[str, torch.Tensor]) -> ExpertWeights:
    """Float expert tensors (w13, w2, optional biases) -> ExpertWeights in cfg.quant's layout
    (biases stay float32)."""
    w13, w13_scale = quantize_weight(tensors["w13"], cfg.quant, cfg.w13_parts)
    w2, w2_scale = quantize_weight(tensors["w2"], cfg.quant)
    if cfg.quant.spec.values.storage is None:  # unquantised: the layer's dtype
        w13, w2 = w13.to(cfg.dtype), w2.to(cfg.dtype)
    return ExpertWeights(
        w13, w2, w13_scale, w2_scale, tensors.get("w13_bias"), tensors.get("w2_bias")
    )


def quantize_activation(
    x: torch.Tensor, how: ActQuant, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], scale).

    scale is [1] for TENSOR, [M, 1] for TOKEN and [M, ceil(K/128)] for GROUP. `amax` [1]
    (TENSOR only): the largest |x| to scale by, where only some rows count (found already).
    """
    x = x.float()
    match how:
        case ActQuant.TENSOR:
            if amax is None:
                amax = x.abs().amax()
            scale = (amax.float().clamp_min(_TINY) / FP8_MAX).reshape(1)
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
