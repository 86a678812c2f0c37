"""`triton-or-deep-gemm`: DeepGEMM for token counts where it was measured faster, our Triton
experts below that (decode), per call.

The threshold comes from this GPU's rule table (kernels/selection.py, written by the timing
test): the smallest measured token count from which deep-gemm beat triton at every larger one;
where deep-gemm never won, every call runs Triton. Without a triton-vs-deep-gemm measurement
every call runs DeepGEMM (vLLM's TritonOrDeepGemm rule: DeepGEMM wherever its shapes apply).
When the Triton experts cannot run the layer (no triton here), the exact reference stands in.
`last_ran` says which ran the latest call.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import ClassVar

import torch

from ..config import MoEConfig
from ..quant_scheme import QuantScheme
from ..stages import Experts, SumTarget, Support, weighted_topk_sum
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace
from .deep_gemm import (
    DeepGemmExperts,
    check_block_shape,
    deep_gemm_glue_environment,
)
from .reference import ReferenceExperts, dequantize_input
from .triton import TritonExperts

logger = logging.getLogger(__name__)

SMALL_BATCH_BACKENDS = (TritonExperts, ReferenceExperts)  # the first that supports the layer


class TritonOrDeepGemmExperts(Experts):
    name: ClassVar[str] = "triton-or-deep-gemm"
    format: ClassVar[Format] = Format.STANDARD
    schemes: ClassVar[frozenset[QuantScheme]] = DeepGemmExperts.schemes
    reduces_topk: ClassVar[bool] = True

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights) -> None:
        super().__init__(cfg, weights)
        device = weights.w13.device
        self.deep_gemm = DeepGemmExperts(cfg, weights)
        # here, not at the top: kernels.selection imports the registry, which lists this class
        from ..selection import deep_gemm_min_tokens

        small = next(cls for cls in SMALL_BATCH_BACKENDS if cls.supports(cfg, device))
        self.small = small(cfg, weights)
        # the choice by token count is made on the host: capturable when both sides are
        self.graph_capturable = self.small.graph_capturable and self.deep_gemm.graph_capturable
        self.min_tokens, source = deep_gemm_min_tokens(cfg, device)
        self.last_ran = ""
        logger.info(
            "triton-or-deep-gemm: deep-gemm from %s tokens (%s), else %s",
            self.min_tokens,
            source,
            small.name,
        )

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        return deep_gemm_glue_environment(device)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        return check_block_shape(cfg)

    def uses_deep_gemm(self, num_tokens: int) -> bool:
        return self.min_tokens is not None and num_tokens >= self.min_tokens

    def by_tokens(self) -> tuple[tuple[int, str], ...]:
        if self.min_tokens is None:
            return ((1, self.small.name),)
        if self.min_tokens <= 1:
            return ((1, self.deep_gemm.name),)
        return ((1, self.small.name), (self.min_tokens, self.deep_gemm.name))

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = self.small.workspace_shapes(num_tokens)  # smaller calls of a chunk run it
        if self.uses_deep_gemm(num_tokens):
            shapes |= self.deep_gemm.workspace_shapes(num_tokens)
        return shapes

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        experts = self.deep_gemm if self.uses_deep_gemm(x.num_tokens) else self.small
        self.last_ran = experts.name
        if not experts.takes_quantized_input:
            x = replace(
                x, hidden=dequantize_input(x).to(self.cfg.dtype), scale=None, act_quant=None
            )
        if experts.reduces_topk:
            return experts.apply(x, ws, into)
        out = weighted_topk_sum(experts.apply(x, ws), x.topk_ids, x.topk_weights)
        return out if into is None else into.write(out)
