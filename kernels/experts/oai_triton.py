"""OpenAI `triton_kernels` experts: `matmul_ogs` (gather -> grouped matmul -> scatter) for bf16
and MXFP4 weights, the gpt-oss path.

    for e in experts:  Y[rows of e] (+)= X[tokens of e] @ W[e] + b[e]     (matmul_ogs, per GEMM)

- `oai-triton`: GEMM1 gathers the token rows by expert and fuses swigluoai into its epilogue;
  GEMM2 weighs each row by its router weight and scatter-sums the k rows of each token.
- `oai-triton-unfused`: the same GEMMs with the activation as a separate torch step (any kind).

matmul_ogs takes W as [E, K, N] and, for MXFP4, its own swizzled layouts; both are made once at
build from our [E, N, K] tensors (a transposed view for bf16). Its fused swiglu reads gate and up
interleaved, so split layers are interleaved at build too (`interleave_gate_up`).

triton_kernels is not on the package index (it ships in the vllm wheel's third_party folder):
without it these backends stay registered and say so.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from ..activations import apply_activation
from ..config import Activation, GateUp, MoEConfig
from ..quant_scheme import QuantScheme
from ..stages import YES, Experts, SumTarget, Support, cuda_capability
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace

HOPPER_MX_NUM_WARPS = 8  # the MXFP4 scale swizzle is laid out for the warps its kernel runs


@functools.cache
def import_triton_kernels() -> ModuleType | str:
    """The `triton_kernels` package, or why it cannot be loaded."""
    try:
        for sub in ("matmul_ogs", "routing", "swiglu", "tensor", "tensor_details.layout"):
            importlib.import_module(f"triton_kernels.{sub}")
        return importlib.import_module("triton_kernels")
    except Exception as err:  # a broken triton install fails in many ways: each is a reason
        return f"triton_kernels not importable: {type(err).__name__}: {err}"


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate rows then up rows -> row 2i = gate i, row 2i + 1 = up i."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


@dataclass(frozen=True)
class OgsRouting:
    """triton_kernels' routing objects for one call."""

    data: Any  # RoutingData
    gather: Any  # GatherIndx
    scatter: Any  # ScatterIndx


def ogs_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> OgsRouting:
    from triton_kernels.routing import GatherIndx, RoutingData, ScatterIndx, compute_expt_data

    from ._triton.sort_pairs import sort_pairs

    m, k = topk_ids.shape
    idx = sort_pairs(topk_ids, topk_weights, num_experts)
    expt_data = compute_expt_data(idx.tokens_per_expert, num_experts, m * k)
    data = RoutingData(idx.row_weights, idx.tokens_per_expert, num_experts, k, expt_data)
    return OgsRouting(
        data,
        GatherIndx(src_indx=idx.sorted_pairs, dst_indx=idx.row_of_pair),
        ScatterIndx(src_indx=idx.row_of_pair, dst_indx=idx.sorted_pairs),
    )


@dataclass(frozen=True)
class OgsWeight:
    """One GEMM's weight as matmul_ogs takes it."""

    w: Any  # [E, K, N]: a torch view (bf16) or a triton_kernels Tensor (MXFP4, swizzled)
    bias: torch.Tensor | None  # [E, N] float32
    precision: Any  # PrecisionConfig


