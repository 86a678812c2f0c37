"""The modular kernel: one PrepareFinalize composed with one Experts.

    routing -> prepare (quantise, dispatch) -> experts (GEMM1 -> act -> GEMM2) -> finalize
            `-> [shared experts, on a side stream] ------------------------------^ (+ their output)

Built once per layer. It checks the two stages agree on the activation format, reserves the
experts' workspaces for `chunk_tokens` up front, and splits larger inputs into chunks of that
size when the experts allow it. The service passes its --max-batch-tokens, so a batch is never
split and the workspace holds exactly the largest batch.

A layer's shared experts run beside the routed experts: on GPUs `MoELayer` has them queued on a
side stream after the first prepare, which the side stream waits for, and their output
(`SideOutput`) is waited for only by the pass that adds it. In line, a one-token DeepSeek-V3
forward runs their three cuBLAS GEMMs between the routing and the routed experts, on the
forward's critical path. Queued before the router, they hold up its GEMM and the routing
kernel; queued before naive-ep's broadcast completes, they slow its sender's broadcast and so
every other rank. Their float32 output joins the routed sum before its one rounding: experts
that reduce top-k add it in their own sum's pass (`PrepareFinalize.sum_target` says where that
sum goes), else the finalize does; adding it afterwards to the rounded routed output would take
two more passes over the output and round twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .batch_invariant import fixed_order_topk_sum
from .stages import DispatchSpec, Experts, PrepareFinalize, SideOutput
from .tensors import Routing
from .workspace import Workspace

DEFAULT_CHUNK_TOKENS = 8192  # for callers without a batch size of their own (tests, benchmarks)


class ModularKernel:
    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        workspace: Workspace,
        expert_map: torch.Tensor | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        if prepare_finalize.format != experts.format:
            raise ValueError(
                f"{prepare_finalize.name} dispatches in the {prepare_finalize.format} format "
                f"but {experts.name} takes {experts.format}"
            )
        if expert_map is not None and not experts.supports_expert_map:
            raise ValueError(f"{experts.name} does not support an expert_map")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.workspace = workspace
        self.chunk_tokens = chunk_tokens  # tokens per prepare -> experts -> finalize pass
        cfg = experts.cfg
        self.spec = DispatchSpec(
            act_quant=experts.act_quant(),
            wire_quant=experts.wire_quant(),
            column_blocks=experts.sum_in_column_blocks,
            num_local_experts=experts.weights.num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        )
        workspace.reserve(experts.workspace_shapes(chunk_tokens))

    def forward(
        self,
        hidden: torch.Tensor,
        routing: Routing,
        out: torch.Tensor | None = None,
        workspace: Workspace | None = None,
        shared: Callable[[], SideOutput] | None = None,
    ) -> torch.Tensor:
        """hidden [M, K] + routing -> [M, K] in hidden's dtype (written into `out` if given).

        `workspace` replaces the kernel's own for this call (CUDA graphs own their buffers).
        `shared()` queues the shared experts and returns their float32 output [M, K], added to
        the routed sum; called once, after the first prepare (module doc)."""
        out = torch.empty_like(hidden) if out is None else out
        ws = self.workspace if workspace is None else workspace
        m = self.prepare_finalize.planned_tokens(hidden)  # rows past this rank's end are empty
        step = self.chunk_tokens if self.experts.supports_chunking else max(m, 1)
        queue_shared, shared = shared, None
        for start in range(0, m, step):
            rows = slice(start, start + step)
            chunk = Routing(routing.topk_ids[rows], routing.topk_weights[rows])
            x = self.prepare_finalize.prepare(hidden[rows], chunk, self.spec, ws)
            if queue_shared is not None and shared is None:
                shared = queue_shared()
            extra = None if shared is None else shared.rows(rows)
            if self.experts.reduces_topk:
                into = self.prepare_finalize.sum_target(x, out[rows], extra, ws, self.spec)
                y = self.experts.apply(x, ws, into)
                left = extra if into.extra is None else None
                self.prepare_finalize.finalize(y, x, out[rows], reduce=False, extra=left)
                continue
            y = self.experts.apply(x, ws)
            reduce = True
            if self.experts.batch_invariant:  # standard format: [M, k, K]
                y, reduce = fixed_order_topk_sum(y, x.topk_ids, x.topk_weights), False
            self.prepare_finalize.finalize(y, x, out[rows], reduce=reduce, extra=extra)
        if queue_shared is not None and shared is None:  # no chunk: no tokens on any rank
            queue_shared().wait()  # joined all the same; elsewhere each chunk's sum joined it
        return out
