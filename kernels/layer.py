"""A whole MoE block: router -> routed experts + shared experts (the modular kernel runs both)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .activations import apply_activation
from .batch_invariant import row_by_row, triton_matmul
from .config import ActivationSpec, MoEConfig
from .input_checks import check_shapes
from .modular import DEFAULT_CHUNK_TOKENS, ModularKernel
from .routing import mask_rows, route
from .selection import RuleTable, Selection, select
from .stages import HAS_TRITON, PrepareFinalize, SideOutput
from .tensors import ExpertWeights, ForwardInputs, Routing
from .workspace import Workspace

if HAS_TRITON:
    from .row_kernels import router_logits_into, silu_and_mul

# Batches of at most this many tokens get their router logits from one Triton GEMV pass; a
# larger one reads the router's weights once per token there, and cuBLAS reads them once.
ROUTER_GEMV_TOKENS = 2


def on_tensor_cores(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `matmul_f32(a, b)` multiplies in a and b's own 16-bit dtype."""
    return a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)


def matmul_f32(a: torch.Tensor, b: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> float32 [M, N], accumulated in float32.

    On CUDA, 16-bit a and b of one dtype go to a tensor-core GEMM with float32 output as they
    are: no float32 copy of the weights per call (about 175 MB of traffic per forward for
    DeepSeek-V3's shared expert and router). Elsewhere both are widened to float32: the CPU has
    no such GEMM, and there the reference backend's results are compared with a float64 oracle.
    `batch_invariant` on CUDA: our Triton GEMM with one tile at every M, where cuBLAS picks its
    kernel, and so each row's summation order, by M (on the CPU callers go row by row).
    """
    if batch_invariant and a.is_cuda:
        return triton_matmul(a, b.T)
    if on_tensor_cores(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@dataclass
class RouterWeights:
    weight: torch.Tensor | None = None  # [E, H]; None: clients must send router logits
    bias: torch.Tensor | None = None  # [E]
    correction_bias: torch.Tensor | None = None  # [E] steers the choice only (DeepSeek-V3)

    def logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """hidden [M, H] -> float32 logits [M, E]."""
        if batch_invariant and not hidden.is_cuda:
            return row_by_row(functools.partial(self.logits, batch_invariant=False), hidden)
        if (
            not batch_invariant
            and hidden.shape[0] <= ROUTER_GEMV_TOKENS
            and on_tensor_cores(hidden, self.weight)
            and hidden.stride(1) == self.weight.stride(1) == 1
        ):  # one Triton pass instead of cuBLAS' split-K GEMM and its reduce (row_kernels.py)
            out = torch.empty(hidden.shape[0], self.weight.shape[0], device=hidden.device)
            return router_logits_into(out, hidden, self.weight, self.bias)
        logits = matmul_f32(hidden, self.weight.T, batch_invariant)
        return logits if self.bias is None else logits + self.bias.float()


@dataclass
class SharedExpert:
    """A dense SiLU MLP every token visits (DeepSeek shared_experts, Qwen2-MoE shared_expert)."""

    w13: torch.Tensor  # [2I_s, H], gate rows then up rows
    w2: torch.Tensor  # [H, I_s]
    gate: torch.Tensor | None = None  # [1, H]: Qwen2-MoE scales the output by sigmoid(x @ gate.T)

    def forward(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """hidden [M, H] -> float32 [M, H]."""
        if batch_invariant and not hidden.is_cuda:
            return row_by_row(functools.partial(self.forward, batch_invariant=False), hidden)
        invariant = batch_invariant  # from here on: on CUDA
        h = matmul_f32(hidden, self.w13.T, invariant)  # [M, 2I_s]
        if on_tensor_cores(hidden, self.w2):  # GEMM2 takes the layer's dtype, as vLLM and SGLang
            h = silu_and_mul(h, hidden.dtype)  # run it; as the line below, then .to, one pass
        else:
            h = apply_activation(h, ActivationSpec())  # [M, I_s]
        out = matmul_f32(h, self.w2.T, invariant)
        if self.gate is not None:
            out = out * torch.sigmoid(matmul_f32(hidden, self.gate.T, invariant))
        return out


def expert_tokens(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [M, k] (-1: nowhere) -> how many pairs each expert got, [E] int64.

    On the device and without a host sync (bincount sizes its output on the host)."""
    ids = torch.where(topk_ids >= 0, topk_ids, num_experts).flatten().long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))[:num_experts]


# The names a layer's tensors go by, in layer files too: the experts' are their field names.
ROUTER_TENSORS = {
    "weight": "gate",
    "bias": "gate_bias",
    "correction_bias": "e_score_correction_bias",
}
SHARED_TENSORS = {"w13": "shared_w13", "w2": "shared_w2", "gate": "shared_gate"}