def _ogs_weight(
    w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> OgsWeight:
    """Our [E, N, K] (mxfp4: [E, N, K/2] + scales [E, N, K/32]) -> matmul_ogs' [E, K, N]."""
    from triton_kernels.matmul_ogs import PrecisionConfig
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    bias = None if bias is None else bias.float().contiguous()
    if scale is None:
        return OgsWeight(w.transpose(1, 2), bias, PrecisionConfig())
    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(
        mx_axis=1, num_warps=HOPPER_MX_NUM_WARPS
    )
    # the packed K axis becomes dim 1, as the layouts expect ([E, K/2, N] with stride 1 on K)
    values = convert_layout(
        wrap_torch_tensor(w.transpose(1, 2), dtype=FP4), value_layout, **value_opts
    )
    scales = convert_layout(wrap_torch_tensor(scale.transpose(1, 2)), scale_layout, **scale_opts)
    scales.storage.data = _zero_tailed(scales.storage.data)
    return OgsWeight(values, bias, PrecisionConfig(weight_scale=scales))


def _zero_tailed(data: torch.Tensor) -> torch.Tensor:
    """`data` (a view of one buffer) moved into a new buffer with zeroed bytes after it.

    On Hopper, matmul_ogs loads the swizzled MXFP4 scales of a K tail unmasked (triton-lang/triton
    #10772; fixed upstream after our version): the values it multiplies there are masked to zero,
    but the last expert's last rows read past the scale buffer. Whatever the allocator left there
    came in as scales, and an 0xff byte is E8M0 NaN: 0 * NaN made whole output rows NaN, now and
    then (gpt-oss scaled down, K = 320; the rows routed to the last expert). Zeros (2^-127) read
    there give 0.
    """
    sizes_strides = zip(data.shape, data.stride(), strict=True)
    extent = 1 + sum((size - 1) * stride for size, stride in sizes_strides)
    tail = max(1 << 16, extent // data.shape[0])  # far more than one K block of one row
    buffer = torch.zeros(extent + tail, dtype=data.dtype, device=data.device)
    moved = buffer.as_strided(data.shape, data.stride())
    moved.copy_(data)
    return moved


def oai_environment(device: torch.device) -> Support:
    module = import_triton_kernels()
    if isinstance(module, str):
        return Support(False, module)
    cap = cuda_capability(device)
    if cap is None:
        return Support(False, "needs a CUDA GPU")
    if not (9, 0) <= cap < (11, 0):
        return Support(
            False, f"matmul_ogs runs on sm_90 and sm_100; this GPU is sm_{cap[0]}{cap[1]}"
        )
    return YES


class _OaiBase(Experts):
    format: ClassVar[Format] = Format.STANDARD
    schemes: ClassVar[frozenset[QuantScheme]] = frozenset({QuantScheme.NONE, QuantScheme.MXFP4})
    supports_expert_map: ClassVar[bool] = False  # matmul_ogs' scatter has no "skip this pair"
    reduces_topk: ClassVar[bool] = True
    takes_quantized_input: ClassVar[bool] = False
    graph_capturable: ClassVar[bool] = True  # routing by index_add, matmul_ogs: no host sync
    fuses_activation: ClassVar[bool]

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights) -> None:
        super().__init__(cfg, weights)
        w13, s13, b13 = weights.w13, weights.w13_scale, weights.w13_bias
        if self.fuses_activation and cfg.activation.gate_up == GateUp.SPLIT:
            w13, s13, b13 = (None if t is None else interleave_gate_up(t) for t in (w13, s13, b13))
        self.gemm1 = _ogs_weight(w13, s13, b13)
        self.gemm2 = _ogs_weight(weights.w2, weights.w2_scale, weights.w2_bias)
        if cfg.quant.scheme == QuantScheme.MXFP4 and cuda_capability(w13.device)[0] == 9:
            from triton_kernels.matmul_ogs_details import opt_flags

            # split-k would reduce MXFP4 partial sums outside the swizzled path on Hopper; this
            # constraint is process-wide in triton_kernels (no per-call option exists)
            opt_flags.update_opt_flags_constraints({"split_k": 1})

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        return oai_environment(device)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        if cfg.dtype != torch.bfloat16:
            return Support(False, f"runs bf16 activations, the layer's are {cfg.dtype}")
        return YES

    def _fused_activation(self) -> Any:
        from triton_kernels.matmul_ogs import FnSpecs, FusedActivation
        from triton_kernels.swiglu import swiglu_fn

        spec = self.cfg.activation
        return FusedActivation(
            FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (spec.alpha, spec.limit), 2
        )

    def _experts(
        self, hidden: torch.Tensor, routing: OgsRouting, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [M, H] bf16 -> [M, H]: GEMM1 (gather) -> act -> GEMM2 (weigh, scatter-sum),
        which writes `out` when given."""
        from triton_kernels.matmul_ogs import matmul_ogs

        g1, g2 = self.gemm1, self.gemm2
        fused = self._fused_activation() if self.fuses_activation else None
        h = matmul_ogs(
            hidden,
            g1.w,
            g1.bias,
            routing.data,
            gather_indx=routing.gather,
            precision_config=g1.precision,
            fused_activation=fused,
        )  # [M * k, I] (fused) or [M * k, 2I], rows sorted by expert
        if not self.fuses_activation:
            h = apply_activation(h.float(), self.cfg.activation).to(hidden.dtype)
        return matmul_ogs(
            h,
            g2.w,
            g2.bias,
            routing.data,
            scatter_indx=routing.scatter,
            precision_config=g2.precision,
            gammas=routing.data.gate_scal,
            y=None if out is None else out.unsqueeze(0),  # its output is [1, M, H]
        )

    def apply(
        self,
        x: Dispatched,
        ws: Workspace,  # noqa: ARG002
        into: SumTarget | None = None,
    ) -> torch.Tensor:
        if x.num_tokens == 0:
            out = torch.zeros_like(x.hidden)
        else:
            routing = ogs_routing(x.topk_ids, x.topk_weights, self.weights.num_experts)
            out = self._experts(x.hidden, routing, _summed_in_place(into, x.hidden))
        return out if into is None else into.write(out)  # no copy when GEMM2 wrote into it


def _summed_in_place(into: SumTarget | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """The target GEMM2's scatter-sum can write itself (saving a copy of the output): one plain
    tensor of hidden's shape and dtype, with no shared experts' output to add."""
    if into is None or into.extra is not None or not isinstance(into.out, torch.Tensor):
        return None
    out = into.out
    fits = out.shape == hidden.shape and out.dtype == hidden.dtype and out.is_contiguous()
    return out if fits else None


class OaiTritonExperts(_OaiBase):
    name: ClassVar[str] = "oai-triton"
    activations: ClassVar[frozenset[Activation]] = frozenset({Activation.SWIGLUOAI})
    fuses_activation: ClassVar[bool] = True


class UnfusedOaiTritonExperts(_OaiBase):
    name: ClassVar[str] = "oai-triton-unfused"
    fuses_activation: ClassVar[bool] = False
