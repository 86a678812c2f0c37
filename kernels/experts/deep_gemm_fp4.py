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
It keeps the m_indices contiguous layout (one host sync for the padded row count) and the
torch activation: DeepGEMM's psum layout packs SFA differently on SM100, untried here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..activations import apply_activation
from ..arith import ceil_div, round_up
from ..config import MoEConfig
from ..quant_scheme import FP8, FP8_BLOCK, MXFP4_GROUP, QuantScheme
from ..quantize import FP8_MAX
from ..stages import YES, SumTarget, Support
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace
from .deep_gemm import DeepGemmBase, deep_gemm_environment

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


@dataclass(frozen=True)
class ContiguousLayout:
    """Where each routed pair sits in DeepGEMM's contiguous layout.

    Expert e's rows start at a multiple of the alignment; rows past its count are padding.
    """

    m_indices: torch.Tensor  # [m_pad] int32: expert of each row, -1 for padding
    rows: torch.Tensor  # [P] int64: the row of each valid pair
    pairs: torch.Tensor  # [P] int64: flat (token * k + slot) index of each valid pair

    @property
    def num_rows(self) -> int:
        return self.m_indices.shape[0]


def contiguous_layout(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> ContiguousLayout:
    """topk_ids [M, k] local ids (-1 = not here) -> the contiguous layout; one host sync (m_pad)."""
    flat = topk_ids.flatten().long()  # [M * k]
    key = torch.where(flat >= 0, flat, num_experts)  # pairs for other ranks sort last
    experts, pairs = torch.sort(key, stable=True)  # grouped by expert, token order inside each
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts = counts.index_add_(0, key, torch.ones_like(key))[:num_experts]  # [E]
    padded = (counts + alignment - 1) // alignment * alignment
    m_pad, num_pairs = torch.stack((padded.sum(), counts.sum())).tolist()
    experts, pairs = experts[:num_pairs], pairs[:num_pairs]
    seg_start = padded.cumsum(0) - padded  # [E]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    rows = seg_start[experts] + rank
    m_indices = torch.full((m_pad,), -1, dtype=torch.int32, device=flat.device)
    m_indices[rows] = experts.to(torch.int32)
    return ContiguousLayout(m_indices, rows, pairs)


def _put_rows(dst: torch.Tensor, rows: torch.Tensor | tuple, src: torch.Tensor) -> None:
    # index_put has no fp8 kernel; move the bytes instead
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst[rows] = src


def _plus_bias(h: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor:
    """h [R, N] (any float) -> float32 h + bias[experts[r]]; rows of expert -1 take expert 0's."""
    h = h.float()
    return h if bias is None else h + bias[experts.clamp(min=0).long()].float()


class DeepGemmFp4Experts(DeepGemmBase):
    name: ClassVar[str] = "deep-gemm-fp4"
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True
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

    def activate(self, h13: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """GEMM1's bf16 [R, 2I] (rows of `experts` [R]) -> quantised activation [R, I]."""
        h = _plus_bias(h13, self.weights.w13_bias, experts)
        return quantize_fp8_ue8m0(apply_activation(h, self.cfg.activation))

    def quantized_input(self, x: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_ue8m0(x.hidden)

    def grouped_gemm(self, a: tuple, w: tuple, out: torch.Tensor, m_indices: torch.Tensor) -> None:
        self.dg.m_grouped_fp8_fp4_gemm_nt_contiguous(
            a, w, out, m_indices, recipe_a=ACT_RECIPE, recipe_b=WEIGHT_RECIPE
        )

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        out = self._sum(x, ws)
        return out if into is None else into.write(out)

    def _sum(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
        """The weighted top-k sum, float32 [M, H]."""
        m, k = x.topk_ids.shape
        hidden = self.cfg.hidden_size
        out = torch.zeros(m, hidden, dtype=torch.float32, device=x.hidden.device)
        layout = contiguous_layout(
            x.topk_ids, self.weights.num_experts, self.dg.get_mk_alignment_for_contiguous_layout()
        )
        if layout.pairs.numel() == 0:
            return out
        rows, tokens = layout.rows, layout.pairs // k
        m_pad, m_indices = layout.num_rows, layout.m_indices
        x_q, x_scale = self.quantized_input(x)
        # padding rows keep whatever the buffers held: each output row depends on its own input
        # row only, and padding rows are never read back
        a = ws.get("dg_a", (m_pad, hidden), FP8)  # [m_pad, H]
        a_scale = ws.get("dg_a_scale", (m_pad, x_scale.shape[1]), torch.float32)
        _put_rows(a, rows, x_q[tokens])
        a_scale[rows] = x_scale[tokens]
        h13 = ws.get("dg_h13", (m_pad, 2 * self.cfg.intermediate_size), torch.bfloat16)
        self.grouped_gemm((a, a_scale), self.w13(), h13, m_indices)
        y = ws.get("dg_y", (m_pad, hidden), torch.bfloat16)  # [m_pad, H]
        self.grouped_gemm(self.activate(h13, m_indices), self.w2(), y, m_indices)
        y_pairs = _plus_bias(y[rows], self.weights.w2_bias, m_indices[rows])  # [P, H]
        weights = x.topk_weights.flatten()[layout.pairs].float()
        out.index_add_(0, tokens, y_pairs * weights[:, None])
        return out