@dataclass
class LayerWeights:
    experts: ExpertWeights
    router: RouterWeights
    shared: SharedExpert | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor present, by its name (ExpertWeights' fields, ROUTER_/SHARED_TENSORS)."""
        named = dict(self.experts.tensors())
        for part, names in ((self.router, ROUTER_TENSORS), (self.shared, SHARED_TENSORS)):
            if part is not None:
                named |= {names[f]: t for f, t in vars(part).items() if t is not None}
        return named

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> LayerWeights:
        """The inverse of `tensors`."""
        experts = ExpertWeights(**{n: named[n] for n in ExpertWeights.names() if n in named})
        router = RouterWeights(**{f: named.get(n) for f, n in ROUTER_TENSORS.items()})
        shared = None
        if SHARED_TENSORS["w13"] in named:
            shared = SharedExpert(**{f: named.get(n) for f, n in SHARED_TENSORS.items()})
        return cls(experts, router, shared)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class LayerOutput:
    output: torch.Tensor  # [M, H] in the layer's dtype
    routing: Routing


class MoELayer:
    def __init__(self, cfg: MoEConfig, kernel: ModularKernel, weights: LayerWeights) -> None:
        self.cfg = cfg
        self.kernel = kernel
        self.router = weights.router
        self.shared = weights.shared
        device = kernel.workspace.device
        # the shared experts' stream (kernels/modular.py); None: in line, in the caller's stream.
        # Default priority: below the stream graphs capture on (kernels/graph_capture.py)
        self.side_stream = (
            torch.cuda.Stream(device) if self.shared is not None and device.type == "cuda" else None
        )

    def forward(
        self,
        inputs: ForwardInputs,
        valid_rows: torch.Tensor | None = None,
        workspace: Workspace | None = None,
    ) -> LayerOutput:
        """inputs [M, H] (+ logits [M, E]) -> output [M, H] in the layer's dtype and routing.

        `valid_rows` (a 0-d int64 tensor on the device, for CUDA graphs): rows from it on are
        padding; where the experts can skip a pair (`supports_expert_map`) their topk_ids are
        set to -1 on the device, so they cost nothing in the experts. `workspace` replaces the
        kernel's shared one (a graph's buffers must not move when another layer grows it).
        """
        cfg = self.cfg
        check_shapes(cfg, inputs, has_router=self.router.weight is not None)
        hidden, logits = inputs.hidden_states, inputs.router_logits
        invariant = self.batch_invariant
        if logits is None:
            logits = self.router.logits(hidden, invariant)
        skip_padding = valid_rows is not None and self.kernel.experts.supports_expert_map
        routing = self.route(logits, valid_rows if skip_padding else None)
        shared = None if self.shared is None else functools.partial(self.shared_output, hidden)
        out = self.kernel.forward(hidden.to(cfg.dtype), routing, workspace=workspace, shared=shared)
        return LayerOutput(out, routing)

    def shared_output(self, hidden: torch.Tensor) -> SideOutput:
        """The shared experts' float32 output for hidden [M, H], queued on the side stream
        where there is one, after all the caller's stream holds so far (kernels/modular.py says
        when the kernel calls this). The caller's stream joins it where the sum reads it
        (SideOutput.wait); buffers need no record_stream: each forward's side work first waits
        for the caller's stream, so none of it reuses memory the previous forward still reads."""
        if self.side_stream is None:
            return SideOutput(self.shared.forward(hidden, self.batch_invariant))
        self.side_stream.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(self.side_stream):
            value = self.shared.forward(hidden, self.batch_invariant)
            ready = torch.cuda.Event()
            ready.record(self.side_stream)
        return SideOutput(value, ready)

    @property
    def batch_invariant(self) -> bool:
        """Whether each row's output is independent of its batch (kernels/batch_invariant.py)."""
        return self.kernel.experts.batch_invariant

    def route(self, logits: torch.Tensor, valid_rows: torch.Tensor | None = None) -> Routing:
        """logits [M, E] -> routing (rows from `valid_rows` on routed nowhere); batch-invariant
        on the CPU, row by row (its elementwise sigmoid, vectorised or not by position, differs
        by an ulp)."""
        if self.batch_invariant and not logits.is_cuda:

            def one(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                routing = route(row, self.cfg.routing, self.router.correction_bias)
                return routing.topk_ids, routing.topk_weights

            ids, weights = row_by_row(one, logits)
            return Routing(ids if valid_rows is None else mask_rows(ids, valid_rows), weights)
        return route(logits, self.cfg.routing, self.router.correction_bias, valid_rows)


def build_layer(
    cfg: MoEConfig,
    weights: LayerWeights,
    device: torch.device,
    backend: str = "auto",
    workspace: Workspace | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    expert_map: torch.Tensor | None = None,
    prepare_finalize: PrepareFinalize | None = None,
    batch_invariant: bool = False,
    rules: RuleTable | None = None,
) -> tuple[MoELayer, Selection]:
    """Pick a backend for the layer on `device` and compose its modular kernel.

    `weights` must already be on `device`. Layers built with the same `workspace` share it.
    `chunk_tokens`: the most tokens one pass through the experts takes (ModularKernel).
    Expert parallelism: `weights` holds this rank's experts, `expert_map` [E] maps each global
    expert id to its local id (-1: another rank's), the backend is chosen among those that take
    an expert_map, and `prepare_finalize` is the collective stage (default: naive-ep's).
    `batch_invariant`: each row's output independent of its batch, among the backends that can.
    `rules`: the table `auto` follows instead of this GPU's (the kernel benchmark's own).
    """
    choice = select(cfg, device, backend, expert_map is not None, batch_invariant, rules)
    experts = (
        choice.experts(cfg, weights.experts, batch_invariant=True)
        if batch_invariant
        else choice.experts(cfg, weights.experts)
    )
    kernel = ModularKernel(
        prepare_finalize or choice.prepare_finalize(),
        experts,
        workspace or Workspace(device),
        expert_map,
        chunk_tokens,
    )
    return MoELayer(cfg, kernel, weights), choice
