"""Quantise -> dequantise round trips, and 4-bit packing against scalar references."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve.kernels.quant_scheme import FP8_BLOCK, ActQuant, QuantConfig, QuantScheme
from moe_serve.kernels.quantize import (
    E2M1_VALUES,
    dequantize_activation,
    dequantize_weight,
    pack_nibbles,
    quantize_activation,
    quantize_mxfp4,
    quantize_weight,
    unpack_nibbles,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _worst_relative_to_scale(
    w: torch.Tensor, back: torch.Tensor, scale_full: torch.Tensor
) -> float:
    return float(((w - back).abs() / scale_full).max())


# fp8 e4m3 has 3 mantissa bits: relative rounding error <= 2**-4 of the value; values that land
# in the subnormal range are off by at most half the smallest step (2**-10 in scaled units).
FP8_REL = 2.0**-4


@pytest.mark.parametrize("shape", [(3, 130, 200), (2, 128, 256), (1, 1, 1)], ids=str)
@pytest.mark.parametrize(
    "scheme", [QuantScheme.FP8_TENSOR, QuantScheme.FP8_TOKEN, QuantScheme.FP8_BLOCK]
)
def test_fp8_weight_round_trip_is_within_half_an_ulp(shape: tuple, scheme: QuantScheme) -> None:
    w = torch.randn(*shape, generator=_gen())
    quant = QuantConfig(scheme)
    q, scale = quantize_weight(w, quant)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize_weight(q, scale, quant)
    unit = dequantize_weight(torch.ones_like(q.float()).to(q.dtype), scale, quant)  # scale per elem
    err = (w - back).abs()
    bound = w.abs() * FP8_REL + unit * 2.0**-10
    assert torch.all(err <= bound + 1e-12)
    if scheme == QuantScheme.FP8_BLOCK:
        assert scale.shape == (
            shape[0],
            math.ceil(shape[1] / FP8_BLOCK),
            math.ceil(shape[2] / FP8_BLOCK),
        )


@pytest.mark.parametrize("rows", [128, 328], ids=["whole", "partial"])
def test_fp8_block_stacked_matrices_are_blocked_apart_with_partial_last_blocks(rows: int) -> None:
    gate, up = torch.randn(2, 2, rows, 200, generator=_gen(2))  # [E, I, H] each, H partial too
    quant = QuantConfig(QuantScheme.FP8_BLOCK)
    q, scale = quantize_weight(torch.cat([gate, up], dim=1), quant, parts=2)
    (qg, sg), (qu, su) = quantize_weight(gate, quant), quantize_weight(up, quant)
    assert scale.shape == (2, 2 * math.ceil(rows / 128), 2)
    assert scale.shape[1:] == QuantScheme.FP8_BLOCK.spec.scales.shape(2, 2 * rows, 200, 2)[1:]
    assert torch.equal(scale, torch.cat([sg, su], dim=1))
    assert torch.equal(q.view(torch.uint8), torch.cat([qg, qu], dim=1).view(torch.uint8))
    back = dequantize_weight(q, scale, quant, parts=2)
    expected = torch.cat([dequantize_weight(qg, sg, quant), dequantize_weight(qu, su, quant)], 1)
    assert torch.equal(back, expected)


def test_stacked_matrices_change_nothing_where_scales_are_per_row_or_per_tensor() -> None:
    w = torch.randn(2, 100, 64, generator=_gen(3))
    for scheme in (QuantScheme.FP8_TENSOR, QuantScheme.FP8_TOKEN, QuantScheme.INT8_W8A16):
        quant = QuantConfig(scheme)
        (q1, s1), (q2, s2) = quantize_weight(w, quant), quantize_weight(w, quant, parts=2)
        assert torch.equal(s1, s2)
        assert torch.equal(dequantize_weight(q1, s1, quant), dequantize_weight(q2, s2, quant, 2))


def test_fp8_block_scale_follows_each_tile_maximum() -> None:
    w = torch.randn(1, 256, 256, generator=_gen(1))
    w[0, 5, 7] = 100.0  # only tile (0, 0) sees it
    _, scale = quantize_weight(w, QuantConfig(QuantScheme.FP8_BLOCK))
    assert scale[0, 0, 0] == pytest.approx(100.0 / 448.0)
    assert scale[0, 1, 1] < 10.0 / 448.0


def test_int8_round_trip_error_is_at_most_half_a_step() -> None:
    w = torch.randn(2, 33, 70, generator=_gen(2))
    quant = QuantConfig(QuantScheme.INT8_W8A16)
    q, scale = quantize_weight(w, quant)
    assert q.dtype == torch.int8 and scale.shape == (2, 33)
    err = (w - dequantize_weight(q, scale, quant)).abs()
    assert torch.all(err <= scale[..., None] / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_round_trip_error_is_at_most_half_a_step(group: int) -> None:
    w = torch.randn(2, 17, 256, generator=_gen(3))
    quant = QuantConfig(QuantScheme.INT4_W4A16, group_size=group)
    q, scale = quantize_weight(w, quant)
    assert (
        q.shape == (2, 17, 128) and q.dtype == torch.uint8 and scale.shape == (2, 17, 256 // group)
    )
    err = (w - dequantize_weight(q, scale, quant)).abs()
    assert torch.all(err <= scale.repeat_interleave(group, -1) / 2 + 1e-7)


def test_int4_refuses_k_not_multiple_of_group() -> None:
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_weight(torch.randn(1, 4, 100), QuantConfig(QuantScheme.INT4_W4A16, group_size=64))


def test_nibble_packing_matches_scalar_reference() -> None:
    codes = torch.randint(0, 16, (5, 18), generator=_gen(4))
    packed = pack_nibbles(codes)
    for r in range(5):
        for j in range(9):
            assert int(packed[r, j]) == int(codes[r, 2 * j]) + 16 * int(codes[r, 2 * j + 1])
    assert torch.equal(unpack_nibbles(packed), codes.to(torch.uint8))


def _e2m1_scalar(code: int) -> float:
    """Decode one e2m1 code from its bits: s eem, bias 1, subnormal when e == 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    e, m = (code >> 1) & 0b11, code & 1
    magnitude = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return sign * magnitude


