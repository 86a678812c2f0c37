"""DeepGEMM experts for fp8-block layers (DeepSeek-V3): FP8 e4m3 weights with 128x128 block
scales times FP8 activations with 1x128 group scales, through DeepGEMM's m-grouped GEMMs.

- `deep-gemm` (standard format, prefill): the (token, expert) pairs take rows of DeepGEMM's
  *contiguous* layout with prefix sums (`_triton/psum_layout.py`: built on the device, buffers
  sized for the worst case, so no host sync and the forward can be captured in a CUDA graph);
  after GEMM2 each token's k rows are weighed and summed (+ bias) in one pass.
- `deep-gemm-batched` (batched format, decode): the *masked* GEMM over [E, max_m, K], computing
  only the first tokens_per_expert[e] rows of each expert; the counts stay on the device and
  max_m follows the batched prepare's host-decided capacity, so it makes no host sync either
  (captured up to kernels.prepare_finalize.batched.SYNC_FREE_TOKENS tokens).

Both: GEMM1 -> one Triton pass (`_triton/act_quant.py`: + bias, activation, fp8 1x128
quantisation rounded as the reference's quantiser, scales written MN-major as DeepGEMM's TMA
reads them) -> GEMM2. DeepGEMM writes bf16; SM90 takes the float32 block scales as stored, so
the weights need no transform beyond being dense (done once, at build). GEMM inputs and outputs
share two workspace buffers (a, then GEMM2's input; GEMM1's output, then GEMM2's).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import ClassVar

import torch

from ..arith import ceil_div, round_up
from ..config import MoEConfig
from ..quant_scheme import FP8, FP8_BLOCK, QuantScheme
from ..stages import HAS_TRITON, NO_TRITON, YES, Experts, SumTarget, Support, cuda_capability
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace

if HAS_TRITON:  # without it the backends stay registered and say why they cannot run
    from ._triton.act_quant import MaskedRows, PairRows, act_quant
    from ._triton.align import aligned_capacity
    from ._triton.psum_layout import (
        PsumLayout,
        gather_rows,
        psum_layout,
        weighted_sum,
    )

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


def deep_gemm_glue_environment(device: torch.device) -> Support:
    """deep_gemm_environment for the experts whose passes between the GEMMs (the psum layout,
    act_quant) are our Triton kernels: those need triton as well."""
    support = deep_gemm_environment(device)
    return NO_TRITON if support and not HAS_TRITON else support


def check_block_shape(cfg: MoEConfig) -> Support:
    """DeepGEMM's N and K must be whole 128-blocks: H and I multiples of 128."""
    for name in ("hidden_size", "intermediate_size"):
        if getattr(cfg, name) % FP8_BLOCK:
            return Support(False, f"{name}={getattr(cfg, name)} is not a multiple of {FP8_BLOCK}")
    return YES


