"""DeepGEMM FP4 experts (`deep-gemm-fp4`): FP8 activations x MXFP4 weights through DeepGEMM's
`m_grouped_fp8_fp4_gemm_nt_contiguous`, a kernel for SM100 (Blackwell) only.

On SM100 DeepGEMM takes every scale as a UE8M0 exponent (a power of two), four packed into one
int32 along K (the first group in the lowest byte), MN-major and TMA-aligned. Hence:
- weights: our e2m1 nibbles (even element in the low nibble) are DeepGEMM's packed FP4 as they
  are (an int8 view); our e8m0 scales [E, N, K/32] are already UE8M0 and are packed once, at
  build, by `pack_ue8m0_mn_major` (pure torch);
- activations: FP8 e4m3 with a power-of-two scale per 1x128 group (`quantize_fp8_ue8m0`).
  The mxfp4 reference keeps activations 16-bit, so this backend differs from it by one fp8
  rounding of each GEMM input (a few percent relative error, see the tests).
Everything else (contiguous layout, bias, activation, weight-and-reduce) is `deep-gemm`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kernels.arith import ceil_div, round_up
from kernels.config import MoEConfig
from kernels.experts.deep_gemm import DeepGemmExperts, deep_gemm_environment
from kernels.quant_scheme import FP8, FP8_BLOCK, MXFP4_GROUP, QuantScheme
from kernels.quantize import FP8_MAX
from kernels.stages import YES, Support
from kernels.tensors import Dispatched, ExpertWeights

UE8M0_PER_INT32 = 4
TMA_ALIGN_BYTES = 16  # TMA wants the MN stride of a scale tensor in whole 16-byte units
ACT_RECIPE = (1, FP8_BLOCK)  # one activation scale per row and 128 columns
WEIGHT_RECIPE = (1, MXFP4_GROUP)  # one weight scale per row and 32 columns


def pack_ue8m0_mn_major(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents [E, MN, G] -> int32 [E, MN, ceil(G/4)], MN-major (stride 1 along MN),
    MN padded to the TMA alignment in memory. Padding groups get exponent 127 (scale 1.0)."""
    num, mn, groups = exponents.shape
    packed_groups = ceil_div(groups, UE8M0_PER_INT32)
    padded = torch.full(
        (num, mn, packed_groups * UE8M0_PER_INT32), 127, dtype=torch.uint8, device=exponents.device
    )
    padded[..., :groups] = exponents
    packed = padded.view(torch.int32)  # [E, MN, G/4]: little-endian, group 4j in the low byte
    mn_aligned = round_up(mn, TMA_ALIGN_BYTES // 4)
    storage = torch.zeros(num, packed_groups, mn_aligned, dtype=torch.int32, device=packed.device)
    storage[:, :, :mn] = packed.transpose(1, 2)
    return storage.transpose(1, 2)[:, :mn]


def quantize_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] -> (fp8 [R, K], float32 power-of-two scales [R, ceil(K/128)]).

    Each scale is the smallest power of two that keeps its group within the fp8 range."""
    rows, k = x.shape
    groups = ceil_div(k, FP8_BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, groups * FP8_BLOCK - k)).view(rows, groups, -1)
    amax = padded.abs().amax(dim=-1).clamp_min(2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # [R, G]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, -1)[:, :k], scale


class DeepGemmFp4Experts(DeepGemmExperts):
    name: ClassVar[str] = "deep-gemm-fp4"
    schemes: ClassVar[frozenset[QuantScheme]] = frozenset({QuantScheme.MXFP4})
    takes_quantized_input: ClassVar[bool] = False  # quantised here, with UE8M0 scales

    @staticmethod
    def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
        """Once, at build: int8 view of the e2m1 pairs, packed MN-major UE8M0 scales."""
        return ExpertWeights(
            weights.w13.contiguous().view(torch.int8),  # [E, 2I, H/2]
            weights.w2.contiguous().view(torch.int8),  # [E, H, I/2]
            pack_ue8m0_mn_major(weights.w13_scale),  # [E, 2I, ceil(H/128)] int32
            pack_ue8m0_mn_major(weights.w2_scale),  # [E, H, ceil(I/128)] int32
            weights.w13_bias,
            weights.w2_bias,
        )

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        return deep_gemm_environment(device, major=10)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:  # noqa: ARG003
        return YES  # K multiples of 32 are guaranteed by the mxfp4 scheme itself

    def quantize(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_ue8m0(h)

    def quantized_input(self, x: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_ue8m0(x.hidden)

    def grouped_gemm(self, a: tuple, w: tuple, out: torch.Tensor, m_indices: torch.Tensor) -> None:
        self.dg.m_grouped_fp8_fp4_gemm_nt_contiguous(
            a, w, out, m_indices, recipe_a=ACT_RECIPE, recipe_b=WEIGHT_RECIPE
        )
