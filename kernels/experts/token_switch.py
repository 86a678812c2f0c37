"""Auto's answer when measurements show different backends winning at different token counts:
one experts stage that runs, per call, the backend measured fastest for that many tokens.

Each member is built on the same weights (a backend that converts weights at build time keeps
its own copy, so the layer's device memory is the members' sum). Every member takes the
standard format; a member that leaves weight-and-reduce to finalize is reduced here, so the
switch always returns [M, K].
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from typing import ClassVar

import torch

from kernels.config import MoEConfig
from kernels.quant_scheme import QuantScheme
from kernels.quantize import quantize_activation
from kernels.stages import Experts, weighted_topk_sum
from kernels.tensors import Dispatched, ExpertWeights, Format
from kernels.workspace import Workspace

Plan = tuple[tuple[int, type[Experts]], ...]  # (from this many tokens, run this), ascending


class TokenSwitchExperts(Experts):
    format: ClassVar[Format] = Format.STANDARD
    schemes: ClassVar[frozenset[QuantScheme]] = frozenset(QuantScheme)
    reduces_topk: ClassVar[bool] = True
    plan: ClassVar[Plan]

    @classmethod
    def over(cls, plan: Plan) -> type[TokenSwitchExperts]:
        """The switch for `plan`, as a class `registry.select` can hand out like any backend;
        its name reads `a<64<=b`: a below 64 tokens, b from 64 on."""
        if plan[0][0] != 0 or any(m.format != Format.STANDARD for _, m in plan):
            raise ValueError("a token switch starts at 0 tokens and takes standard-format members")
        name = plan[0][1].name + "".join(f"<{m}<={member.name}" for m, member in plan[1:])
        return type(
            "TokenSwitch",
            (cls,),
            {
                "name": name,
                "plan": plan,
                "supports_expert_map": all(m.supports_expert_map for _, m in plan),
                "supports_chunking": all(m.supports_chunking for _, m in plan),
                # fp8 input only if every member takes it; the others are quantised per call
                "takes_quantized_input": all(m.takes_quantized_input for _, m in plan),
            },
        )

    def __init__(self, cfg: MoEConfig, weights: ExpertWeights) -> None:
        super().__init__(cfg, weights)
        self.bounds = [m for m, _ in self.plan]
        self.members = [member(cfg, weights) for _, member in self.plan]
        self.last_ran = ""

    def workspace_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for member in self.members:
            shapes |= member.workspace_shapes(num_tokens)
        return shapes

    def apply(self, x: Dispatched, ws: Workspace) -> torch.Tensor:
        member = self.members[bisect_right(self.bounds, x.num_tokens) - 1]
        self.last_ran = member.name
        wanted = member.act_quant()
        if x.act_quant != wanted:  # only an unquantised input can reach a member that wants fp8
            hidden, scale = quantize_activation(x.hidden, wanted)
            x = replace(x, hidden=hidden, scale=scale, act_quant=wanted)
        out = member.apply(x, ws)
        return out if member.reduces_topk else weighted_topk_sum(out, x.topk_ids, x.topk_weights)