def test_e2m1_table_matches_the_bit_layout() -> None:
    assert [_e2m1_scalar(c) for c in range(8)] == list(E2M1_VALUES)


def test_mxfp4_dequantisation_matches_scalar_decode() -> None:
    w = torch.randn(2, 3, 64, generator=_gen(5)) * 3
    quant = QuantConfig(QuantScheme.MXFP4)
    packed, scales = quantize_mxfp4(w)
    back = dequantize_weight(packed, scales, quant)
    for idx in [(0, 0, 0), (0, 1, 5), (1, 2, 33), (1, 0, 63)]:
        e, n, k = idx
        byte = int(packed[e, n, k // 2])
        code = (byte >> 4) if k % 2 else (byte & 0xF)
        expected = _e2m1_scalar(code) * 2.0 ** (int(scales[e, n, k // 32]) - 127)
        assert float(back[idx]) == expected


def test_mxfp4_round_trip_picks_the_nearest_representable_value() -> None:
    w = torch.randn(1, 8, 96, generator=_gen(6))
    packed, scales = quantize_mxfp4(w)
    back = dequantize_weight(packed, scales, QuantConfig(QuantScheme.MXFP4))
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    # brute force: the closest grid point (saturating at +-6 steps)
    target = (w / step).clamp(-6, 6)
    nearest = grid[(target[..., None] - grid).abs().argmin(-1)]
    assert torch.allclose((back / step).abs(), nearest.abs())
    # the block maximum is representable without saturation beyond 6 * step
    assert torch.all(w.abs().unflatten(-1, (3, 32)).amax(-1) < 8 * torch.exp2(scales.float() - 127))


@pytest.mark.parametrize("how", list(ActQuant))
def test_activation_round_trip_is_within_fp8_precision(how: ActQuant) -> None:
    x = torch.randn(7, 300, generator=_gen(7)) * 5
    q, scale = quantize_activation(x, how)
    expected_shape = {ActQuant.TENSOR: (1,), ActQuant.TOKEN: (7, 1), ActQuant.GROUP: (7, 3)}[how]
    assert scale.shape == expected_shape
    back = dequantize_activation(q, scale, how)
    assert float(((x - back).abs() / x.abs().clamp_min(1e-3)).median()) < FP8_REL
    assert torch.all((x - back).abs() <= x.abs() * FP8_REL + scale.max() * 2.0**-9)
