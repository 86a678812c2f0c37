"""Experts that switch by token count: one experts stage holding backends and running, per call,
the one its plan names for that many tokens: the step with the largest count at or below the
call's. Its plan is data that kernels/selection.py hands in, from the rule table:

- auto's pairs, `TokenSwitchExperts.over(plan)`: the plan made from the served timings, one
  backend below a measured count and another from it; named `a<64<=b`.
- `triton-or-deep-gemm`, a registered backend: DeepGEMM from the token count where it was
  measured faster than our Triton experts, those below it (decode). Selection binds the count
  (`TritonOrDeepGemmExperts.at`): the smallest measured token count from which deep-gemm beat
  triton at every larger one; where deep-gemm never won, every call runs Triton. Without a
  triton-vs-deep-gemm measurement every call runs DeepGEMM (vLLM's TritonOrDeepGemm rule:
  DeepGEMM wherever its shapes apply). When the Triton experts cannot run the layer (no triton
  here), the exact reference stands in.

Members are built on the layer's weights; a member that converts them at build keeps its own
copy as it does alone (oai-triton's swizzled layout, deep-gemm's float32 scales), so a switch
holds the weight memory of its larger member. The input reaches each member as the member takes
it: quantised to fp8 where the switch's input is not, back to 16 bits where a member takes it so
and the switch's input is fp8 (triton-or-deep-gemm's, as deep-gemm takes it); a member that
leaves the top-k sum to finalize is reduced here, so the switch always returns [M, K]. The choice
is made on the host from the call's shape, so a whole-layer CUDA graph captured at a bucket
replays the member of the bucket's token count; the switch is capturable when its members are.
`last_ran` says which member ran the latest call.
"""

from __future__ import annotations

import functools
import logging
from bisect import bisect_right
from dataclasses import replace
from itertools import pairwise
from typing import ClassVar

import torch

from ..config import MoEConfig
from ..prepare_finalize.no_ep import quantize_input
from ..quant_scheme import ActQuant, QuantScheme
from ..stages import Experts, SumTarget, Support, weighted_topk_sum
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace
from .deep_gemm import DeepGemmExperts, check_block_shape, deep_gemm_glue_environment
from .reference import ReferenceExperts, dequantize_input
from .triton import TritonExperts

logger = logging.getLogger(__name__)

Plan = tuple[tuple[int, type[Experts]], ...]  # (from this many tokens, run this), ascending