class DeepGemmBase(Experts):
    """Weights kept in DeepGEMM's layout; GEMM1 -> act_quant (one Triton pass) -> GEMM2."""

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
        return deep_gemm_glue_environment(device)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        return check_block_shape(cfg)

    def quantized_input(self, x: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
        """The dispatched activations as (fp8 [.., H], float32 scales [.., H/128])."""
        return x.hidden, x.scale

    def w13(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.w13, self.weights.w13_scale

    def w2(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.w2, self.weights.w2_scale

    def buffer_bytes(self, rows: int) -> dict[str, int]:
        """Bytes of the shared buffers for `rows` GEMM rows: inputs (fp8 a, then GEMM2's),
        their scales, outputs (bf16 GEMM1's, then GEMM2's)."""
        h, i = self.cfg.hidden_size, self.cfg.intermediate_size
        groups = ceil_div(max(h, i), FP8_BLOCK)
        return {"dg_in": rows * max(h, i), "dg_in_scale": rows * groups * 4,
                "dg_out": rows * max(2 * i, h) * 2}  # fmt: skip


def _bytes(ws_shapes: dict[str, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: ((n,), torch.uint8) for name, n in ws_shapes.items()}


class DeepGemmExperts(DeepGemmBase):
    """Standard format through the contiguous m-grouped GEMM with prefix sums, no host sync."""

    name: ClassVar[str] = "deep-gemm"
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True
    graph_capturable: ClassVar[bool] = True

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights) -> None:
        super().__init__(cfg, weights)
        if "use_psum_layout" not in (self.dg.m_grouped_fp8_gemm_nt_contiguous.__doc__ or ""):
            raise ValueError(
                "this DeepGEMM has no psum contiguous layout (use_psum_layout): 2.6 or later"
            )
        self.alignment = self.dg.get_mk_alignment_for_contiguous_layout()

    def capacity(self, num_tokens: int) -> int:
        return aligned_capacity(
            num_tokens * self.cfg.top_k, self.weights.num_experts, self.alignment
        )

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return _bytes(self.buffer_bytes(self.capacity(num_tokens)))

    def grouped_gemm(self, a: tuple, w: tuple, out: torch.Tensor, layout: PsumLayout) -> None:
        # DeepGEMM plans its tiles for this many rows per expert; it reads the real ones from psum
        expected_m = max(1, ceil_div(layout.pair_row.numel(), self.weights.num_experts))
        self.dg.m_grouped_fp8_gemm_nt_contiguous(
            a, w, out, layout.psum, use_psum_layout=True, expected_m_for_psum_layout=expected_m
        )

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        cfg = self.cfg
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        if into is None:
            out = torch.empty(x.num_tokens, hidden, dtype=torch.float32, device=x.hidden.device)
            into = SumTarget(out)
        if x.num_tokens == 0:
            return into.out
        layout = psum_layout(x.topk_ids, self.weights.num_experts, self.alignment)
        rows = layout.capacity
        # a is dead once GEMM1 ran and GEMM1's output once act_quant ran: each buffer serves
        # both GEMMs; rows no pair holds keep whatever they held and are never read back
        a = ws.get("dg_in", (rows, hidden), FP8)
        a_scale = _mn_major(ws, "dg_in_scale", rows, hidden)
        x_q, x_scale = self.quantized_input(x)
        gather_rows(x_q, x_scale, layout, a, a_scale)
        h13 = ws.get("dg_out", (rows, 2 * inter), torch.bfloat16)
        self.grouped_gemm((a, a_scale), self.w13(), h13, layout)
        q = ws.get("dg_in", (rows, inter), FP8)
        q_scale = _mn_major(ws, "dg_in_scale", rows, inter)
        pairs = PairRows(layout.pair_row, x.topk_ids.flatten())
        act_quant(h13, self.weights.w13_bias, cfg.activation, pairs, q, q_scale)
        y = ws.get("dg_out", (rows, hidden), torch.bfloat16)
        self.grouped_gemm((q, q_scale), self.w2(), y, layout)
        return weighted_sum(
            y,
            self.weights.w2_bias,
            layout,
            x.topk_ids,
            x.topk_weights,
            into.out,
            into.ready_extra(),
        )


def _mn_major(ws: Workspace, name: str, rows: int, k: int, batch: int = 0) -> torch.Tensor:
    """A float32 scale view [(batch,) rows, ceil(k/128)] of a workspace buffer, MN-major."""
    groups = ceil_div(k, FP8_BLOCK)
    if batch:
        return ws.get(name, (batch, groups, rows), torch.float32).transpose(1, 2)
    return ws.get(name, (groups, rows), torch.float32).t()


class DeepGemmBatchedExperts(DeepGemmBase):
    """Batched format through the masked m-grouped GEMM (decode), no host sync."""

    name: ClassVar[str] = "deep-gemm-batched"
    format: ClassVar[Format] = Format.BATCHED
    graph_capturable: ClassVar[bool] = True  # counts on the device; shapes from the host's M

    def masked_gemm(self, a: tuple, w: tuple, out: torch.Tensor, counts: torch.Tensor,
                    expected_m: int) -> None:  # fmt: skip
        self.dg.m_grouped_fp8_gemm_nt_masked(a, w, out, counts, expected_m)

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
        num_experts, max_tokens, hidden = x.hidden.shape
        inter = self.cfg.intermediate_size
        # a BLOCK_M tile must not reach into the next expert's rows (a 2D TMA over E * max_m)
        max_m = round_up(max_tokens, MASKED_M_ALIGNMENT)
        x_q, x_scale = self.quantized_input(x)
        a = ws.get("dg_in", (num_experts, max_m, hidden), FP8)
        a_scale = _mn_major(ws, "dg_in_scale", max_m, hidden, batch=num_experts)
        a.view(torch.uint8)[:, :max_tokens] = x_q.view(torch.uint8)
        a_scale[:, :max_tokens] = x_scale
        counts = x.tokens_per_expert.to(torch.int32).contiguous()
        expected_m = max(1, ceil_div(x.topk_ids.numel(), num_experts))  # DeepGEMM's tile hint
        h13 = ws.get("dg_out", (num_experts, max_m, 2 * inter), torch.bfloat16)
        self.masked_gemm((a, a_scale), self.w13(), h13, counts, expected_m)
        q = ws.get("dg_in", (num_experts, max_m, inter), FP8)
        q_scale = _mn_major(ws, "dg_in_scale", max_m, inter, batch=num_experts)
        rows = MaskedRows(counts, max_tokens)
        act_quant(h13, self.weights.w13_bias, self.cfg.activation, rows, q, q_scale)
        y = ws.get("dg_out", (num_experts, max_m, hidden), torch.bfloat16)
        self.masked_gemm((q, q_scale), self.w2(), y, counts, expected_m)
        y = y[:, :max_tokens]  # padding rows unspecified, as the batched format allows
        bias = self.weights.w2_bias
        return y if bias is None else y.float() + bias[:, None, :].float()
