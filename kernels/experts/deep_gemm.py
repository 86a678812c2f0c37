"""DeepGEMM experts for fp8-block layers (DeepSeek-V3): FP8 e4m3 weights with 128x128 block
scales times FP8 activations with 1x128 group scales, through DeepGEMM's m-grouped GEMMs.

- `deep-gemm` (standard format, prefill): the (token, expert) pairs are sorted by expert into
  DeepGEMM's *contiguous* layout, each expert's run padded to its M alignment and the padding
  rows marked -1 in `m_indices`; after GEMM2 the pairs are weighed and summed per token.
- `deep-gemm-batched` (batched format, decode): the *masked* GEMM over [E, max_m, K], computing
  only the first tokens_per_expert[e] rows of each expert.

Both: GEMM1 -> (+ bias) activation (torch, any kind) -> fp8 1x128 quantisation
(kernels.quantize, the same rounding as the reference) -> GEMM2 (+ bias). DeepGEMM writes
bf16; SM90 takes the float32 block scales as stored, so the weights need no transform beyond
being dense (done once, at build). `deep_gemm_fp4.py` reuses all of this with other GEMMs.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from kernels.activations import apply_activation
from kernels.arith import ceil_div, round_up
from kernels.config import MoEConfig
from kernels.quant_scheme import FP8, FP8_BLOCK, ActQuant, QuantScheme
from kernels.quantize import quantize_activation
from kernels.stages import YES, Experts, Support, cuda_capability
from kernels.tensors import Dispatched, ExpertWeights, Format
from kernels.workspace import Workspace

MASKED_M_ALIGNMENT = 128  # the masked kernel's largest BLOCK_M: no block may cross two experts


@functools.cache
def import_deep_gemm() -> ModuleType | str:
    """The `deep_gemm` module, or why it cannot be loaded (missing, or its extension fails)."""
    try:
        return importlib.import_module("deep_gemm")
    except Exception as err:  # its import builds/loads a CUDA extension: any failure is a reason
        return f"deep_gemm not importable: {type(err).__name__}: {err}"


def deep_gemm_environment(device: torch.device, major: int = 9) -> Support:
    """The package first (so a CPU machine names what is missing), then the GPU generation."""
    module = import_deep_gemm()
    if isinstance(module, str):
        return Support(False, module)
    cap = cuda_capability(device)
    if cap is None:
        return Support(False, "needs a CUDA GPU")
    if cap[0] != major:
        arch = {9: "SM90 (Hopper)", 10: "SM100 (Blackwell)"}[major]
        return Support(False, f"requires {arch}; this GPU is sm_{cap[0]}{cap[1]}")
    return YES


def check_block_shape(cfg: MoEConfig) -> Support:
    """DeepGEMM's N and K must be whole 128-blocks: H and I multiples of 128."""
    for name in ("hidden_size", "intermediate_size"):
        if getattr(cfg, name) % FP8_BLOCK:
            return Support(False, f"{name}={getattr(cfg, name)} is not a multiple of {FP8_BLOCK}")
    return YES


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


@dataclass(frozen=True)
class MaskedRows:
    counts: torch.Tensor  # [E] int32 on the GPU: valid rows of each expert
    expected_m: int  # the mean rows per expert: DeepGEMM's hint for its tile choice


def _put_rows(dst: torch.Tensor, rows: torch.Tensor | tuple, src: torch.Tensor) -> None:
    # index_put has no fp8 kernel; move the bytes instead
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst[rows] = src