class TokenSwitchExperts(Experts):
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True
    plan: ClassVar[Plan] = ()

    @classmethod
    def over(cls, plan: Plan) -> type[TokenSwitchExperts]:
        """The switch for `plan`, as a class `selection.select` hands out like any backend; its
        name reads `a<64<=b`: a below 64 tokens, b from 64 on."""
        bounds = [m for m, _ in plan]
        members = list(dict.fromkeys(member for _, member in plan))
        if len(plan) < 2 or bounds[0] != 1 or bounds != sorted(set(bounds)):
            raise ValueError(f"a token switch takes two or more steps from 1 token up: {bounds}")
        if any(a is b for (_, a), (_, b) in pairwise(plan)):
            raise ValueError("two steps in a row of a token switch run the same backend")
        if any(m.format != Format.STANDARD for m in members):
            raise ValueError("a token switch takes standard-format members")
        name = plan[0][1].name + "".join(f"<{m}<={member.name}" for m, member in plan[1:])

        def common(attr: str) -> frozenset:
            return functools.reduce(frozenset.__and__, (getattr(m, attr) for m in members))

        return type(
            "TokenSwitch",
            (cls,),
            {
                "name": name,
                "plan": plan,
                "schemes": common("schemes"),
                "activations": common("activations"),
                "devices": common("devices"),
                "supports_expert_map": all(m.supports_expert_map for m in members),
                "supports_chunking": all(m.supports_chunking for m in members),
                # fp8 input only if every member takes it; the others are quantised per call
                "takes_quantized_input": all(m.takes_quantized_input for m in members),
            },
        )

    def __init__(
        self, cfg: MoEConfig, weights: ExpertWeights, batch_invariant: bool = False
    ) -> None:
        if batch_invariant:
            raise ValueError("a token switch is not batch-invariant: its members round apart")
        if not self.plan:
            raise ValueError(f"{self.name} switches by a plan that kernels.selection.select binds")
        super().__init__(cfg, weights)
        self.bounds = [m for m, _ in self.plan]
        self.steps = [member.name for _, member in self.plan]
        self.members = {member.name: member(cfg, weights) for _, member in self.plan}
        # the choice by token count is made on the host: capturable when every member is
        self.graph_capturable = all(m.graph_capturable for m in self.members.values())
        self.last_ran = ""

    def by_tokens(self) -> tuple[tuple[int, str], ...]:
        return tuple(zip(self.bounds, self.steps, strict=True))

    def member(self, num_tokens: int) -> Experts:
        """The member that runs a call of `num_tokens` tokens (below the first step: the first)."""
        return self.members[self.steps[max(bisect_right(self.bounds, num_tokens) - 1, 0)]]

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each step's member at the largest call of at most `num_tokens` it runs (ascending, so
        a member of two steps ends with its larger buffers)."""
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        ends = [*self.bounds[1:], num_tokens + 1]
        for start, end, name in zip(self.bounds, ends, self.steps, strict=True):
            if start <= num_tokens:
                shapes |= self.members[name].workspace_shapes(min(num_tokens, end - 1))
        return shapes

    def taken_by(self, x: Dispatched, wanted: ActQuant | None) -> Dispatched:
        """`x` as a member whose input is quantised as `wanted` takes it."""
        if wanted is None:  # fp8 in, a member that takes 16 bits: the reference's dequantiser
            hidden = dequantize_input(x).to(self.cfg.dtype)
            return replace(x, hidden=hidden, scale=None, act_quant=None)
        # 16 bits in, a member that wants fp8: the prepare's quantiser, one Triton pass on a GPU;
        # torch's ten or so kernels made a prefill forward of a triton/deep-gemm switch slower
        # than deep-gemm alone (`moe-serve bench kernels` on deepseek-v3)
        hidden, scale = quantize_input(x.hidden, wanted)
        return replace(x, hidden=hidden, scale=scale, act_quant=wanted)

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        member = self.member(x.num_tokens)
        self.last_ran = member.name
        wanted = member.act_quant()
        if x.act_quant != wanted:
            x = self.taken_by(x, wanted)
        if member.reduces_topk:
            return member.apply(x, ws, into)
        out = weighted_topk_sum(member.apply(x, ws), x.topk_ids, x.topk_weights)
        return out if into is None else into.write(out)


SMALL_BATCH_BACKENDS = (TritonExperts, ReferenceExperts)  # the first that supports the layer


class TritonOrDeepGemmExperts(TokenSwitchExperts):
    """`triton-or-deep-gemm`: registered unbound; `at` binds the count where deep-gemm starts."""

    name: ClassVar[str] = "triton-or-deep-gemm"
    schemes: ClassVar[frozenset[QuantScheme]] = DeepGemmExperts.schemes
    source: ClassVar[str] = ""  # where the count comes from, for the log

    @classmethod
    def environment(cls, device: torch.device) -> Support:
        return deep_gemm_glue_environment(device)

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> Support:
        return check_block_shape(cfg)

    @classmethod
    def at(
        cls, cfg: MoEConfig, device: torch.device, min_tokens: int | None, source: str
    ) -> type[TritonOrDeepGemmExperts]:
        """This backend for `cfg` on `device`, running deep-gemm from `min_tokens` tokens on
        (None: never; 0 or 1: at every size) and below it the first of SMALL_BATCH_BACKENDS
        that supports the layer; `source` says where the count comes from."""
        small = next(c for c in SMALL_BATCH_BACKENDS if c.supports(cfg, device))
        if min_tokens is None:
            plan: Plan = ((1, small),)
        elif min_tokens <= 1:
            plan = ((1, DeepGemmExperts),)
        else:
            plan = ((1, small), (min_tokens, DeepGemmExperts))
        return type("TritonOrDeepGemm", (cls,), {"plan": plan, "source": source})

    def __init__(
        self, cfg: MoEConfig, weights: ExpertWeights, batch_invariant: bool = False
    ) -> None:
        super().__init__(cfg, weights, batch_invariant)
        steps = ", ".join(f"{name} from {m} tokens" for m, name in self.by_tokens())
        logger.info("triton-or-deep-gemm: %s (%s)", steps, self.source)
