"""Auto's per-token-count switch: one experts stage holding two backends and running, per call,
the one its plan names for that many tokens: the step with the largest count at or below the
call's (kernels/selection.py makes the plan from the rule table's served timings).

Members are built on the layer's weights; a member that converts them at build keeps its own
copy as it does alone (oai-triton's swizzled layout, deep-gemm's float32 scales), so a switch
holds the weight memory of its larger member. A member that wants fp8 input where the other does
not gets it quantised here, and one that leaves the top-k sum to finalize is reduced here, so the
switch always returns [M, K]. The choice is made on the host from the call's shape, so a whole-layer
CUDA graph captured at a bucket replays the member of the bucket's token count; the switch is
capturable when both members are.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import replace
from itertools import pairwise
from typing import ClassVar

import torch

from ..config import MoEConfig
from ..prepare_finalize.no_ep import quantize_input
from ..stages import Experts, SumTarget, weighted_topk_sum
from ..tensors import Dispatched, ExpertWeights, Format
from ..workspace import Workspace

Plan = tuple[tuple[int, type[Experts]], ...]  # (from this many tokens, run this), ascending


class TokenSwitchExperts(Experts):
    format: ClassVar[Format] = Format.STANDARD
    reduces_topk: ClassVar[bool] = True
    plan: ClassVar[Plan]

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

    def apply(self, x: Dispatched, ws: Workspace, into: SumTarget | None = None) -> torch.Tensor:
        member = self.member(x.num_tokens)
        self.last_ran = member.name
        wanted = member.act_quant()
        if x.act_quant != wanted:  # only an unquantised input can reach a member that wants fp8
            # the prepare's quantiser, one Triton pass on a GPU: with torch's ten or so kernels
            # a 4096-token DeepSeek-V3 forward ran 10-12% slower than deep-gemm alone (H200)
            hidden, scale = quantize_input(x.hidden, wanted)
            x = replace(x, hidden=hidden, scale=scale, act_quant=wanted)
        if member.reduces_topk:
            return member.apply(x, ws, into)
        out = weighted_topk_sum(member.apply(x, ws), x.topk_ids, x.topk_weights)
        return out if into is None else into.write(out)