def _plus_bias(h: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor:
    """h [R, N] (any float) -> float32 h + bias[experts[r]]; rows of expert -1 take expert 0's."""
    h = h.float()
    return h if bias is None else h + bias[experts.clamp(min=0).long()].float()


class _DeepGemmBase(Experts):
    """Weights kept in DeepGEMM's layout; GEMM1 -> (+bias) activation -> quantise -> GEMM2."""

    schemes: ClassVar[frozenset[QuantScheme]] = frozenset({QuantScheme.FP8_BLOCK})

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights) -> None:
        super().__init__(cfg, self.prepare_weights(weights))
        self.dg = import_deep_gemm()

    @staticmethod
    def prepare_weights(weights: ExpertWeights) -> ExpertWeights:
        """Once, at build: DeepGEMM reads the fp8 weights and their [E, N/128, K/128] float32
        scales as dense K-major tensors (SM90 takes those scales as stored)."""
        return ExpertWeights(
            weights.w13.contiguous(),
            weights.w2.contiguous(),
            weights.w13_scale.float().contiguous(),
            weights.w2_scale.float().contiguous(),
            weights.w13_bias,
            weights.w2_bias,
        )

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        return deep_gemm_environment(device)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        return check_block_shape(cfg)

    def quantize(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, K] float -> (fp8 [R, K], float32 [R, K/128]), rounded as the reference does."""
        return quantize_activation(h, ActQuant.GROUP)

    def activate(self, h13: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """GEMM1's bf16 [R, 2I] (rows of `experts` [R]) -> quantised activation [R, I]."""
        h = _plus_bias(h13, self.weights.w13_bias, experts)
        return self.quantize(apply_activation(h, self.cfg.activation))

    def grouped_gemm(self, a: tuple, w: tuple, out: torch.Tensor, m_indices: torch.Tensor) -> None:
        self.dg.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_indices)

    def masked_gemm(self, a: tuple, w: tuple, out: torch.Tensor, masked: MaskedRows) -> None:
        self.dg.m_grouped_fp8_gemm_nt_masked(a, w, out, masked.counts, masked.expected_m)

    def quantized_input(self, x: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        """The dispatched activations as (fp8 [.., H], float32 scales [.., H/128])."""
        return x.hidden, x.scale

    def w13(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.w13, self.weights.w13_scale

    def w2(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.w2, self.weights.w2_scale


class DeepGemmExperts(_DeepGemmBase):
    """Standard format through the contiguous m-grouped GEMM (prefill-sized batches)."""

    name: ClassVar[str] = "deep-gemm"
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
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


class DeepGemmBatchedExperts(_DeepGemmBase):
    """Batched format through the masked m-grouped GEMM (decode, CUDA-graph friendly)."""

    name: ClassVar[str] = "deep-gemm-batched"
    format: ClassVar[Format] = Format.BATCHED

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
        num_experts, max_tokens, hidden = x.hidden.shape
        # a BLOCK_M tile must not reach into the next expert's rows (a 2D TMA over E * max_m)
        max_m = round_up(max_tokens, MASKED_M_ALIGNMENT)
        x_q, x_scale = self.quantized_input(x)
        a = ws.get("dg_masked_a", (num_experts, max_m, hidden), FP8)
        a_scale = ws.get(
            "dg_masked_a_scale", (num_experts, max_m, x_scale.shape[-1]), torch.float32
        )
        a.view(torch.uint8)[:, :max_tokens] = x_q.view(torch.uint8)
        a_scale[:, :max_tokens] = x_scale
        masked = MaskedRows(
            x.tokens_per_expert.to(torch.int32).contiguous(),
            max(1, ceil_div(x.topk_ids.numel(), num_experts)),
        )
        inter = self.cfg.intermediate_size
        h13 = ws.get("dg_masked_h13", (num_experts, max_m, 2 * inter), torch.bfloat16)
        self.masked_gemm((a, a_scale), self.w13(), h13, masked)
        # only the valid rows go through the torch activation: at decode they are a few of E * 128
        experts, slots = torch.nonzero(x.source >= 0, as_tuple=True)  # [P] each
        q = ws.get("dg_masked_q", (num_experts, max_m, inter), FP8)
        q_scale = ws.get(
            "dg_masked_q_scale", (num_experts, max_m, ceil_div(inter, FP8_BLOCK)), torch.float32
        )
        q_rows, q_row_scales = self.activate(h13[experts, slots], experts)
        _put_rows(q, (experts, slots), q_rows)
        q_scale[experts, slots] = q_row_scales
        y = ws.get("dg_masked_y", (num_experts, max_m, hidden), torch.bfloat16)
        self.masked_gemm((q, q_scale), self.w2(), y, masked)
        out = torch.empty(num_experts, max_tokens, hidden, dtype=torch.float32, device=y.device)
        out[experts, slots] = _plus_bias(y[experts, slots], self.weights.w2_bias, experts)
        return out
